"""Draft-length policies: how many tokens each row drafts this round.

A policy is asked these things by the engine:
- `limits(n)`: the most tokens each active row may draft this round (0 = no speculation for it), on
  the host: one int for every row (the common case), or an array per row;
- `keep(step, token_prob, hidden)`: after draft step `step`, which rows go on drafting (None = all),
  on the device; only policies with `stops_early` are asked, and only they cost the round a host sync
  per draft step (whether any row still drafts);
- `observe(drafted, accepted)`: what happened (host arrays, from the round's one read-back), to adapt;
- `retire(slot)`: a row finished.
The engine also sets `waiting`: how many prompts wait for a free slot (none: no admission follows).
Per-row state lives in `Slots` tensors, which follow rows when finished rows are compacted away.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch

from .config import SpecConfig
from .widths import VerifyWidths


class Slots:
    """Per-row state `[capacity, ...]`, on the device (`add`) or on the host (`add_host`: what the host
    learns from each round's one read-back); `move(src, dst)` keeps both aligned with swap-remove."""

    def __init__(self, capacity: int, device):
        self.capacity = capacity
        self.device = device
        self._tensors: dict[str, torch.Tensor] = {}
        self._arrays: dict[str, np.ndarray] = {}

    def add(self, name: str, dtype=torch.int64, fill=0, trailing: tuple[int, ...] = ()) -> torch.Tensor:
        t = torch.full((self.capacity, *trailing), fill, dtype=dtype, device=self.device)
        self._tensors[name] = t
        return t

    def add_host(self, name: str, dtype=np.int64, fill=0) -> np.ndarray:
        a = np.full(self.capacity, fill, dtype=dtype)
        self._arrays[name] = a
        return a

    def __getitem__(self, name: str):
        return self._tensors[name] if name in self._tensors else self._arrays[name]

    def move(self, src: int, dst: int) -> None:
        if src != dst:
            for t in (*self._tensors.values(), *self._arrays.values()):
                t[dst] = t[src]


class LengthPolicy:
    stops_early = False  # keep() may stop rows before their limit (data-dependent: a host sync per step)
    uses_draft_probs = False  # keep() reads the draft's probability of its token
    keep_after_feed = False  # keep() reads the draft's hidden state after the drafted token was fed
    profiles = False  # plans from round times: the engine times every length at start-up (record())
    waiting = 0  # prompts queued for a slot, set by the engine before every round

    def __init__(self, spec: SpecConfig, slots: Slots, memory: dict | None = None):
        self.spec = spec
        self.slots = slots
        self.memory = {} if memory is None else memory  # kept by the engine across generate() calls

    def admit(self, start: int, end: int) -> None:
        """Rows [start, end) are new."""

    def limits(self, n: int) -> int | np.ndarray:
        raise NotImplementedError

    def drafts_soon(self, n: int) -> bool:
        """Will a batch of n rows draft next round? If not, a drafter may defer work for new rows."""
        return True

    def keep(self, step: int, token_prob: torch.Tensor | None, hidden: torch.Tensor | None) -> torch.Tensor | None:
        return None

    def observe(self, n: int, drafted: np.ndarray, accepted: np.ndarray) -> None:
        pass

    def untimed(self) -> None:
        """This round's time says nothing of its draft length's cost (the next `observe` is its)."""

    def retire(self, slot: int) -> None:
        """The row in `slot` finished (called before another row is moved into its slot)."""

    def record(self, n: int, k: int, seconds: float) -> None:
        """A round of n rows that drafted at most k tokens took `seconds` (the engine's start-up profile)."""

    def record_admission(self, fixed: float, draft: float, row_tokens: int) -> None:
        """Start-up profile: an admission (the target's prefill of the rows joining) costs `fixed` seconds
        besides its rows' own share, a row's draft prefill costs `draft` seconds, and a row emits at most
        `row_tokens` tokens."""

    def worth_timing(self, k: int, rounds: dict[int, float], floor: float) -> bool:
        """Start-up profile: should k drafts be timed, given the round times of the lengths timed so far
        (`rounds`) and that a round of k costs at least `floor` seconds?"""
        return True


class FixedLength(LengthPolicy):
    """`num_draft_tokens` every round."""

    def limits(self, n: int) -> int:
        return self.spec.num_draft_tokens


class HeuristicLength(LengthPolicy):
    """transformers' schedule: +2 after a fully accepted round, otherwise -1 (at least 1)."""

    def __init__(self, spec: SpecConfig, slots: Slots, memory: dict | None = None):
        super().__init__(spec, slots, memory)
        self.k = slots.add_host("heuristic_k", fill=spec.num_draft_tokens)

    def admit(self, start: int, end: int) -> None:
        self.k[start:end] = self.spec.num_draft_tokens

    def limits(self, n: int) -> np.ndarray:
        return self.k[:n].copy()

    def observe(self, n: int, drafted: np.ndarray, accepted: np.ndarray) -> None:
        k = self.k[:n]
        full = (np.asarray(accepted) >= drafted) & (np.asarray(drafted) > 0)
        k[:] = np.minimum(np.where(full, k + 2, np.maximum(k - 1, 1)), self.spec.max_draft_tokens)


class ConfidenceLength(LengthPolicy):
    """Draft up to `max_draft_tokens`, stopping a row when the draft's probability of its token falls
    below `confidence_threshold` (that token is still proposed)."""

    uses_draft_probs = True
    stops_early = True

    def limits(self, n: int) -> int:
        return self.spec.max_draft_tokens

    def keep(self, step, token_prob, hidden):
        return token_prob >= self.spec.confidence_threshold


@dataclass
class _Retiming:
    """A length being timed again at a bucket, until `wanted` fresh samples are in or `left` rounds run out."""

    bucket: int
    before: int  # the choice when it began
    k: int
    wanted: int
    left: int


class GoodputLength(LengthPolicy):
    """Batch-aware: one draft length K for the batch, chosen to maximise expected emitted tokens per
    second of the whole batch, K = 0 (no speculation) included.

    One K for all rows, because a round costs what its longest row costs (the draft steps and the
    target's verification run the batch as one padded tensor) and a longer draft never lowers a
    row's expected emitted tokens: given the round's cost, every row may as well use all of it.

    Expected tokens of a row with per-token acceptance a and K drafts: (1 - a^(K+1)) / (1 - a).
    a is accepted / tested tokens, where a round tests its accepted tokens plus the first rejected
    one (tokens after a rejection are never tested; accepted / drafted would bias a low for long
    drafts), shrunk towards the pair's rate over every row (a Beta prior worth `weight()` tested
    tokens). That weight is estimated from the rows themselves (`weight`: how far their rates spread
    beyond what their counts' sampling noise explains), because it decides whether adapting to a row
    is tracking the row or chasing its noise: with the bench pair on held-out chat prompts the rows'
    rates hardly differ (a weight of ~160 tokens), and at the fixed 4 tokens it had before, a row
    that accepted a few drafts in a row looked like a 0.6 row, so long drafts were chosen exactly
    when they were overrated (K=4 rounds emitted 1.75 tokens where 2.21 were expected). Rows that
    really differ (a mix of code and chat, say) give a small weight, and each follows its own rate.

    Round times are measured, not assumed, per (batch-size bucket, K actually drafted), from the
    round's start to its first host sync (so a GPU's queued work is counted). A plain round's time is
    the bucket's level (the median of its last `samples` plain rounds); a speculative round is kept
    as its ratio to the level of its time, and its estimate is that ratio (the median kept) times the
    current level. Medians, not minima: throughput follows what rounds cost on average, and on a
    shared 2-core VM speculative rounds varied far more than plain ones (K=2 110-155 ms against
    64-70 ms), so minima made speculation look about 15% cheaper than it was and kept it on where
    every fixed length lost. Rounds get slower as rows grow longer and a length that has not run for
    a while would otherwise look cheaper than it is; as a ratio it drifts with the level. The ratio
    is taken against a recent plain round of exactly as many rows where there is one: a batch
    draining at the end of a run (8 rows, then 7, then 5) would otherwise be scaled to the full
    bucket as if a round's cost grew with its rows, which a memory-bound step's does not (measured
    on the CPU in bfloat16: 35 ms at 5 rows, 30 ms at 8). Each bucket times `samples` plain rounds
    before anything else. A bucket not yet timed borrows the nearest bucket's
    ratios and its level scaled by batch size; a bucket with times of its own borrows nothing (a length
    it has no time for is untimed there, and exploration decides whether it is worth timing).

    The first times come from the engine's start-up profile (`SpecEngine.profile`: the draft's forwards
    and the target's verification timed apart on synthetic rows at every bucket, composed into round
    times and handed over through `record`), so the first live round already runs the length they
    favour: no exploration rounds on the job's rows, which cost time where speculation loses and put
    rows out of step (a lockstep batch is admitted and prefilled together; one out of step, a row or
    two at a time). The profile times lengths upwards while `worth_timing` says one could still win at
    an optimistic acceptance; live rounds then refine every estimate as below.

    Exploration is bounded by what a length could gain: K = 0 is timed first, and an untimed K is
    tried only if, on the plain estimate of its tokens (no optimism), it would beat every timed length
    even at the cost of the dearest shorter K timed plus the last measured step per token for each
    token beyond the longest one (a round never gets cheaper by drafting more). Where speculation
    loses (a compute-bound target, a large batch) that stops once K = 1 is timed (two rounds: the
    first after plain ones is the draft's catch-up, no sample); where it wins, the search walks up
    as far as it pays. A neighbour of the choice (K - 1, K + 1, and 0) or the runner-up (the length second by
    its estimate) is timed again once it is `refresh` rounds stale (the runner-up because after K = 0
    wins, K = 1 is often the worst of the drafting lengths, one draft forward for at most one token,
    and re-timing only it left a batch of one at K = 0 for good while K = 2 would have won), if its
    estimated tokens per second are within `retime_within` of the choice's (about the spread of this
    VM's round times: a length further behind needs more than noise to win, and re-timing costs most
    where speculation loses most: at batch 32 a round of K = 1 after K = 0 first feeds the draft every
    token since its rows joined). So one slow sample cannot lock a choice in; each re-timing that
    leaves the choice as it was doubles that wait (a steady batch stops paying for probes), a change
    resets it. Of the stale lengths, the most promising is re-timed first: the wait is the bucket's, so
    K = 1 re-timed first kept K = 2, the runner-up, waiting 24, then 48, then 96 rounds at batch 1.

    A length's cost also counts the admissions it brings on (`joining`), which no round time shows. Rows
    that decode in lockstep finish in the same round and join as one group; speculation emits a varying
    number of tokens per row, so rows drift apart and then finish, and join, one at a time, each paying
    a prefill call's fixed cost alone (and its draft prefill, which rows joining while K = 0 skip).
    Measured on the 2-core CPU at 8 rows: a 45-token prompt's target prefill took 141 ms alone, 78 ms a
    row in a group of 8; fixed k = 1 ran 6 admissions where autoregressive ran 2 (0.4-1.1 s more in a
    17 s run), which turned rounds that were 1-6% cheaper per token into a run 5% slower. So a round
    of K is charged, for each row it is expected to finish (expected tokens / a row's emitted tokens),
    the fixed cost shared by the rows joining with it (rows per admission as measured after plain or
    after drafting rounds, else all rows in lockstep for plain and 1 for drafting) plus, when K > 0, a
    row's draft prefill. Only while prompts wait, or while rows are in step (all have emitted as many
    tokens): speculating then spreads their finish, so the batch drains with slots idle, a cost of the
    same kind charged the same way; in the drain of rows already apart, nothing joins. From K = 0 with
    rows in step, no other length is re-timed: one drafting round would put them apart for good. The
    costs come from the start-up profile (`record_admission`: a 1-row and a 2-row prefill); a row's
    tokens from finished rows, else `max_new_tokens`.
    """

    profiles = True
    optimism = 1.0  # standard deviations of the expected tokens added before choosing (see the docstring)
    optimistic = 0.8  # per-token acceptance the start-up profile allows a pair it has not seen yet
    prior_weight = 64.0  # a row's own rate starts as the pair's, worth this many tested tokens, until
    # `weight` has rows enough to estimate it; estimates are kept within [min_weight, max_weight]
    min_weight, max_weight = 4.0, 1024.0
    rows_kept = 64  # finished rows whose (accepted, tested) counts `weight` reads, besides the active ones
    groups_kept = 8  # recent admissions whose sizes `joining` averages
    prior_tokens = 16  # the pair's rate starts at 0.5, worth this many tested tokens
    samples = 3
    refresh = 24
    retime_within = 0.85  # a length is re-timed only if its estimate is within this of the best's
    max_wait = 1 << 12

    def __init__(self, spec: SpecConfig, slots: Slots, memory: dict | None = None):
        super().__init__(spec, slots, memory)
        self.tested = slots.add_host("goodput_tested", dtype=np.float64)
        self.accepted = slots.add_host("goodput_accepted", dtype=np.float64)
        # accepted, tested over every row so far, from a prior of `prior_tokens` tested tokens at 0.5
        self.total = self.memory.setdefault("goodput_total", [0.5 * self.prior_tokens, float(self.prior_tokens)])
        self.times: dict[tuple[int, int], list[float]] = self.memory.setdefault("goodput_times", {})
        self.stamp: dict[tuple[int, int], int] = self.memory.setdefault("goodput_stamp", {})
        self.best: dict[int, int] = self.memory.setdefault("goodput_best", {})  # per bucket
        self.wait: dict[int, int] = self.memory.setdefault("goodput_wait", {})  # re-timing interval per bucket
        self.plain: dict[int, list[tuple[int, float]]] = self.memory.setdefault("goodput_plain", {})  # per row count
        self.rows: list[tuple[float, float]] = self.memory.setdefault("goodput_rows", [])  # finished rows' counts
        self.memory.setdefault("goodput_round", 0)
        # admissions: fixed and draft-prefill seconds, a row's tokens (the profile's); rows per admission
        # after plain / drafting rounds; tokens emitted by finished rows
        self.admission = self.memory.setdefault("goodput_admission", {"fixed": 0.0, "draft": 0.0, "row_tokens": 0})
        self.groups: dict[bool, list[int]] = self.memory.setdefault("goodput_groups", {False: [], True: []})
        self.lengths: list[float] = self.memory.setdefault("goodput_lengths", [])
        self.emitted = slots.add_host("goodput_emitted", dtype=np.float64)
        self._round: float | None = None  # when the round being run started
        self._probe: _Retiming | None = None
        self._last: int | None = None  # the length the last round ran
        self._expected: tuple[int, list[float], list[float]] | None = None  # (n, mean, sd) until a rate changes

    def admit(self, start: int, end: int) -> None:
        self.tested[start:end] = 0
        self.accepted[start:end] = 0
        self.emitted[start:end] = 0
        self._expected = None
        if self._last is not None:  # not the batch's first fill: rows that finished after this kind of round
            self._keep(self.groups, self._last > 0, end - start, self.groups_kept)

    def record_admission(self, fixed: float, draft: float, row_tokens: int) -> None:
        self.admission.update(fixed=fixed, draft=draft, row_tokens=row_tokens)

    def in_step(self, n: int) -> bool:
        """Have rows [0, n) (n > 1) all emitted as many tokens, so that plain rounds finish them together?"""
        e = self.emitted[:n]
        return n > 1 and bool((e == e[0]).all())  # host state: no sync

    def joining(self, n: int, in_step: bool) -> tuple[float, float]:
        """Seconds of admission that each token emitted by rows [0, n) brings on beyond its row's own
        prefill, which any length pays alike: under plain rounds and under drafting ones (see the class
        docstring). `in_step`: `self.in_step(n)`."""
        cost = self.admission
        if not (self.waiting or in_step) or not (cost["fixed"] or cost["draft"]):
            return 0.0, 0.0
        row = max(statistics.fmean(self.lengths) if self.lengths else cost["row_tokens"], 1.0)

        def per_token(drafting: bool) -> float:
            seen = self.groups[drafting]
            together = statistics.fmean(seen) if seen else (1 if drafting else n)  # rows per admission
            return (cost["fixed"] / together + (cost["draft"] if drafting else 0.0)) / row

        return per_token(False), per_token(True)

    def expected_tokens(self, n: int, top: int, optimism: float = 0.0) -> list[float]:
        """Expected emitted tokens of the batch's first n rows for K = 0..top, plus `optimism` standard
        deviations of that expectation (each row's acceptance estimate is uncertain; rows independent)."""
        if self._expected is None or self._expected[0] != n or len(self._expected[1]) != top + 1:
            rate = self.total[0] / self.total[1]
            w = self.weight(n)
            seen = self.tested[:n] + w
            a = np.clip((self.accepted[:n] + w * rate) / seen, 0.0, 0.999)[:, None]  # [n, 1]
            k = np.arange(top + 1, dtype=np.float64)[None, :]
            mean = (1 - a ** (k + 1)) / (1 - a)  # [n, top+1]
            slope = np.cumsum(k * a ** np.maximum(k - 1, 0), axis=1)  # d mean / d a = sum_j<=K j a^(j-1)
            sd = slope * np.sqrt(a * (1 - a) / (seen[:, None] + 1))  # of the Beta posterior of a, carried
            self._expected = (n, mean.sum(0).tolist(), np.sqrt((sd ** 2).sum(0)).tolist())
        _, mean, sd = self._expected
        return [m + optimism * s for m, s in zip(mean, sd)]

    def weight(self, n: int) -> float:
        """How many tested tokens the pair's rate is worth in a row's estimate: 1/rho - 1, rho the
        intra-row correlation of acceptances of a beta-binomial, by the method of moments (Kleinman's,
        rows weighted by their tested tokens) over the finished rows kept and rows [0, n) that have
        tested any, less one standard error of it (the rows' spread must show beyond noise before a row
        is trusted over the pair; an overestimated rho is what lets rows chase their noise, and from a
        few rows the raw estimate swings far). `prior_weight` until four rows have."""
        rows = self.rows + [r for r in zip(self.accepted[:n].tolist(), self.tested[:n].tolist()) if r[1] > 0]
        if len(rows) < 4:
            return self.prior_weight
        total = sum(t for _, t in rows)
        p = sum(x for x, _ in rows) / total
        if not 0 < p < 1:
            return self.max_weight  # every test agreed so far: nothing tells rows apart
        spread = sum((x - p * t) ** 2 / t for x, t in rows) / (p * (1 - p))  # sum t (r - p)^2 / p(1-p)
        dof = len(rows) - 1
        room = total - sum(t * t for _, t in rows) / total - dof
        rho = (spread - dof - math.sqrt(2 * dof)) / room if room > 0 else 0.0  # spread ~ chi2(dof) if rho = 0
        return min(self.max_weight, max(self.min_weight, 1 / rho - 1)) if rho > 0 else self.max_weight

    def untimed(self) -> None:
        self._round = None

    def retire(self, slot: int) -> None:
        self._keep(self.lengths, None, float(self.emitted[slot]), self.rows_kept)
        if self.tested[slot] > 0:
            self._keep(self.rows, None, (float(self.accepted[slot]), float(self.tested[slot])), self.rows_kept)

    bucket = staticmethod(VerifyWidths.bucket)  # batch sizes timed per power of two

    def _kept(self, b: int, k: int) -> tuple[int, list[float]] | None:
        """The samples of length k at bucket b, else at the nearest bucket that has some."""
        if (b, k) in self.times:
            return b, self.times[(b, k)]
        known = [bb for (bb, kk) in self.times if kk == k]
        if not known:
            return None
        near = min(known, key=lambda bb: abs(bb.bit_length() - b.bit_length()))
        return near, self.times[(near, k)]

    def estimate(self, b: int, k: int) -> float | None:
        """Round time of length k at bucket b (as if full): the level times k's ratio to it."""
        level = self._kept(b, 0)
        if level is None:
            return None
        t = statistics.median(level[1]) * b / level[0]
        if k == 0:
            return t
        # only a bucket with no times of its own borrows a ratio: one that has them and not k's left k out
        # (the profile stops where longer lengths cannot win), and another bucket's ratio (a batch of one
        # drafts 5 tokens for 2.2 plain rounds, 8 rows 4 for 2.7) would make k look cheaper than shorter ones
        ratio = (b, self.times[(b, k)]) if (b, k) in self.times else None if level[0] == b else self._kept(b, k)
        return None if ratio is None else t * statistics.median(ratio[1])

    def choose(self, n: int) -> int:
        top, b = self.spec.max_draft_tokens, self.bucket(n)
        own = self.times.get((b, 0))
        if self._kept(b, 0) is None or (own is not None and len(own) < self.samples):
            return 0  # the baseline first: every other length is measured against it
        rounds = {k: t for k in range(top + 1) if (t := self.estimate(b, k)) is not None}
        mean = self.expected_tokens(n, top)
        in_step = self.in_step(n)
        per_token = self.joining(n, in_step)
        join = [mean[k] * per_token[k > 0] for k in range(top + 1)]  # admission seconds a round brings on
        cost = {k: t + join[k] for k, t in rounds.items()}
        tokens = self.expected_tokens(n, top, self.optimism)
        ranked = sorted(cost, key=lambda k: tokens[k] / cost[k], reverse=True)
        best = ranked[0]
        probe = self._probe
        if probe is not None and probe.bucket == b:  # a re-timing ran: did it change anything?
            if probe.wanted > 0 and probe.left > 0:
                probe.left -= 1
                return probe.k  # not yet a majority of fresh samples (or its first round was the draft's catch-up)
            wait = self.wait.get(b, self.refresh)
            self.wait[b] = min(2 * wait, self.max_wait) if best == probe.before else self.refresh
        self._probe = None
        self.best[b] = best
        # the shortest untimed length that could still win, on the estimates as they are (the optimism
        # above keeps a timed length in play; it is no reason to pay for rounds of a new one)
        timed = sorted(cost)
        goal = max(mean[k] / cost[k] for k in timed)
        for k in range(1, top + 1):
            below = [j for j in timed if j < k]
            if k in cost or not below:
                continue
            j = below[-1]  # drafting more never makes a round cheaper, and costs at least the last step did
            step = max(0.0, (rounds[j] - rounds[below[-2]]) / (j - below[-2])) if len(below) > 1 else 0.0
            if mean[k] / (max(rounds[i] for i in below) + (k - j) * step + join[k]) > goal:
                return k
        now, wait = self.memory["goodput_round"], self.wait.get(b, self.refresh)
        close = [k for k in ranked if tokens[k] / cost[k] >= self.retime_within * tokens[best] / cost[best]]
        # rows in step that share their admissions' fixed cost: a probe would put them out of step for good
        stay = best == 0 and self.admission["fixed"] > 0 and in_step
        near = set() if stay else {best - 1, best + 1, 0, *ranked[1:2]}  # the neighbours and the runner-up
        for k in close:  # best first: the most promising stale one is re-timed first
            if k in near and k != best and (b, k) in self.stamp and now - self.stamp[(b, k)] > wait:
                # as many fresh samples as make its median theirs, in one round more than that at most
                self._probe = _Retiming(b, best, k, wanted=self.samples // 2 + 1, left=self.samples // 2 + 1)
                return k
        return best

    def drafts_soon(self, n: int) -> bool:
        b = self.bucket(n)
        if b not in self.best and self._kept(b, 0) is not None:
            self.choose(n)  # timed (by the start-up profile) but not run yet: what would it pick?
        return self.best.get(b) != 0  # speculation is off at this size: rows join unprefilled

    def limits(self, n: int) -> int:
        k = self.choose(n)
        self._round = time.perf_counter()
        return k

    def _keep(self, store, key, sample, last: int | None = None) -> None:
        """Append `sample` to store[key] (to the list `store` itself if key is None), keeping the last
        `last` (default `samples`) of them."""
        kept = store if key is None else store.setdefault(key, [])
        kept.append(sample)
        del kept[: -(last or self.samples)]

    def plain_time(self, n: int, b: int) -> float | None:
        """A plain round's time at n rows: measured at exactly n rows if that is recent, else the bucket's
        level scaled to n rows (a guess: on memory-bound hardware a round costs about the same at any n)."""
        kept = self.plain.get(n)
        if kept and self.memory["goodput_round"] - kept[-1][0] <= self.refresh:
            return statistics.median(t for _, t in kept)
        level = self.estimate(b, 0)
        return None if level is None else level * n / b

    def record(self, n: int, k: int, seconds: float) -> None:
        """File a round's time: a plain round's as the bucket's level (as if full) and as the time at
        exactly n rows; a speculative round's as its ratio to a plain round of as many rows."""
        b, now = self.bucket(n), self.memory["goodput_round"]
        if k == 0:
            self._keep(self.plain, n, (now, seconds))
            sample = seconds * b / n
        else:
            plain = self.plain_time(n, b)
            sample = None if plain is None else seconds / plain
        if sample is not None:
            self._keep(self.times, (b, k), sample)
            self.stamp[(b, k)] = now

    def worth_timing(self, k: int, rounds: dict[int, float], floor: float) -> bool:
        """Only a length that could win if the draft accepted `optimistic` of its tokens and its round
        cost no more than `floor` is timed (the same bound as exploration's, before any acceptance is
        known); a pair that does better gets its longer lengths timed live, by exploration."""
        a = self.optimistic
        tokens = [(1 - a ** (j + 1)) / (1 - a) for j in range(k + 1)]
        return tokens[k] / floor > max(tokens[j] / t for j, t in rounds.items())

    def observe(self, n: int, drafted: np.ndarray, accepted: np.ndarray) -> None:
        drafted, accepted = np.asarray(drafted), np.asarray(accepted)
        k = int(drafted.max()) if n else 0  # what ran: rows near max_new_tokens draft less than asked
        # the first drafting round after plain ones is not a sample of its length: the draft first catches
        # up on every token the plain rounds emitted (traced: such rounds took 110-130 ms where that
        # length's steady rounds took 100-105, and timing them kept a batch of one at K = 0 for good)
        if self._round is not None and n and not (k and self._last == 0):
            self.record(n, k, time.perf_counter() - self._round)
            if self._probe is not None and (self._probe.bucket, self._probe.k) == (self.bucket(n), k):
                self._probe.wanted -= 1
        self._round, self._last = None, k
        self.memory["goodput_round"] += 1
        self.emitted[:n] += accepted + 1
        if k == 0:
            return  # a plain round tests nothing: the rates stand
        self._expected = None
        a = accepted.astype(np.float64)
        tested = a + (accepted < drafted)  # the first rejected token was tested too
        self.accepted[:n] += a
        self.tested[:n] += tested
        self.total[0] += float(a.sum())
        self.total[1] += float(tested.sum())


class AcceptanceHeadLength(LengthPolicy):
    """SpecDec++: draft until 1 - prod_i P_acc(x_i) exceeds `acceptance_head_threshold`, at least
    `min_tokens` and at most `max_draft_tokens`; P_acc from the trained head on the draft's hidden state
    (after x_i was fed, or the state that drew x_i plus q(x_i): whichever the head was trained on)."""

    min_tokens = 2
    stops_early = True

    def __init__(self, spec: SpecConfig, slots: Slots, memory: dict | None = None):
        super().__init__(spec, slots, memory)
        if not spec.acceptance_head_path:
            raise ValueError("speculation.draft_length acceptance_head needs speculation.acceptance_head.path "
                             "(make one with `specbatch train-head`)")
        from .head import AcceptanceHead

        if "head" not in self.memory:
            self.memory["head"] = AcceptanceHead.load(spec.acceptance_head_path, slots.device)
        self.head = self.memory["head"]
        self.proposing = self.head.cfg.reads == "proposing"
        self.keep_after_feed = not self.proposing
        self.uses_draft_probs = self.proposing
        self.survive: torch.Tensor | None = None

    def limits(self, n: int) -> int:
        self.survive = torch.ones(n, device=self.slots.device)
        return self.spec.max_draft_tokens

    def keep(self, step, token_prob, hidden):
        x = self.head.features(hidden, token_prob)
        self.survive = self.survive * self.head.p_accept(x)  # P(no rejection so far)
        return ((1 - self.survive) <= self.spec.acceptance_head_threshold) | (step + 1 < self.min_tokens)


POLICIES: dict[str, type[LengthPolicy]] = {
    "acceptance_head": AcceptanceHeadLength,
    "fixed": FixedLength,
    "heuristic": HeuristicLength,
    "confidence": ConfidenceLength,
    "goodput": GoodputLength,
}


def make_policy(spec: SpecConfig, slots: Slots, memory: dict | None = None) -> LengthPolicy:
    try:
        cls = POLICIES[spec.draft_length]
    except KeyError:
        raise ValueError(
            f"speculation.draft_length {spec.draft_length!r} is not available; choose one of {sorted(POLICIES)}"
        ) from None
    return cls(spec, slots, memory)
