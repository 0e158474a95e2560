"""A real-shape pair with the acceptance you choose: the Llama-3.1-8B shape as target and the Llama-3.2-1B shape as
draft, random weights (`--shapes llama8b,llama1b`; `tiny` for both checks the script on a CPU). The draft's forwards
run for their true cost, but the tokens it proposes are replaced by the target's own greedy continuation (recorded
by an autoregressive run first), each token kept with probability alpha and otherwise changed to another: the
verification is real and lossless, and the acceptance is alpha by construction. The target's weights are random
but planted (`plant_chain`): its greedy next token is a fixed function of the current one, by a margin no
rounding closes, so a verification of any width keeps the autoregressive run's tokens in bfloat16 too (plain
random weights leave near-ties that a wider step's rounding parts: acceptance fell to 0.02 on an H200).

    python bench/shape_pair.py [--device cuda] [--shapes llama8b,llama1b] [--alpha 0.8] [--batches 1,8,32,64]
                               [--max-new 64] [--prompt-len 128] [--ks 1,2,3,4,6] [--dtype bfloat16] [--json FILE]
                               [--no-split] [--deadline SECONDS]

Per batch size (that many random prompts, one batch): autoregressive tok/s; the defaults (draft_model, goodput;
its cost profile measured first, untimed); every fixed K and the best; their ratios to autoregressive; tokens per
target call; the measured alpha (accepted / (accepted + rejected positions), over the fixed-K runs); whether every
row of every run equals autoregressive's tokens; and each run's time per round split into the draft's forwards,
the target's, and the rest (the round's host work and scans). Every engine runs once untimed first (captures,
compilation), then once timed. tok/s = generated tokens / wall time, prefill included. `--json` writes, per batch
size: ar_tok_s, defaults_tok_s, best_fixed_k, best_fixed_tok_s, tokens_per_call (the defaults'), alpha_measured,
equal_to_ar, and new_shapes (the most step shapes a timed run met first: on a GPU each is captured inside it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from policies import step_shapes  # noqa: E402
from step_speed import random_model, sync  # noqa: E402

from specdec.config import SamplingParams, SpecConfig  # noqa: E402
from specdec.engine import SpecEngine  # noqa: E402
from specdec.exec.inputs import to_device  # noqa: E402
from specdec.exec.models import ModelPair  # noqa: E402
from specdec.exec.runner import ModelRunner  # noqa: E402
from specdec.spec.proposers.draft_model import DraftModelProposer  # noqa: E402


def plant_chain(model, scale: float = 64.0, seed: int = 0) -> torch.Tensor:
    """Make a random model's greedy next token a fixed function of the token it reads, with a wide margin: each
    token's embedding (rms `scale`) outweighs what the layers add to the residual stream (a few units at init),
    and the head scores token perm[t] by t's own embedding, so perm[t]'s logit is about sqrt(hidden) standard
    deviations above the rest. The forwards cost what they cost (dense kernels do not look at values); the head is
    untied from the embeddings. Returns perm."""
    emb = model.get_input_embeddings().weight
    vocab, hidden = emb.shape
    g = torch.Generator().manual_seed(seed)
    e = torch.randn(vocab, hidden, generator=g)
    perm = torch.randperm(vocab, generator=g)
    head = torch.empty_like(e)
    head[perm] = e / e.norm(dim=1, keepdim=True)
    with torch.no_grad():
        emb.copy_(scale * e)
        model.lm_head.weight = torch.nn.Parameter(head.to(emb.device, emb.dtype), requires_grad=False)
    return perm


class Oracle:
    """Replaces a draft model's proposed chains by the target's greedy continuations (`known`: each prompt's, as
    a tuple, -> its prompt and the autoregressive tokens), each token kept with probability `alpha`, else changed
    to another at random; the draft's forwards run as before."""

    def __init__(self, alpha: float, vocab: int, seed: int = 0):
        self.alpha, self.vocab = alpha, vocab
        self.rng = np.random.default_rng(seed)
        self.known: dict[tuple[int, ...], list[int]] = {}
        self.rows: tuple | None = None  # the rows whose continuations `table` holds, on the device
        self.table: torch.Tensor | None = None
        self.real = DraftModelProposer.propose

    def __enter__(self):
        oracle = self

        def propose(proposer, n, limits, rows, draws, siblings=None):
            draft = oracle.real(proposer, n, limits, rows, draws, siblings)
            return oracle.replace(proposer.slots, draft) if draft.tokens.shape[1] else draft

        DraftModelProposer.propose = propose
        return self

    def __exit__(self, *exc):
        DraftModelProposer.propose = self.real

    def replace(self, slots, draft):
        """The draft with each row's tokens replaced (as drafted where a row's prompt is not known: the start-up
        profile's synthetic rows). Built on the device from the rows' lengths there (`lens_dev`: a round queued
        ahead of the host's read-back starts where the round in flight ends), so the host waits for nothing."""
        n, k = draft.tokens.shape
        rows = tuple(tuple(slots.history[i][: int(slots.prompt_lens[i])]) for i in range(n))
        if any(r not in self.known for r in rows):
            return draft
        if rows != self.rows:  # the batch's rows changed: their continuations to the device, once
            table = np.zeros((n, max(len(self.known[r]) for r in rows) + k), dtype=np.int64)
            for i, r in enumerate(rows):
                table[i, : len(self.known[r])] = self.known[r]
            self.rows, self.table = rows, to_device(table, slots.device)
        at = slots.lens_dev[:n, None].long() + torch.arange(k, device=self.table.device)  # x_1: each row's next
        want = self.table.gather(1, at.clamp(max=self.table.shape[1] - 1))
        keep = to_device(self.rng.random((n, k)) < self.alpha, slots.device)
        other = (want + to_device(1 + self.rng.integers(0, self.vocab - 1, size=(n, k)), slots.device)) % self.vocab
        return replace(draft, tokens=torch.where(keep, want, other))


class StepClock:
    """Seconds inside each runner's `step` (the draft's and the target's forwards), by runner."""

    def __init__(self):
        self.seconds: dict[int, float] = {}
        self.real = ModelRunner.step

    def __enter__(self):
        clock = self

        def step(runner, *a, **kw):
            sync()
            t = time.perf_counter()
            out = clock.real(runner, *a, **kw)
            sync()
            clock.seconds[id(runner)] = clock.seconds.get(id(runner), 0.0) + time.perf_counter() - t
            return out

        ModelRunner.step = step
        return self

    def __exit__(self, *exc):
        ModelRunner.step = self.real


def run(eng: SpecEngine, prompts: list[list[int]], split: bool) -> dict:
    """One untimed generate(), then a timed one: tok/s, tokens per target call, the rows' tokens, the acceptance
    counts over every generate() it ran, and (`split`) ms per round in the draft's forwards, the target's and the
    rest (the split's syncs around each step cost a little: a separate run)."""
    eng.measure_costs()
    tested = [eng.generate(prompts)]
    sync()
    captured = eng.capture_s  # the first job's steps, captured before its rows joined
    shapes = step_shapes(eng)
    t = time.perf_counter()
    res = eng.generate(prompts)
    sync()
    wall = time.perf_counter() - t
    tested.append(res)
    out = {"tok_s": sum(r.generated_tokens for r in res) / wall, "tokens": [r.token_ids for r in res],
           "per_call": sum(r.generated_tokens for r in res) / max(1, sum(r.rounds for r in res)), "capture_s": captured,
           "new_shapes": step_shapes(eng) - shapes}
    if split:
        with StepClock() as clock:
            t = time.perf_counter()
            res = eng.generate(prompts)
            sync()
            wall = time.perf_counter() - t
        tested.append(res)
        rounds = max(r.rounds for r in res)
        target = clock.seconds.get(id(eng.runner("target")), 0.0)
        draft = sum(clock.seconds.values()) - target
        out["split_ms"] = tuple(1e3 * s / rounds for s in (draft, target, wall - draft - target))
    # every run's drafts test the acceptance, but a row's last round: max_new_tokens may cut what it accepted
    rounds = [(a, d) for run_ in tested for r in run_ for a, d in zip(r.accept_lengths[:-1], r.draft_lengths[:-1])]
    out["accepted"], out["rejected"] = sum(a for a, _ in rounds), sum(a < d for a, d in rounds)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", default="llama8b,llama1b", help="target,draft (one name: both)")
    ap.add_argument("--alpha", type=float, default=0.8)
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--ks", default="1,2,3,4,6", help="fixed draft lengths to run")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on a CPU")
    ap.add_argument("--no-split", action="store_true", help="skip the time split (a third run per engine)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--deadline", type=float, default=None, help="seconds after which no new batch size starts")
    args = ap.parse_args()
    start = time.perf_counter()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    names = args.shapes.split(",")
    target = random_model(names[0], device, dtype)
    plant_chain(target)
    draft = random_model(names[-1], device, dtype)
    vocab = target.config.vocab_size
    pair = ModelPair(target, draft, None, (), vocab)
    ks = [int(k) for k in args.ks.split(",")]
    g = torch.Generator().manual_seed(1)
    print(f"# shape pair {names[0]} + {names[-1]}, random weights, {dtype}, {device}; alpha {args.alpha}; "
          f"{args.prompt_len}-token prompts, {args.max_new} new tokens; ms per round: draft / target / rest; "
          f"capture s: the first job's steps captured before its rows joined; shapes: step shapes first met in the "
          f"timed run (each a capture there, on a GPU)")
    print(f"{'batch':>5s} {'run':14s} {'tok/s':>9s} {'vs AR':>6s} {'tok/call':>8s} {'ms per round':>22s} "
          f"{'capture s':>9s} {'shapes':>6s}")
    results = {}
    for batch in [int(b) for b in args.batches.split(",")]:
        if args.deadline is not None and time.perf_counter() - start > args.deadline:
            print(f"# deadline: stopped before batch {batch}", flush=True)
            break
        prompts = torch.randint(0, vocab, (batch, args.prompt_len), generator=g).tolist()

        def engine(spec: SpecConfig) -> SpecEngine:
            return SpecEngine(pair, SamplingParams(max_new_tokens=args.max_new), spec, batch_size=batch)

        def show(name: str, r: dict, ar_tok_s: float) -> None:
            split = " / ".join(f"{s:.2f}" for s in r["split_ms"]) if "split_ms" in r else "-"
            print(f"{batch:5d} {name:14s} {r['tok_s']:9.1f} {r['tok_s'] / ar_tok_s:6.2f} {r['per_call']:8.2f} "
                  f"{split:>22s} {r['capture_s']:9.1f} {r['new_shapes']:6d}", flush=True)

        ar = run(engine(SpecConfig(method="none")), prompts, not args.no_split)
        show("autoregressive", ar, ar["tok_s"])
        with Oracle(args.alpha, vocab) as oracle:
            oracle.known = {tuple(p): p + t for p, t in zip(prompts, ar["tokens"])}
            defaults = run(engine(SpecConfig(method="draft_model")), prompts, not args.no_split)
            show("defaults", defaults, ar["tok_s"])
            fixed = {}
            for k in ks:
                oracle.rng = np.random.default_rng(k)  # each fixed run's draws its own, whatever ran before
                fixed[k] = run(engine(SpecConfig(method="draft_model", draft_length="fixed", num_draft_tokens=k,
                                                 max_draft_tokens=max(ks))), prompts, not args.no_split)
                show(f"fixed k={k}", fixed[k], ar["tok_s"])
        best = max(fixed, key=lambda k: fixed[k]["tok_s"])
        accepted, rejected = sum(r["accepted"] for r in fixed.values()), sum(r["rejected"] for r in fixed.values())
        results[batch] = {
            "ar_tok_s": ar["tok_s"], "defaults_tok_s": defaults["tok_s"], "best_fixed_k": best,
            "best_fixed_tok_s": fixed[best]["tok_s"], "tokens_per_call": defaults["per_call"],
            "alpha_measured": accepted / max(1, accepted + rejected),
            "equal_to_ar": all(r["tokens"] == ar["tokens"] for r in [defaults, *fixed.values()]),
            "new_shapes": max(r["new_shapes"] for r in [ar, defaults, *fixed.values()])}
        r = results[batch]
        print(f"# batch {batch}: defaults {r['defaults_tok_s'] / r['ar_tok_s']:.2f}x autoregressive, best fixed "
              f"k={best} {r['best_fixed_tok_s'] / r['ar_tok_s']:.2f}x; alpha measured {r['alpha_measured']:.3f}; "
              f"every row equal to autoregressive's: {r['equal_to_ar']}", flush=True)
        if args.json:  # after every batch size: a deadline or a kill keeps what was measured
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
