"""Host cost of goodput's per-round choice (GoodputLength.plan + observe) on a synthetic profile, no models:
microseconds of this thread's CPU time per round (thread_time: a shared machine's load barely moves it) at a
few batch sizes, chains and token trees, with CostModel's cache of the profile's round times and without it
(every choice rebuilds them), and the cached choice's share of the round it plans (the profile's AR step).

    python bench/choose_speed.py [--rounds 2000] [--batches 1,8,32] [--siblings 0,2,3]

The profile is shaped like the CPU's (a step of 36 ms at batch 1, growing with batch and width); the
simulated rows accept each drafted token with probability 0.6.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from specdec.config import SpecConfig
from specdec.plan.costmodel import CostModel, Profile
from specdec.plan.policies import BatchView, PolicyEnv, RoundResult
from specdec.plan.policies.goodput import GoodputLength
from specdec.sched.slots import Slots

TOP = 8


def cpu_like_profile(buckets=(1, 2, 4, 8, 16, 32)) -> Profile:
    """Seconds of a 135M model's forward on 2 CPU cores, roughly: 36 ms at batch 1, + 1.5 ms per row-token."""
    target = {b: {w: 0.036 + 0.0015 * (b * w - 1) for w in range(1, 2 + TOP * 3)} for b in buckets}
    return Profile(draft_one={b: 0.0 for b in buckets}, draft_two={b: 0.0 for b in buckets}, target=target,
                   prefill_fixed=0.01, draft_prefill=0.0)


class Forgetful(dict):
    """A cache that never hits."""

    def __contains__(self, key) -> bool:
        return False


def simulate(n: int, s: int, rounds: int, cached: bool = True, seed: int = 0) -> float:
    """CPU seconds per round of plan + observe over `rounds` simulated rounds at n rows with s siblings."""
    profile = cpu_like_profile()
    spec = SpecConfig(method="prompt_lookup", max_draft_tokens=TOP, prompt_lookup={"alignment_sampling": s})
    pol = GoodputLength(spec, PolicyEnv(costs=CostModel(profile), row_tokens=64, siblings=s))
    if not cached:
        pol.costs._base = Forgetful()
    slots = Slots(n, 1, "cpu")
    pol.attach(slots)
    slots.admit(0, n)
    gen = np.random.default_rng(seed)
    host = 0.0
    for _ in range(rounds):
        t0 = time.thread_time()
        k = pol.plan(BatchView(n, 0))
        host += time.thread_time() - t0
        sib = pol.siblings or 0
        nodes = np.full(n, k * (1 + sib // 2) if k else 0)
        accepted = np.cumprod(gen.random((n, max(k, 1))) < 0.6, axis=1)[:, :k].sum(1)
        seconds = profile.round(n, k, int(nodes.max()) + 1) if k else profile.round(n, 0)
        result = RoundResult(n, nodes, accepted, np.zeros(n, dtype=bool), seconds,
                             depth=np.full(n, k) if s else None)
        t0 = time.thread_time()
        pol.observe(result)
        host += time.thread_time() - t0
    return host / rounds


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--siblings", default="0,2,3")
    args = ap.parse_args()
    print(f"{'batch':>5s} {'s':>2s} {'uncached us':>11s} {'cached us':>9s} {'speedup':>7s} {'round ms':>8s} "
          f"{'host share':>10s}")
    for n in (int(b) for b in args.batches.split(",")):
        for s in (int(x) for x in args.siblings.split(",")):
            slow, fast = simulate(n, s, args.rounds, cached=False), simulate(n, s, args.rounds)
            step = cpu_like_profile().round(n, 0)
            print(f"{n:5d} {s:2d} {slow * 1e6:11.0f} {fast * 1e6:9.0f} {slow / fast:6.2f}x {step * 1e3:8.1f} "
                  f"{fast / step:10.2%}", flush=True)

if __name__ == "__main__":
    main()
