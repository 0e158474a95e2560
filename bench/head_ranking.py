"""How well acceptance heads rank drafted tokens on the benchmark's held-out prompts, against the draft's
own confidence q(token). A stop rule can do no better than its ranking of accepted against rejected
tokens, so this says, before any timing, whether a head can beat the `confidence` policy.

    python bench/head_ranking.py --head .cache/heads/proposing [--head ...] [--max-new 64]

Along the target's greedy answers to the held-out prompts (bench/prompts.py), the draft (teacher-forced)
proposes its argmax at every position, as the engine's greedy rounds do; a token is accepted when it is
the target's argmax. Prints, per head, AUC (the probability that an accepted token scores above a
rejected one), the weighted BCE loss the head was trained with, and mean predicted vs observed
acceptance; and the AUC of q(token) alone.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from engine_speed import add_model_args, describe, load_bench_pair, make_engine  # noqa: E402
from prompts import HELD_OUT, chat_ids  # noqa: E402

from specdec.config import SamplingParams  # noqa: E402
from specdec.plan.head import AcceptanceHead, auc, build_examples, weighted_bce  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", action="append", default=[], help="acceptance head folder (specbatch train-head); repeatable")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    add_model_args(ap)
    args = ap.parse_args()
    pair = load_bench_pair(args)
    prompts = chat_ids(pair.tokenizer, HELD_OUT)
    answers = make_engine(pair, "none", 8, 0, args.max_new).generate(prompts)
    sp = SamplingParams(max_new_tokens=args.max_new)
    print(f"# {len(prompts)} held-out prompts, greedy answers of {args.max_new} tokens, draft_vocab={args.draft_vocab}, "
          f"{describe(pair)}")
    rows = []
    for folder in args.head:
        head = AcceptanceHead.load(folder, pair.device)
        xs, ys = zip(*(build_examples(pair.target, pair.draft, p, a.token_ids, sp, head.cfg, torch.Generator(),
                                      pair.vocab_size, args.draft_vocab) for p, a in zip(prompts, answers)))
        x, y = torch.cat(xs), torch.cat(ys)
        if not rows and head.cfg.reads == "proposing":  # its last feature is log q(token)
            rows.append(("q(token) alone", auc(x[:, -1], y), None, None, y))
        with torch.no_grad():
            logits = head(x.to(pair.device)).cpu()
        pred = torch.softmax(logits, -1)[:, 1]
        rows.append((f"head {os.path.basename(folder.rstrip('/'))} ({head.cfg.reads})", auc(pred, y),
                     float(weighted_bce(logits, y, head.cfg.w_rej)), float(pred.mean()), y))
    print(f"{'score':40s} {'tokens':>6s} {'AUC':>6s} {'loss':>6s} {'predicted':>9s} {'observed':>8s}")
    for name, a, loss, predicted, y in rows:
        print(f"{name:40s} {len(y):6d} {a:6.3f} {'-' if loss is None else f'{loss:.3f}':>6s} "
              f"{'-' if predicted is None else f'{predicted:.3f}':>9s} {float(y.mean()):8.3f}")


if __name__ == "__main__":
    main()
