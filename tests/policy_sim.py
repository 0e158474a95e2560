"""goodput driven by simulated rounds: a profile of given round times, and a batch whose drafted tokens pass
with given rates (chains) or per width (token trees). Used by tests/test_goodput.py and bench/goodput_regret.py."""

import numpy as np

from specdec.config import SpecConfig
from specdec.plan.costmodel import CostModel, Profile
from specdec.plan.policies import BatchView, PolicyEnv, RoundResult
from specdec.plan.policies.goodput import GoodputLength
from specdec.sched.slots import Slots


def table_profile(cost: dict[int, float], buckets=(1, 8), fixed=0.0) -> Profile:
    """A profile whose round of K costs cost[K] at every bucket (the target forward of width K + 1 carries
    it all; drafting is free)."""
    return Profile(draft_one={b: 0.0 for b in buckets}, draft_two={b: 0.0 for b in buckets},
                   target={b: {k + 1: t for k, t in cost.items()} for b in buckets}, prefill_fixed=fixed,
                   draft_prefill=0.01)


def policy(profile: Profile, n: int = 8, m: int | None = None) -> GoodputLength:
    m = m if m is not None else max(len(t) for t in profile.target.values()) - 1
    return attached(GoodputLength(SpecConfig(max_draft_tokens=m), PolicyEnv(costs=CostModel(profile), row_tokens=64)),
                    n)


def attached(pol: GoodputLength, n: int) -> GoodputLength:
    """pol with per-row state for n rows, all admitted."""
    slots = Slots(n, 1, "cpu")
    pol.attach(slots)
    slots.admit(0, n)
    return pol


def drive(pol, n, cost, rate, rounds, seed=0, waiting=0) -> list[int]:
    """Run `rounds` rounds against a simulated batch: a round of K takes cost[K] seconds and each drafted token
    passes with probability `rate`; returns the K of every round."""
    gen = np.random.default_rng(seed)
    chosen = []
    for _ in range(rounds):
        k = pol.plan(BatchView(n, waiting))
        passes = gen.random((n, max(k, 1))) < rate
        accepted = np.cumprod(passes, axis=1)[:, :k].sum(1)
        pol.observe(RoundResult(n, np.full(n, k), accepted, np.zeros(n, dtype=bool), cost[k]))
        chosen.append(k)
    return chosen


def tree_policy(width_cost, m: int = 8, s: int = 2, n: int = 8) -> GoodputLength:
    """goodput for prompt lookup with alignment sampling s, on a profile whose target forward of width w costs
    width_cost(w) at every bucket (drafting is free, as prompt lookup's is)."""
    widths = range(1, m * (1 + s) + 2)
    profile = Profile(draft_one={b: 0.0 for b in (1, 8)}, draft_two={b: 0.0 for b in (1, 8)},
                      target={b: {w: width_cost(w) for w in widths} for b in (1, 8)})
    spec = SpecConfig(method="prompt_lookup", max_draft_tokens=m, prompt_lookup={"alignment_sampling": s})
    pol = attached(GoodputLength(spec, PolicyEnv(costs=CostModel(profile), row_tokens=64, siblings=s)), n)
    pol.emitted[:n] = np.arange(n)  # rows apart: round times alone decide
    return pol


def drive_trees(pol, n, width_cost, rate, fan, rounds, seed=0) -> list[tuple[int, int]]:
    """Simulated tree rounds: a round of depth K with s siblings per node has ceil(K * fan[s]) nodes, costs
    width_cost(1 + nodes) and passes each level with probability rate[s]; returns every round's (K, s)."""
    gen = np.random.default_rng(seed)
    chosen = []
    for _ in range(rounds):
        k = pol.plan(BatchView(n, 0))
        s = pol.siblings
        nodes = int(np.ceil(k * fan[s]))
        accepted = np.cumprod(gen.random((n, max(k, 1))) < rate[s], axis=1)[:, :k].sum(1)
        pol.observe(RoundResult(n, np.full(n, nodes), accepted, np.zeros(n, dtype=bool), width_cost(1 + nodes),
                                np.full(n, k) if s and k else None))
        chosen.append((k, s))
    return chosen
