"""Draft-length policies on the real pair, held-out prompts, one run: fixed k, heuristic, confidence,
goodput and the SpecDec++ acceptance head (a threshold sweep), at several batch sizes.

    specbatch train-head configs/train_head_pair.yaml --out .cache/heads/smollm2-draft-4l   # once
    python bench/policies.py --head .cache/heads/smollm2-draft-4l [--batches 1,8] [--max-new 64]

Prints decode tokens/s and its ratio to autoregressive at the same batch size, tokens per target
call, acceptance rate, and SpecDec++'s hardware-independent figures: discard rate (discarded draft
tokens per generated token) and verification rate (target calls per generated token).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from engine_speed import add_model_args, describe, engine_run, load_bench_pair  # noqa: E402
from prompts import HELD_OUT, chat_ids  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", help="acceptance head folder (specbatch train-head)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--ks", default="1,2,3,4,5,6,7,8")
    ap.add_argument("--thresholds", default="0.3,0.5,0.7,0.9")
    ap.add_argument("--draft-vocab", type=int, default=8192)
    add_model_args(ap)
    args = ap.parse_args()
    pair = load_bench_pair(args)
    dv = args.draft_vocab
    print(f"# held-out chat prompts, max_new_tokens={args.max_new}, greedy, {args.dtype}, draft_vocab={dv}, "
          f"{describe(pair.device)}")
    engine_run(pair, chat_ids(pair.tokenizer, HELD_OUT[:2]), "draft_model", 2, 2, 8)  # warm-up
    print(f"{'policy':34s} {'batch':>5s} {'tok/s':>7s} {'vs AR':>6s} {'tok/call':>8s} {'accept':>6s} "
          f"{'discard':>7s} {'verify':>6s}")
    for bs in (int(b) for b in args.batches.split(",")):
        prompts = chat_ids(pair.tokenizer, (HELD_OUT * 4)[: max(bs, 8)])
        runs = [("autoregressive", dict(method="none", k=0))]
        runs += [(f"fixed k={k}", dict(method="draft_model", k=k)) for k in map(int, args.ks.split(","))]
        runs += [("heuristic", dict(method="draft_model", k=2, draft_length="heuristic")),
                 ("confidence 0.4", dict(method="draft_model", k=2, draft_length="confidence", max_draft_tokens=8)),
                 ("goodput", dict(method="draft_model", k=2, draft_length="goodput", max_draft_tokens=8))]
        if args.head:
            runs += [(f"acceptance_head h={t}", dict(method="draft_model", k=2, draft_length="acceptance_head",
                                                     acceptance_head_path=args.head, max_draft_tokens=8,
                                                     acceptance_head_threshold=float(t)))
                     for t in args.thresholds.split(",")]
        base = None
        for name, kw in runs:
            method, k = kw.pop("method"), kw.pop("k")
            r = engine_run(pair, prompts, method, bs, k, args.max_new, draft_vocab=dv, **kw)
            base = base or r
            acc = f"{r['accept']:.2f}" if r["accept"] is not None else "-"
            print(f"{name:34s} {bs:5d} {r['tok_s']:7.1f} {r['tok_s'] / base['tok_s']:6.2f} {r['per_call']:8.2f} "
                  f"{acc:>6s} {r['discard']:7.2f} {r['verify']:6.2f}", flush=True)


if __name__ == "__main__":
    main()
