"""Draft-length policies on the real pair, held-out prompts, one run: fixed k, heuristic, confidence,
goodput and the SpecDec++ acceptance head (a threshold sweep), at several batch sizes.

    specbatch train-head configs/train_head_pair.yaml --out .cache/heads/proposing   # once, ~3 min on CPU
    python bench/policies.py --head .cache/heads/proposing [--batches 1,8,32] [--max-draft 4] [--repeats 3]

Prints decode tokens/s of the fastest run and its ratio to autoregressive's fastest at the same batch
size; the paired ratio to autoregressive (median over --repeats, and its range); tokens per target
call, acceptance rate, and SpecDec++'s hardware-independent figures: discard rate (discarded draft
tokens per generated token) and verification rate (target calls per generated token); `shapes`: the most
step shapes a timed run met first (on a GPU each is a graph capture and an eager check inside the timing).

Paired ratios: a shared machine drifts by 10% over minutes, more than the policies differ at batch 1.
Every repeat starts with an autoregressive run and one more ends the last repeat; each policy run is
divided by autoregressive's speed interpolated (by time) between the two runs that bracket it, and the
policies run in a rotated order each repeat, so no policy always runs just after the baseline.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from engine_speed import add_model_args, describe, engine_run, load_bench_pair, make_engine, timed_generate  # noqa: E402
from prompts import HELD_OUT, chat_ids  # noqa: E402

from specdec.config import SamplingParams, SpecConfig  # noqa: E402
from specdec.engine import SpecEngine  # noqa: E402

FAMILIES = {"default", "fixed", "heuristic", "confidence", "goodput", "head"}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", action="append", default=[], help="acceptance head folder (specbatch train-head); repeatable")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--ks", default="1,2,3,4,5,6,7,8")
    ap.add_argument("--thresholds", default="0.3,0.5,0.7,0.9")
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--queue", type=float, default=2.0,
                    help="prompts per batch slot (at least 8 prompts): rows finishing early are replaced, as in a job")
    ap.add_argument("--prompts", type=int, default=0,
                    help="this many prompts per batch size instead (a CPU rehearsal of the GPU kit: 2)")
    ap.add_argument("--repeats", type=int, default=2,
                    help="runs of every policy, interleaved with autoregressive ones (see paired ratios above)")
    ap.add_argument("--policies", default="default,fixed,heuristic,confidence,goodput,head",
                    help="which families to run besides autoregressive (trim to fit a time limit)")
    ap.add_argument("--max-draft", type=int, default=8, help="max_draft_tokens of the adaptive policies")
    ap.add_argument("--warm", action="store_true",
                    help="as a job's worker does, keep one engine per policy across runs, first warmed on other "
                         "prompts (untimed), so what a policy learns (goodput's timings) is not relearned per run")
    ap.add_argument("--compare-padding", action="store_true",
                    help="also run every fixed k with verify_padding off (what measured verify widths gain)")
    ap.add_argument("--temperature", type=float, default=0.0, help="sample every row at this temperature (0: greedy)")
    ap.add_argument("--coupled", action="store_true",
                    help="also run every speculative setting with speculation.sampling: coupled (with --temperature)")
    add_model_args(ap)
    args = ap.parse_args()
    families = set(args.policies.split(","))
    if families - FAMILIES:
        ap.error(f"unknown --policies {sorted(families - FAMILIES)}; choose from {sorted(FAMILIES)}")
    pair = load_bench_pair(args)
    dv = args.draft_vocab
    print(f"# held-out chat prompts, max_new_tokens={args.max_new}, "
          f"{f'temperature {args.temperature}' if args.temperature else 'greedy'}, draft_vocab={dv}, "
          f"best of {args.repeats} interleaved runs{', warm engines' if args.warm else ''}, {describe(pair)}")
    engine_run(pair, chat_ids(pair.tokenizer, HELD_OUT[:2]), "draft_model", 2, 2, 8)  # warm-up
    print(f"{'policy':30s} {'batch':>5s} {'rows':>5s} {'tok/s':>7s} {'vs AR':>6s} {'paired':>6s} {'range':>10s} "
          f"{'tok/call':>8s} {'accept':>6s} {'discard':>7s} {'verify':>6s} {'=AR':>4s} {'shapes':>6s}")
    for bs in (int(b) for b in args.batches.split(",")):
        prompts = chat_ids(pair.tokenizer, (HELD_OUT * 16)[: args.prompts or max(8, math.ceil(args.queue * bs))])
        runs = [("autoregressive", dict(method="none", k=0))]
        if "fixed" in families:
            for k in map(int, args.ks.split(",")):
                fixed = dict(method="draft_model", k=k, max_draft_tokens=max(k, args.max_draft))  # same padding room
                runs.append((f"fixed k={k}", fixed))
                if args.compare_padding:
                    runs.append((f"fixed k={k} unpadded", dict(fixed, verify_padding=False)))
        adaptive = [("heuristic", "heuristic", dict(method="draft_model", k=2, draft_length="heuristic")),
                    ("confidence", "confidence 0.4",
                     dict(method="draft_model", k=2, draft_length="confidence", max_draft_tokens=args.max_draft)),
                    ("goodput", "goodput",
                     dict(method="draft_model", k=2, draft_length="goodput", max_draft_tokens=args.max_draft))]
        runs += [(label, kw) for family, label, kw in adaptive if family in families]
        if "default" in families:  # what a job that sets only the models and the method gets
            runs.append(("defaults (draft_model)", dict(method="draft_model", defaults=True)))
        for head in args.head if "head" in families else []:
            runs += [(f"head {os.path.basename(head.rstrip('/'))} h={t}",
                      dict(method="draft_model", k=2, draft_length="acceptance_head",
                           acceptance_head={"path": head, "threshold": float(t)}, max_draft_tokens=args.max_draft))
                     for t in args.thresholds.split(",")]
        if args.coupled:  # the same settings verifying sampled rows by coupled sampling
            runs += [(f"{name} coupled", dict(kw, sampling="coupled")) for name, kw in runs[1:]]
        best: dict[str, dict] = {}
        ratios: dict[str, list[float]] = {}

        def build(kw):
            kw = dict(kw)
            if kw.pop("defaults", False):
                eng = SpecEngine(pair, SamplingParams(max_new_tokens=args.max_new, temperature=args.temperature),
                                 SpecConfig(**kw), batch_size=bs)
            else:
                eng = make_engine(pair, kw.pop("method"), bs, kw.pop("k"), args.max_new, draft_vocab=dv,
                                  temperature=args.temperature, **kw)
            eng.measure_costs()  # goodput's cost profile, as a worker measures it when it loads its models
            return eng

        engines = {}
        new_shapes: dict[str, list[int]] = {}  # step shapes first run inside timed runs (a GPU captures each)
        startup: dict[str, list[float]] = {}  # start-up profile seconds per engine built (goodput); not in tok/s
        captures: dict[str, list[float]] = {}  # seconds each warmed engine's first job spent capturing its steps
        if args.warm:  # other prompts than the timed ones, as a worker's earlier shards would be
            others = chat_ids(pair.tokenizer, (HELD_OUT * 16)[8 : 8 + len(prompts)])
            for name, kw in runs:
                engines[name] = build(kw)
                if engines[name].profile_s:
                    startup.setdefault(name, []).append(engines[name].profile_s)
                engines[name].generate(others)
                captures.setdefault(name, []).append(engines[name].capture_s)

        def run(name, kw):
            eng = engines.get(name) or build(kw)
            if eng.profile_s and name not in engines:
                startup.setdefault(name, []).append(eng.profile_s)
            shapes = step_shapes(eng)
            t = time.perf_counter()
            r = timed_generate(eng, prompts)
            r["at"] = (t + time.perf_counter()) / 2
            new_shapes.setdefault(name, []).append(step_shapes(eng) - shapes)
            if name not in best or r["tok_s"] > best[name]["tok_s"]:
                best[name] = r
            return r

        others_runs = runs[1:]
        timed_generate(build(runs[0][1]), prompts)  # untimed: the first run at a batch size pays its warm-up
        baseline = [run(*runs[0])]
        timed: list[tuple[str, int, dict]] = []  # (policy, repeat, result)
        for rep in range(args.repeats):
            shift = rep % max(1, len(others_runs))
            for name, kw in others_runs[shift:] + others_runs[:shift]:
                timed.append((name, rep, run(name, kw)))
            baseline.append(run(*runs[0]))
        for a, mid, b in zip(baseline, baseline[1:], baseline[2:]):  # the baseline against itself: drift left
            ratios.setdefault(runs[0][0], []).append(mid["tok_s"] / interpolate(a, b, mid["at"]))
        for name, rep, r in timed:
            ratios.setdefault(name, []).append(r["tok_s"] / interpolate(baseline[rep], baseline[rep + 1], r["at"]))
        base = best["autoregressive"]
        for name, _ in runs:
            r = best[name]
            acc = f"{r['accept']:.2f}" if r["accept"] is not None else "-"
            same = sum(a == b for a, b in zip(r["tokens"], base["tokens"]))
            rs = ratios.get(name) or [1.0]
            print(f"{name:30s} {bs:5d} {len(prompts):5d} {r['tok_s']:7.1f} {r['tok_s'] / base['tok_s']:6.2f} "
                  f"{statistics.median(rs):6.2f} {min(rs):5.2f}-{max(rs):4.2f} {r['per_call']:8.2f} {acc:>6s} "
                  f"{r['discard']:7.2f} {r['verify']:6.2f} {same:2d}/{len(prompts)} {max(new_shapes.get(name, [0])):6d}",
                  flush=True)
        for name, secs in startup.items():
            print(f"  {name}: start-up profile {statistics.median(secs):.1f} s per engine (once per worker; "
                  f"outside tok/s)", flush=True)
        for name, secs in captures.items():
            if max(secs) > 0:
                print(f"  {name}: steps captured before the first job's rows joined in {max(secs):.1f} s "
                      f"(outside tok/s)", flush=True)


def step_shapes(eng) -> int:
    """Step shapes the engine's runners have run on their fast path so far: on a GPU each was captured as a
    graph and checked against eager once (seconds of work), so one first met inside a timed run costs it."""
    return sum(len(r.graphs or ()) + len(r.eager) for r in eng._runners.values() if hasattr(r, "eager"))


def interpolate(before: dict, after: dict, at: float) -> float:
    """Autoregressive's tokens/s at time `at`, on the line between two of its runs."""
    span = after["at"] - before["at"]
    w = min(max((at - before["at"]) / span, 0.0), 1.0) if span > 0 else 0.5
    return (1 - w) * before["tok_s"] + w * after["tok_s"]


if __name__ == "__main__":
    main()
