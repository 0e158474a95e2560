"""Step speed of the paged KV cache against dense rows on the real pair (`resources.kv_cache`, 2026-11-27).

    python bench/paged_speed.py [--batches 1,8,32] [--methods none,draft_model] [--max-new 64] [--repeats 2]

Held-out chat prompts, each cut to a length drawn from [--min-len, its own] tokens of a long shared context (mixed
lengths, as the paged cache is for), greedy, a job's defaults otherwise (`draft_model`: goodput; profiles measured
first, untimed). Per batch size and method, dense and paged runs alternate (`--repeats` each); prints tokens/s of
each and the ratio paged / dense (the median of the pairs), and checks that both give the same tokens.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(__file__))
from engine_speed import add_model_args, describe, load_bench_pair, timed_generate  # noqa: E402
from prompts import HELD_OUT, chat_ids  # noqa: E402

from specdec.config import SamplingParams, SpecConfig  # noqa: E402
from specdec.engine import SpecEngine  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--methods", default="none,draft_model")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--min-len", type=int, default=50)
    ap.add_argument("--max-len", type=int, default=600)
    add_model_args(ap)
    args = ap.parse_args()
    pair = load_bench_pair(args)
    chats = chat_ids(pair.tokenizer, HELD_OUT)
    context = [t for c in chats for t in c]  # every prompt: a different cut of the chats run together
    batches = [int(b) for b in args.batches.split(",")]
    prompts = []
    for i in range(max(batches)):
        n = args.min_len + (i * 7919) % (args.max_len - args.min_len + 1)
        start = (i * 104729) % max(1, len(context) - n)
        prompts.append(context[start:start + n])
    print(f"# paged / dense KV cache, {describe(pair)}, {args.max_new} new tokens, prompts of {args.min_len}-"
          f"{args.max_len} tokens, greedy, {args.repeats} alternating repeats")
    print(f"{'method':12s} {'batch':>5s} {'dense tok/s':>11s} {'paged tok/s':>11s} {'paged/dense':>11s} {'same':>5s}")
    for method in args.methods.split(","):
        for bs in batches:
            engines = {layout: SpecEngine(pair, SamplingParams(max_new_tokens=args.max_new), SpecConfig(method=method),
                                          batch_size=bs, kv_cache=layout) for layout in ("dense", "paged")}
            for e in engines.values():
                e.measure_costs()
                e.generate(prompts[:bs])  # caches allocated and steps warmed, untimed
            runs = {layout: [] for layout in engines}
            for _ in range(args.repeats):
                for layout, e in engines.items():
                    runs[layout].append(timed_generate(e, prompts[:bs]))
            same = all(d["tokens"] == p["tokens"] for d, p in zip(runs["dense"], runs["paged"]))
            ratio = statistics.median(p["tok_s"] / d["tok_s"] for d, p in zip(runs["dense"], runs["paged"]))
            dense = statistics.median(r["tok_s"] for r in runs["dense"])
            paged = statistics.median(r["tok_s"] for r in runs["paged"])
            print(f"{method:12s} {bs:5d} {dense:11.1f} {paged:11.1f} {ratio:11.2f} {str(same):>5s}", flush=True)


if __name__ == "__main__":
    main()
