"""goodput: each round, the one draft length K (0 = no speculation) that maximises the batch's expected
emitted tokens per second under the cost model (specdec/costmodel.py).

One K for all rows: a round costs what its longest row costs (draft steps and verification run the
batch as one tensor), and a longer draft never lowers a row's expected tokens. A row's per-token
acceptance is what verification actually tested (accepted tokens plus the first rejected one), shrunk
towards the pair's rate by `row_weight` tested tokens. The choice is the best expectation; lengths that
could win, counting `optimism` standard deviations of their expected tokens (K = 0 tests nothing, so
two unlucky rounds must not shut speculation off for good), are re-timed once stale (the neighbours of
the choice, 0 and the runner-up, if within `retime_within` of it; the most promising first), so one
slow sample cannot lock a choice in; each re-timing that confirms the choice doubles the wait. A length is
also charged for the admissions it brings on: rows decoding in step finish and join in one prefill
call, speculation spreads them and each then joins alone (the call's fixed cost, and a draft prefill).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import numpy as np

from ..costmodel import CostModel, best_length, bucket, expected_tokens, keep_last
from .base import BatchView, LengthPolicy, RoundResult


@dataclass
class _Probe:
    """A length being re-timed at a bucket until `wanted` samples are in or `left` rounds run out."""

    bucket: int
    before: int  # the choice when it began
    k: int
    wanted: int = 2
    left: int = 3


class GoodputLength(LengthPolicy):
    needs_costs = True
    row_weight = 64.0  # tested tokens the pair's rate is worth in a row's estimate
    optimism = 1.0
    refresh = 24
    retime_within = 0.85
    max_wait = 1 << 12
    # rows in step leave it for a drafting length only if it earns this much more per second than K = 0:
    # spreading their finish also leaves slots idle at the end of a batch and rows joining one by one
    step_margin = 0.15
    kept = 8  # finished rows' lengths and admission sizes averaged

    def __init__(self, spec, env):
        super().__init__(spec, env)
        self.costs: CostModel = env.costs
        self.row_tokens = env.row_tokens  # a row's emitted tokens until rows finish: max_new_tokens
        self.pair = [8.0, 16.0]  # accepted, tested over all rows (a 0.5 prior)
        self.best: dict[int, int] = {}  # bucket -> choice
        self.wait: dict[int, int] = {}  # bucket -> rounds between re-timings
        self.lengths: list[float] = []  # tokens emitted by recently finished rows
        self.groups: dict[bool, list[int]] = {False: [], True: []}  # rows per admission, after plain / drafting rounds
        self.last: int | None = None  # the K of the last round
        self.probe: _Probe | None = None

    def attach(self, slots) -> None:
        self.accepted = slots.add_host("goodput_accepted", dtype=np.float64)
        self.tested = slots.add_host("goodput_tested", dtype=np.float64)
        self.emitted = slots.add_host("goodput_emitted", dtype=np.int64)

    def rates(self, n: int) -> np.ndarray:
        pair = self.pair[0] / self.pair[1]
        return (self.accepted[:n] + self.row_weight * pair) / (self.tested[:n] + self.row_weight)

    def in_step(self, n: int) -> bool:
        """Have rows [0, n) (n > 1) all emitted as many tokens, so that plain rounds finish them together?"""
        return n > 1 and bool((self.emitted[:n] == self.emitted[0]).all())

    def joining(self, view: BatchView) -> tuple[float, float]:
        """Admission seconds each emitted token brings on beyond its row's own prefill, under plain and
        under drafting rounds: only while prompts wait or rows are in step (else nothing joins)."""
        profile = self.costs.profile
        if not (view.waiting or self.in_step(view.n)):
            return 0.0, 0.0
        row = max(statistics.fmean(self.lengths) if self.lengths else self.row_tokens, 1.0)

        def per_token(drafting: bool) -> float:
            seen = self.groups[drafting]
            together = statistics.fmean(seen) if seen else (1 if drafting else view.n)
            return (profile.prefill_fixed / together + (profile.draft_prefill if drafting else 0.0)) / row

        return per_token(False), per_token(True)

    def scores(self, view: BatchView) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per K: the batch's expected tokens, their standard deviation, and the round's predicted seconds with
        the admissions it brings on (nan where the cost model cannot say)."""
        n, top = view.n, self.spec.max_draft_tokens
        a = np.clip(self.rates(n), 0.0, 0.999)[:, None]  # [n, 1]
        k = np.arange(top + 1)[None, :]  # [1, K]
        slope = np.cumsum(k * a ** np.maximum(k - 1, 0), axis=1)  # d tokens / d a
        sd_rate = np.sqrt(a * (1 - a) / (self.tested[:n, None] + self.row_weight + 1))
        tokens, sd = expected_tokens(a[:, 0], top).sum(0), np.sqrt(((slope * sd_rate) ** 2).sum(0))
        plain, drafting = self.joining(view)
        return tokens, sd, self.costs.seconds(n, top) + tokens * np.where(k[0] > 0, drafting, plain)

    def choose(self, view: BatchView) -> int:
        n, b, costs = view.n, bucket(view.n), self.costs
        probe = self.probe
        if probe is not None and probe.bucket == b and probe.wanted > 0 and probe.left > 0:
            probe.left -= 1
            return probe.k
        tokens, sd, cost = self.scores(view)
        known = np.flatnonzero(~np.isnan(cost))
        if not len(known):
            return 0
        best = best_length(tokens, cost)
        mean, hope = tokens / cost, (tokens + self.optimism * sd) / cost
        ranked = [best] + sorted((int(k) for k in known if k != best), key=lambda k: hope[k], reverse=True)
        if probe is not None and probe.bucket == b:  # a re-timing ended: did it change the choice?
            wait = self.wait.get(b, self.refresh)
            self.wait[b] = min(2 * wait, self.max_wait) if best == probe.before else self.refresh
        self.probe = None
        in_step = self.in_step(n)
        if in_step and best and mean[best] < (1 + self.step_margin) * mean[0]:
            best = 0  # a small gain does not pay for putting rows out of step (see step_margin)
        self.best[b] = best
        if best == 0 and in_step and costs.profile.prefill_fixed > 0:
            return best  # a probe would put rows that share their admissions out of step for good
        wait = self.wait.get(b, self.refresh)
        near = {best - 1, best + 1, 0, *ranked[1:2]}
        for k in ranked[1:]:
            stale = costs.rounds - costs.stamp.get((b, k), 0) > wait
            if k in near and stale and hope[k] >= self.retime_within * mean[best]:
                self.probe = _Probe(b, best, k)
                return k
        return best

    def drafts_soon(self, view: BatchView) -> bool:
        b = bucket(view.n)
        if b not in self.best:
            self.choose(view)
        return self.best.get(b) != 0

    def plan(self, view: BatchView) -> int:
        if view.joined and self.last is not None:  # rows that joined after this kind of round
            keep_last(self.groups[self.last > 0], view.joined, self.kept)
        return self.choose(view)

    def observe(self, r: RoundResult) -> None:
        n = r.n
        k = int(r.drafted.max()) if n else 0  # what ran: rows near max_new_tokens draft less than asked
        # the first drafting round after plain ones also feeds the draft every token those emitted: no sample
        if r.seconds is not None and n and not (k and self.last == 0):
            self.costs.observe(n, k, r.seconds)
            if self.probe is not None and (self.probe.bucket, self.probe.k) == (bucket(n), k):
                self.probe.wanted -= 1
        self.last = k
        self.emitted[:n] += r.accepted + 1
        if k:
            tested = r.accepted + (r.accepted < r.drafted)  # the first rejected token was tested too
            self.accepted[:n] += r.accepted
            self.tested[:n] += tested
            self.pair[0] += float(r.accepted.sum())
            self.pair[1] += float(tested.sum())
        for i in np.flatnonzero(r.finished):
            keep_last(self.lengths, float(self.emitted[i]), self.kept)
