"""Where a round's time goes: the real pair, plain decoding against fixed-K speculation at one batch size, each
engine warmed on the same prompts first (graphs captured, first steps checked), then one generate() under
torch.profiler. Prints ms per round of each, and the ops that took the most host and device time.

    python bench/round_profile.py [--batch 32] [--k 2] [--max-new 64] [--out FILE]

On the first H100 lease (2026-11-26) a k=2 round at batch 32 took 12 ms against a plain step's 2 ms, while at
batch 1 it took 3.2 against 1.75: this says whether the host (Python, launches, syncs) or the device is the cost.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from engine_speed import add_model_args, describe, load_bench_pair, make_engine, sync  # noqa: E402
from prompts import HELD_OUT, chat_ids  # noqa: E402
from step_speed import log  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--top", type=int, default=20, help="ops listed per table")
    ap.add_argument("--out", default=None, help="also write the tables to this file")
    add_model_args(ap)
    args = ap.parse_args()
    pair = load_bench_pair(args)
    prompts = chat_ids(pair.tokenizer, (HELD_OUT * 16)[: max(8, math.ceil(2 * args.batch))])
    if args.out:  # each part is appended as it ends: a deadline keeps what came before it
        open(args.out, "w").close()
    log(args.out, f"# {describe(pair)}; batch {args.batch}, {len(prompts)} prompts, {args.max_new} new tokens, greedy")
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available() and str(pair.device).startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    for name, method, k in (("plain", "none", 0), (f"fixed k={args.k}", "draft_model", args.k)):
        eng = make_engine(pair, method, args.batch, max(k, 1), args.max_new)
        eng.generate(prompts)  # warm: every shape these prompts meet is captured and checked here
        sync(eng.device)
        t0 = time.perf_counter()
        out = eng.generate(prompts)
        sync(eng.device)
        wall = time.perf_counter() - t0
        rounds = max(r.rounds for r in out)  # the batch's rounds: rows share them
        with torch.profiler.profile(activities=activities) as prof:
            eng.generate(prompts)
            sync(eng.device)
        table = prof.key_averages()
        log(args.out, f"## {name}: {wall * 1e3 / rounds:.2f} ms per round ({rounds} rounds, "
                      f"{sum(r.generated_tokens for r in out) / wall:.0f} tok/s)")
        log(args.out, table.table(sort_by="self_cpu_time_total", row_limit=args.top))
        if len(activities) > 1:
            log(args.out, table.table(sort_by="self_device_time_total", row_limit=args.top))

if __name__ == "__main__":
    main()
