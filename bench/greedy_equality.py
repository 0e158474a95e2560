"""Greedy rows of the real pair against transformers' `generate` on the same device: the scenario in which an H200
once gave 0 of 8 rows equal at batch 8 (float32, 8 held-out chat prompts, an engine budget of 128 new tokens, 48
asked per row), at each batch size and method. A check for the GPU kit's third call (where the real pair arrives),
not a timing: it prints, per method and batch size, how many rows equal transformers' tokens and the first token
where each other row parts.

    python bench/greedy_equality.py [--device cuda] [--dtype float32] [--batches 1,4,8] [--methods none,fixed]
                                    [--prompts 8] [--max-new 48] [--budget 128] [--capture-budget 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from engine_speed import add_model_args, describe, hf_run, load_bench_pair  # noqa: E402
from prompts import HELD_OUT, chat_ids  # noqa: E402

from specdec.config import SamplingParams, SpecConfig  # noqa: E402
from specdec.engine import SpecEngine  # noqa: E402

METHODS = {"none": SpecConfig(method="none"),
           "fixed": SpecConfig(method="draft_model", draft_length="fixed", num_draft_tokens=3)}


def parted(got: list[int], want: list[int]) -> int | None:
    """The first position where two token lists differ (None: equal)."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.set_defaults(dtype="float32")
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--methods", default="none,fixed", help=",".join(METHODS))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=48, help="tokens asked per row")
    ap.add_argument("--budget", type=int, default=128, help="the engine's max_new_tokens (caches and steps sized)")
    ap.add_argument("--capture-budget", type=float, default=5.0,
                    help="seconds each engine captures steps before its rows join (the rest: when first met)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    t0 = time.perf_counter()
    pair = load_bench_pair(args)
    prompts = chat_ids(pair.tokenizer, (HELD_OUT * 4)[: args.prompts])
    with torch.inference_mode():
        want = hf_run(pair, prompts, args.max_new)["tokens"]
    lines = [f"# {describe(pair)}; {len(prompts)} held-out chat prompts, {args.max_new} new tokens under a budget of "
             f"{args.budget}; rows equal transformers' generate (one prompt at a time); parted: each other row's first "
             f"differing token", f"{'method':8s} {'batch':>5s} {'equal':>6s} {'step path':12s} parted"]
    print("\n".join(lines), flush=True)
    for name in args.methods.split(","):
        for bs in [int(b) for b in args.batches.split(",")]:
            eng = SpecEngine(pair, SamplingParams(max_new_tokens=args.budget), METHODS[name], batch_size=bs,
                             capture_budget=args.capture_budget)
            out = eng.generate(prompts, params=[SamplingParams(max_new_tokens=args.max_new)] * len(prompts))
            where = [parted(r.token_ids, w) for r, w in zip(out, want)]
            same = sum(w is None for w in where)
            lines.append(f"{name:8s} {bs:5d} {same:3d}/{len(prompts):<2d} {eng.step_path:12s} "
                         f"{[w for w in where if w is not None]}")
            print(lines[-1], flush=True)
    lines.append(f"# {time.perf_counter() - t0:.0f} s")
    print(lines[-1])
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
