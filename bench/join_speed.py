"""Rows that join a running batch: their prefill's tail in the round's forward beside the other rows' verification
(one pass over the weights), against a forward of their own before the round.

    python bench/join_speed.py [--rows 48] [--batch 8] [--max-new 32] [--repeats 3] [--methods none,draft_model]
        [--prompts chat|synthesis]

Held-out chat prompts (bench/prompts.py, 30-60 tokens; `--prompts synthesis`: the ~1,000-token rows of
bench/prefix_speed.py, prefix caching on) run through a batch smaller than the job; each row's max_new_tokens lies
between a quarter of `--max-new` and all of it, so that rows end at different rounds (as EOS ends them in real jobs)
and others join as they do. For each method the two settings (`SpecEngine(join_prefills=...)`), each with its own engine (a
draft-length policy learns from its engine's rounds alone), alternate over the repeats in one process:
prints tokens/s, the ratio joined/apart (median and range), the target forwards of each, and whether the tokens are
the same.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from engine_speed import add_model_args, describe, load_bench_pair  # noqa: E402
from prefix_speed import ALIASES, prompts, timed  # noqa: E402
from prompts import HELD_OUT, chat_ids  # noqa: E402

from specdec.config import SamplingParams, SpecConfig  # noqa: E402
from specdec.engine import SpecEngine  # noqa: E402
from specdec.exec.runner import ModelRunner  # noqa: E402


def counted(eng: SpecEngine, ids: list[list[int]], params: list[SamplingParams]) -> tuple[dict, int]:
    """A timed run of the job, and the target's forwards in it (prefills, steps, joined steps)."""
    calls = {"forwards": 0}
    real = {name: getattr(ModelRunner, name) for name in ("prefill", "step", "step_joined")}

    def spy(name):
        def call(self, *args, **kwargs):
            if self is eng._runners.get("target"):
                calls["forwards"] += 1
            return real[name](self, *args, **kwargs)
        return call

    for name in real:
        setattr(ModelRunner, name, spy(name))
    try:
        return timed(eng, ids, params), calls["forwards"]
    finally:
        for name, f in real.items():
            setattr(ModelRunner, name, f)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=48)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--methods", default="none,draft_model")
    ap.add_argument("--prompts", choices=("chat", "synthesis"), default="chat")
    add_model_args(ap)
    args = ap.parse_args()
    torch.manual_seed(0)
    pair = load_bench_pair(args)
    ids = chat_ids(pair.tokenizer, (HELD_OUT * (args.rows // len(HELD_OUT) + 1))[: args.rows]) \
        if args.prompts == "chat" else prompts(pair.tokenizer, args.rows)
    lens = [len(p) for p in ids]
    quarter = max(1, args.max_new // 4)
    params = [SamplingParams(max_new_tokens=quarter + 7919 * i % (args.max_new - quarter + 1)) for i in range(len(ids))]
    print(f"# {args.rows} rows of {min(lens)}-{max(lens)} prompt tokens ({args.prompts}), batch {args.batch}, "
          f"{quarter}-{args.max_new} new tokens, greedy, {describe(pair)}")
    print("method       | joined tok/s | apart tok/s | ratio joined/apart (range) | target forwards joined/apart | "
          "same tokens")
    for method in args.methods.split(","):
        spec = dict(ALIASES.get(method, {"method": method}))
        engines, runs = {}, {True: [], False: []}
        for join in runs:  # an engine per setting: a draft-length policy learns from its own rounds alone
            engines[join] = SpecEngine(pair, SamplingParams(max_new_tokens=args.max_new), SpecConfig(**spec),
                                       batch_size=args.batch, prefix_caching=args.prompts == "synthesis",
                                       join_prefills=join)
            engines[join].measure_costs()
            engines[join].generate(ids[:2])  # warm: kernels, allocator, cache sizes
        for _ in range(args.repeats):
            for join in runs:
                runs[join].append(counted(engines[join], ids, params))
        ratios = [a[0]["tok_s"] / b[0]["tok_s"] for a, b in zip(runs[True], runs[False])]
        med = {j: statistics.median(r[0]["tok_s"] for r in runs[j]) for j in runs}
        same = all(r[0]["tokens"] == runs[True][0][0]["tokens"] for j in runs for r in runs[j])
        print(f"{method:12s} | {med[True]:12.1f} | {med[False]:11.1f} | {statistics.median(ratios):.2f} "
              f"({min(ratios):.2f}-{max(ratios):.2f}) | {runs[True][0][1]} / {runs[False][0][1]} | {same}")


if __name__ == "__main__":
    main()
