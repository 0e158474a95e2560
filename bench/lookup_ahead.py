"""Prompt lookup's rounds drafted ahead against rounds that wait for their read-back, paired in one run: chains
(`device_chains`) and AASD's token trees (`device_trees`) built from the device's tokens while the round before is in
flight (`Proposer.ahead_pays`: a GPU's default) against the host pools' drafts after each read-back (a CPU's).

    python bench/lookup_ahead.py [--batches 1,8,32] [--n 32] [--max-new 64] [--settings chains:k=4,trees:k=4:s=2]
                                 [--repeats 2] [--capture-budget S] [--out FILE]
                                 [--target ... --target-gguf ... --dtype ... --device ...]

The demo's target (or `--target`), code-completion prompts (stdlib n-r, bench/code_prompts.py: code repeats
itself, so lookups hit), greedy, fixed draft lengths (k tokens; s alignment siblings for trees). Per batch size
and setting: one untimed generate() per engine (captures, compilation), then per repeat waiting, ahead, ahead,
waiting (drift cancels); tok/s medians, ahead / waiting, the share of rounds queued before the one before was read
back (`Staging.trace`), whether every row's tokens are the same both ways (they must be), the target's step path
and how many token trees' steps it captured. On a CPU both ways do the same work, so the ratio says nothing there:
it is for a GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from code_prompts import code_prompts  # noqa: E402
from engine_speed import add_model_args, describe, load_bench_pair, sync  # noqa: E402
from overlap_share import followed  # noqa: E402

from specdec.config import SamplingParams, SpecConfig  # noqa: E402
from specdec.engine import SpecEngine  # noqa: E402
from specdec.spec.proposers.base import Proposer  # noqa: E402


def setting(text: str) -> tuple[str, SpecConfig]:
    """chains:k=K or trees:k=K:s=S -> (its name, its SpecConfig)."""
    kind, *fields = text.split(":")
    values = dict(f.split("=") for f in fields)
    if kind not in ("chains", "trees") or "k" not in values or (kind == "trees") != ("s" in values):
        raise SystemExit(f"--settings: {text!r} is not chains:k=K or trees:k=K:s=S")
    lookup = {"alignment_sampling": int(values["s"])} if kind == "trees" else {}
    return text, SpecConfig(method="prompt_lookup", draft_length="fixed", num_draft_tokens=int(values["k"]),
                            prompt_lookup=lookup)


def timed(eng: SpecEngine, prompts, ahead: bool) -> tuple[float, float, list[list[int]]]:
    """One generate(), rounds drafted ahead or not: tok/s, the share of rounds queued ahead, the rows' tokens."""
    Proposer.ahead_pays = property(lambda self: ahead)
    sync(eng.device)
    t = time.perf_counter()
    queued, rounds, out = followed(eng, prompts, None)
    sync(eng.device)
    wall = time.perf_counter() - t
    return sum(len(r.token_ids) for r in out) / wall, queued / max(1, rounds), [r.token_ids for r in out]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.set_defaults(draft="none")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--n", type=int, default=32, help="prompts (a batch size above it takes them all)")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--settings", default="chains:k=4,trees:k=4:s=2")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--capture-budget", type=float, default=None, help="seconds each engine captures steps (a GPU)")
    ap.add_argument("--out", default=None, help="also write the lines to this file")
    args = ap.parse_args()
    settings = [setting(s) for s in args.settings.split(",")]
    pair = load_bench_pair(args)
    prompts = [pair.tokenizer(c["prompt"], add_special_tokens=False)["input_ids"] for c in code_prompts(args.n)]
    lines = [f"# {describe(pair)}; {len(prompts)} code prompts, {args.max_new} new tokens, greedy; tok/s medians of "
             f"{args.repeats} (waiting, ahead, ahead, waiting each)",
             f"{'batch':>5s} {'setting':18s} {'waiting':>8s} {'ahead':>8s} {'ratio':>6s} {'queued ahead':>12s} same "
             "step-path tree-steps"]
    print("\n".join(lines), flush=True)
    for bs in [int(b) for b in args.batches.split(",")]:
        for name, spec in settings:
            eng = SpecEngine(pair, SamplingParams(max_new_tokens=args.max_new), spec, batch_size=bs,
                             capture_budget=args.capture_budget)
            eng.generate(prompts)  # untimed: captures, compilation
            runs = {False: [], True: []}
            for _ in range(args.repeats):
                for ahead in (False, True, True, False):
                    runs[ahead].append(timed(eng, prompts, ahead))
            wait, ahead = (statistics.median(r[0] for r in runs[a]) for a in (False, True))
            same = all(r[2] == runs[False][0][2] for r in runs[False] + runs[True])
            share = statistics.median(r[1] for r in runs[True])
            graphs = getattr(eng.runner("target"), "graphs", None)
            trees = sum(key[3] == "tree" for key in graphs.graphs) if graphs is not None else 0
            lines.append(f"{bs:5d} {name:18s} {wait:8.1f} {ahead:8.1f} {ahead / wait:6.2f} {share:12.2f} {same} "
                         f"{eng.step_path} {trees}")
            print(lines[-1], flush=True)
            if args.out:  # after every line: a deadline keeps what was measured
                with open(args.out, "w") as f:
                    f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
