"""Prefill in chunks (`resources.prefill_chunk`) against one forward per admission, on the synthesis-shaped job of
bench/prefix_speed.py with prefix caching off, so that every row prefills its whole ~1,000-token prompt.

    python bench/prefill_chunk.py [--rows 16] [--batch 16] [--max-new 8] [--repeats 3] [--chunks none,8192,2048,1024]

For each chunk size (none: the whole admission in one forward) the same engine runs the job, the sizes alternating
over the repeats in one process: prints seconds per job, its ratio to `none` (median and range over the repeats),
whether the tokens are the same, and the prefill activations the memory plan counts for the first admission (its
largest forward: rows x tokens within the chunk, over the whole prompt's keys).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from engine_speed import add_model_args, describe, load_bench_pair  # noqa: E402
from prefix_speed import prompts, timed  # noqa: E402

from specdec.exec import memory  # noqa: E402
from specdec.config import SamplingParams, SpecConfig  # noqa: E402
from specdec.engine import SpecEngine  # noqa: E402


def planned(pair, chunk: int | None, rows: int, prompt: int) -> int:
    """Bytes of the first admission's prefill activations the memory plan counts with this chunk size."""
    role = memory.Role("target", memory.Shape.of(pair.target), False)
    plan = memory.MemoryPlan([role], 1.0, 0, 0, 1, 64, additive_mask=False, prefill_chunk=chunk)
    return plan.prefill(role, rows, prompt)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunks", default="none,8192,2048,1024")
    ap.add_argument("--method", default="none")
    add_model_args(ap)
    args = ap.parse_args()
    torch.manual_seed(0)
    pair = load_bench_pair(args)
    ids = prompts(pair.tokenizer, args.rows)
    lens = [len(p) for p in ids]
    chunks = [None if c == "none" else int(c) for c in args.chunks.split(",")]
    print(f"# {args.rows} rows of {min(lens)}-{max(lens)} prompt tokens, batch {args.batch}, {args.max_new} new "
          f"tokens, greedy, method {args.method}, prefix caching off, {describe(pair)}")
    engines = {c: SpecEngine(pair, SamplingParams(max_new_tokens=args.max_new), SpecConfig(method=args.method),
                             batch_size=args.batch, prefix_caching=False, prefill_chunk=c) for c in chunks}
    for eng in engines.values():
        eng.measure_costs()
        eng.generate(ids[:2])  # warm: kernels, allocator, cache sizes
    runs = {c: [] for c in chunks}
    for _ in range(args.repeats):
        for c in chunks:
            r = timed(engines[c], ids)
            r["s"] = sum(len(t) for t in r["tokens"]) / r["tok_s"]
            runs[c].append(r)
    base = runs[chunks[0]]
    print(f"{'chunk':>6s} {'s/job':>7s} {'vs ' + str(chunks[0]):>18s} {'same':>6s} {'planned prefill GiB':>20s}")
    for c in chunks:
        ratios = [a["s"] / b["s"] for a, b in zip(runs[c], base)]
        same = sum(a == b for a, b in zip(runs[c][-1]["tokens"], base[-1]["tokens"]))
        print(f"{str(c):>6s} {statistics.median(r['s'] for r in runs[c]):7.2f} "
              f"{statistics.median(ratios):8.3f} ({min(ratios):.3f}-{max(ratios):.3f}) {same:>3d}/{len(ids)} "
              f"{planned(pair, c, min(args.batch, args.rows), max(lens)) / memory.GiB:20.3f}")


if __name__ == "__main__":
    main()
