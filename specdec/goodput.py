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
import time
from dataclasses import dataclass, field

import numpy as np

from .config import SpecConfig
from .costmodel import CostModel, bucket, keep_last
from .policy import LengthPolicy, Slots


@dataclass
class _Probe:
    """A length being re-timed at a bucket until `wanted` samples are in or `left` rounds run out."""

    bucket: int
    before: int  # the choice when it began
    k: int
    wanted: int = 2
    left: int = 3


@dataclass
class GoodputMemory:
    """What goodput learns, kept by the engine across batches (`SpecEngine.policy_memory`)."""

    costs: CostModel
    row_tokens: int  # a row's emitted tokens until rows finish: max_new_tokens
    pair: list[float] = field(default_factory=lambda: [8.0, 16.0])  # accepted, tested over all rows (a 0.5 prior)
    best: dict[int, int] = field(default_factory=dict)  # bucket -> choice
    wait: dict[int, int] = field(default_factory=dict)  # bucket -> rounds between re-timings
    lengths: list[float] = field(default_factory=list)  # tokens emitted by recently finished rows
    groups: dict[bool, list[int]] = field(default_factory=lambda: {False: [], True: []})  # rows per admission,
    # after plain / drafting rounds


class GoodputLength(LengthPolicy):
    profiles = True
    row_weight = 64.0  # tested tokens the pair's rate is worth in a row's estimate
    optimism = 1.0
    refresh = 24
    retime_within = 0.85
    max_wait = 1 << 12
    # rows in step leave it for a drafting length only if it earns this much more per second than K = 0:
    # spreading their finish also leaves slots idle at the end of a batch and rows joining one by one (at
    # batch 8 on the 2-core CPU, fixed K = 1 ran rounds 10-12% cheaper per token than plain ones, and
    # 97 rounds of 7.3 rows on average where 88 full ones would have done: the run was 5-10% slower)
    step_margin = 0.15
    kept = 8  # finished rows' lengths and admission sizes averaged

    def __init__(self, spec: SpecConfig, slots: Slots, memory: dict | None = None):
        super().__init__(spec, slots, memory)
        self.mem: GoodputMemory = self.memory["goodput"]
        self.accepted = slots.add_host("goodput_accepted", dtype=np.float64)
        self.tested = slots.add_host("goodput_tested", dtype=np.float64)
        self.emitted = slots.add_host("goodput_emitted", dtype=np.int64)
        self._start: float | None = None  # when the round being run started (None: not a sample)
        self._last: int | None = None  # the K of the last round
        self._probe: _Probe | None = None

    def admit(self, start: int, end: int) -> None:
        self.accepted[start:end] = self.tested[start:end] = self.emitted[start:end] = 0
        if self._last is not None:  # rows that finished after this kind of round
            keep_last(self.mem.groups[self._last > 0], end - start, self.kept)

    def retire(self, slot: int) -> None:
        keep_last(self.mem.lengths, float(self.emitted[slot]), self.kept)

    def rates(self, n: int) -> np.ndarray:
        pair = self.mem.pair[0] / self.mem.pair[1]
        return (self.accepted[:n] + self.row_weight * pair) / (self.tested[:n] + self.row_weight)

    def in_step(self, n: int) -> bool:
        """Have rows [0, n) (n > 1) all emitted as many tokens, so that plain rounds finish them together?"""
        return n > 1 and bool((self.emitted[:n] == self.emitted[0]).all())

    def joining(self, n: int) -> tuple[float, float]:
        """Admission seconds each emitted token brings on beyond its row's own prefill, under plain and
        under drafting rounds: only while prompts wait or rows are in step (else nothing joins)."""
        profile = self.mem.costs.profile
        if not (self.waiting or self.in_step(n)):
            return 0.0, 0.0
        row = max(statistics.fmean(self.mem.lengths) if self.mem.lengths else self.mem.row_tokens, 1.0)

        def per_token(drafting: bool) -> float:
            seen = self.mem.groups[drafting]
            together = statistics.fmean(seen) if seen else (1 if drafting else n)
            return (profile.prefill_fixed / together + (profile.draft_prefill if drafting else 0.0)) / row

        return per_token(False), per_token(True)

    def scores(self, n: int) -> dict[int, tuple[float, float]]:
        """K -> (expected tokens per second, the same with `optimism` standard deviations of the tokens)."""
        top = self.spec.max_draft_tokens
        a = np.clip(self.rates(n), 0.0, 0.999)[:, None]  # [n, 1]
        k = np.arange(top + 1)[None, :]  # [1, K]
        mean = (1 - a ** (k + 1)) / (1 - a)  # a row's expected tokens at each K
        slope = np.cumsum(k * a ** np.maximum(k - 1, 0), axis=1)  # d mean / d a
        sd_rate = np.sqrt(a * (1 - a) / (self.tested[:n, None] + self.row_weight + 1))
        tokens, sd = mean.sum(0), np.sqrt(((slope * sd_rate) ** 2).sum(0))
        plain, drafting = self.joining(n)
        cost = self.mem.costs.seconds_upto(n, top) + tokens * np.where(k[0] > 0, drafting, plain)
        return {j: (tokens[j] / cost[j], (tokens[j] + self.optimism * sd[j]) / cost[j])
                for j in range(top + 1) if not np.isnan(cost[j])}

    def choose(self, n: int) -> int:
        b, costs = bucket(n), self.mem.costs
        probe = self._probe
        if probe is not None and probe.bucket == b and probe.wanted > 0 and probe.left > 0:
            probe.left -= 1
            return probe.k
        scores = self.scores(n)
        if not scores:
            return 0
        best = max(scores, key=lambda k: scores[k][0])
        ranked = [best] + sorted((k for k in scores if k != best), key=lambda k: scores[k][1], reverse=True)
        if probe is not None and probe.bucket == b:  # a re-timing ended: did it change the choice?
            wait = self.mem.wait.get(b, self.refresh)
            self.mem.wait[b] = min(2 * wait, self.max_wait) if best == probe.before else self.refresh
        self._probe = None
        in_step = self.in_step(n)
        if in_step and best and scores[best][0] < (1 + self.step_margin) * scores[0][0]:
            best = 0  # a small gain does not pay for putting rows out of step (see step_margin)
        self.mem.best[b] = best
        if best == 0 and in_step and costs.profile.prefill_fixed > 0:
            return best  # a probe would put rows that share their admissions out of step for good
        wait = self.mem.wait.get(b, self.refresh)
        near = {best - 1, best + 1, 0, *ranked[1:2]}
        for k in ranked[1:]:
            stale = costs.rounds - costs.stamp.get((b, k), 0) > wait
            if k in near and stale and scores[k][1] >= self.retime_within * scores[best][0]:
                self._probe = _Probe(b, best, k)
                return k
        return best

    def drafts_soon(self, n: int) -> bool:
        b = bucket(n)
        if b not in self.mem.best:
            self.choose(n)
        return self.mem.best.get(b) != 0

    def limits(self, n: int) -> int:
        k = self.choose(n)
        self._start = time.perf_counter()
        return k

    def untimed(self) -> None:
        self._start = None

    def observe(self, n: int, drafted: np.ndarray, accepted: np.ndarray) -> None:
        k = int(drafted.max()) if n else 0  # what ran: rows near max_new_tokens draft less than asked
        # the first drafting round after plain ones also feeds the draft every token those emitted: no sample
        if self._start is not None and n and not (k and self._last == 0):
            self.mem.costs.observe(n, k, time.perf_counter() - self._start)
            if self._probe is not None and (self._probe.bucket, self._probe.k) == (bucket(n), k):
                self._probe.wanted -= 1
        self._start, self._last = None, k
        self.emitted[:n] += accepted + 1
        if k:
            tested = accepted + (accepted < drafted)  # the first rejected token was tested too
            self.accepted[:n] += accepted
            self.tested[:n] += tested
            self.mem.pair[0] += float(accepted.sum())
            self.mem.pair[1] += float(tested.sum())
