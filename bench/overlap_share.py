"""How many of a job's rounds are queued on the device before the host reads the round before back: counted with
the read-back's own hook (`Staging.trace`), on any device (a CPU gains nothing from it, but counts the same).

    python bench/overlap_share.py [--prompts 64] [--batch 16] [--ks 0,2] [--max-new 32-128]
                                  [--drafters draft_model,prompt_lookup,aasd,confidence] [--ahead-pays]

A random 2-layer Llama (96 tokens, 64 wide) as target, a noisy copy as draft, greedy; `--prompts` prompts of 10-59
tokens through a batch of `--batch`, each row's max_new_tokens drawn from the range (mixed ends), then all at the
range's top (ends together); per drafter and K (0: plain decoding): rounds followed before their read-back / rounds.
Drafters: a draft model (fixed K), prompt lookup (fixed K; its prompts repeat themselves, so chains are found), AASD
(prompt lookup's token trees, 2 alignment siblings) and a draft model under `confidence` (K: its most). All but the
first go ahead where drafting ahead pays (a GPU; `--ahead-pays` forces it on a CPU, for the counts a GPU gets). A
round that is not followed is one where every row ends, or one that waits for its read-back.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from engine_models import noisy_copy, pair, tiny_llama  # noqa: E402

from specdec.config import SamplingParams, SpecConfig  # noqa: E402
from specdec.engine import SpecEngine  # noqa: E402


def followed(eng: SpecEngine, prompts, params) -> tuple[int, int, list]:
    """(rounds whose successor was queued before the host waited for them, rounds, the results) of one generate()."""
    events = []
    eng.context.staging.trace = lambda event, r: events.append((event, r))
    out = eng.generate(prompts, params=params)
    at = {e: i for i, e in enumerate(events)}
    rounds = sorted(r for e, r in events if e == "wait")
    return sum(at.get(("launch", r + 1), len(events)) < at[("wait", r)] for r in rounds), len(rounds), out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--ks", default="0,2")
    ap.add_argument("--max-new", default="32-128")
    ap.add_argument("--drafters", default="draft_model")
    ap.add_argument("--ahead-pays", action="store_true", help="draft ahead at a cost on a CPU too (as on a GPU)")
    args = ap.parse_args()
    if args.ahead_pays:
        from specdec.spec.proposers.base import Proposer
        Proposer.ahead_pays = property(lambda self: True)
    lo, hi = (int(x) for x in args.max_new.split("-"))
    ks = [int(k) for k in args.ks.split(",")]
    target = tiny_llama(seed=4)
    draft = noisy_copy(target, 0.05)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 96, (int(n),), generator=g).tolist()
               for n in torch.randint(10, 60, (args.prompts,), generator=g)]
    mixed = [SamplingParams(max_new_tokens=int(m)) for m in torch.randint(lo, hi + 1, (args.prompts,), generator=g)]
    print(f"# {args.prompts} prompts, batch {args.batch}, greedy, tiny random Llama; rounds queued ahead / rounds")
    specs = {"draft_model": lambda k: dict(method="draft_model", draft_length="fixed", num_draft_tokens=k),
             "prompt_lookup": lambda k: dict(method="prompt_lookup", draft_length="fixed", num_draft_tokens=k),
             "aasd": lambda k: dict(method="prompt_lookup", draft_length="fixed", num_draft_tokens=k,
                                    prompt_lookup={"alignment_sampling": 2}),
             "confidence": lambda k: dict(method="draft_model", draft_length="confidence", max_draft_tokens=k)}
    runs = [("plain", {"method": "none"}, prompts)] if 0 in ks else []
    for drafter in args.drafters.split(","):
        for k in (k for k in ks if k):
            spec = specs[drafter](k)
            runs.append((f"{drafter} k={k}", spec, [p * 2 for p in prompts] if spec["method"] == "prompt_lookup"
                         else prompts))
    for label, spec, rows in runs:
        for name, params in ((f"max_new {lo}-{hi}", mixed), (f"max_new {hi}", None)):
            drafts = spec["method"] == "draft_model"
            eng = SpecEngine(pair(target, draft if drafts else None), SamplingParams(max_new_tokens=hi),
                             SpecConfig(**spec), batch_size=args.batch)
            ahead, rounds, _ = followed(eng, rows, params)
            print(f"{label:22s} {name:14s} {ahead:4d} / {rounds:4d} = {ahead / rounds:.2f}", flush=True)


if __name__ == "__main__":
    main()
