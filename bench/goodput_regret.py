"""goodput's choices against the best fixed choice, on simulated rounds (no model, no timing: the same on any
machine).

Each scenario fixes what rounds cost and how often drafted tokens pass; goodput starts from its prior and
learns both from the rounds it runs (tests/policy_sim.py drives it). Chains: a round of K drafts costs
1 + c*K plain rounds, each drafted token passes at rate a. Token trees (prompt lookup with alignment
sampling 2): a round verifying w tokens costs 1 + c*(w - 1), s siblings per node give 1 + s/2 nodes per
level, and a level passes at rate[s]. A round's worth is its expected tokens per second (known in closed
form); `regret` is 1 - the mean worth of goodput's rounds after the first --skip over the best choice's,
averaged over seeds (`worst`: the worst seed). Probes (re-timings) count against it.

    python bench/goodput_regret.py --seeds 16 --rounds 500
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from specdec.plan.costmodel import expected_tokens  # noqa: E402
from policy_sim import drive, drive_trees, policy, table_profile, tree_policy  # noqa: E402

FAN = {0: 1.0, 1: 1.5, 2: 2.0}
TREE_RATES = ({0: 0.6, 1: 0.65, 2: 0.7}, {0: 0.5, 1: 0.6, 2: 0.68}, {0: 0.7, 1: 0.72, 2: 0.73})


def worth(rate: float, k: int, seconds: float) -> float:
    return float(expected_tokens(np.array([rate]), k)[0, k]) / seconds


def chain_run(c: float, rate: float, rounds: int, seed: int) -> tuple[list[float], float]:
    cost = {k: 1.0 + c * k for k in range(9)}
    truth = {k: worth(rate, k, cost[k]) for k in cost}
    return [truth[k] for k in drive(policy(table_profile(cost)), 8, cost, rate, rounds, seed=seed)], max(truth.values())


def tree_run(c: float, rates: dict, rounds: int, seed: int) -> tuple[list[float], float]:
    cost = lambda w: 1.0 + c * (w - 1)  # noqa: E731
    truth = {(k, s): worth(rates[s], k, cost(1 + int(np.ceil(k * FAN[s]))))
             for s in rates for k in range(9) if k or not s}
    chosen = drive_trees(tree_policy(cost), 8, cost, rates, FAN, rounds, seed=seed)
    return [truth[(k, s if k else 0)] for k, s in chosen], max(truth.values())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=500)
    ap.add_argument("--skip", type=int, default=50, help="rounds not counted (the prior's first guesses)")
    args = ap.parse_args()
    scenarios = [("chain", c, a, chain_run) for c, a in itertools.product((0.05, 0.15, 0.4), (0.3, 0.6, 0.85))]
    scenarios += [("tree", c, r, tree_run) for c, r in itertools.product((0.003, 0.01, 0.03, 0.08, 0.25), TREE_RATES)]
    print(f"# python {' '.join(sys.argv)}\n{'kind':5s} {'c':>6s} {'rates':18s} {'regret':>7s} {'worst':>6s}")
    means, worst = [], 0.0
    for kind, c, rate, run in scenarios:
        regrets = []
        for seed in range(args.seeds):
            got, best = run(c, rate, args.rounds, seed)
            regrets.append(1 - float(np.mean(got[args.skip:])) / best)
        means.append(float(np.mean(regrets)))
        worst = max(worst, max(regrets))
        rates = "/".join(f"{v:g}" for v in rate.values()) if isinstance(rate, dict) else f"{rate:g}"
        print(f"{kind:5s} {c:6g} {rates:18s} {means[-1]:7.2%} {max(regrets):6.1%}", flush=True)
    print(f"all   mean regret {np.mean(means):.2%}, worst scenario {max(means):.2%}, worst seed {worst:.1%}")


if __name__ == "__main__":
    main()
