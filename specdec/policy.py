"""Draft-length policies: how many tokens each row drafts this round.

A policy is asked three things by the engine, all per row and as tensors:
- `limits(n)`: the most tokens each active row may draft this round (0 = no speculation for it);
- `keep(step, token_prob, hidden)`: after draft step `step`, which rows go on drafting (None = all);
- `observe(drafted, accepted)`: what happened, to adapt.
Per-row state lives in `Slots` tensors, which follow rows when finished rows are compacted away.
"""

from __future__ import annotations

import time

import torch

from .config import SpecConfig
from .widths import VerifyWidths


class Slots:
    """Per-row tensors `[capacity, ...]`; `move(src, dst)` keeps them aligned with swap-remove."""

    def __init__(self, capacity: int, device):
        self.capacity = capacity
        self.device = device
        self._tensors: dict[str, torch.Tensor] = {}

    def add(self, name: str, dtype=torch.int64, fill=0, trailing: tuple[int, ...] = ()) -> torch.Tensor:
        t = torch.full((self.capacity, *trailing), fill, dtype=dtype, device=self.device)
        self._tensors[name] = t
        return t

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def move(self, src: int, dst: int) -> None:
        if src != dst:
            for t in self._tensors.values():
                t[dst] = t[src]


class LengthPolicy:
    uses_draft_probs = False  # keep() reads the draft's probability of its token
    keep_after_feed = False  # keep() reads the draft's hidden state after the drafted token was fed

    def __init__(self, spec: SpecConfig, slots: Slots, memory: dict | None = None):
        self.spec = spec
        self.slots = slots
        self.memory = {} if memory is None else memory  # kept by the engine across generate() calls

    def admit(self, start: int, end: int) -> None:
        """Rows [start, end) are new."""

    def limits(self, n: int) -> torch.Tensor:
        raise NotImplementedError

    def keep(self, step: int, token_prob: torch.Tensor | None, hidden: torch.Tensor | None) -> torch.Tensor | None:
        return None

    def observe(self, n: int, drafted: torch.Tensor, accepted: torch.Tensor) -> None:
        pass


class FixedLength(LengthPolicy):
    """`num_draft_tokens` every round."""

    def limits(self, n: int) -> torch.Tensor:
        return torch.full((n,), self.spec.num_draft_tokens, dtype=torch.int64, device=self.slots.device)


class HeuristicLength(LengthPolicy):
    """transformers' schedule: +2 after a fully accepted round, otherwise -1 (at least 1)."""

    def __init__(self, spec: SpecConfig, slots: Slots, memory: dict | None = None):
        super().__init__(spec, slots, memory)
        self.k = slots.add("heuristic_k", fill=spec.num_draft_tokens)

    def admit(self, start: int, end: int) -> None:
        self.k[start:end] = self.spec.num_draft_tokens

    def limits(self, n: int) -> torch.Tensor:
        return self.k[:n].clone()

    def observe(self, n: int, drafted: torch.Tensor, accepted: torch.Tensor) -> None:
        k = self.k[:n]
        full = (accepted >= drafted) & (drafted > 0)
        k.copy_(torch.where(full, k + 2, (k - 1).clamp_min(1)).clamp_max(self.spec.max_draft_tokens))


class ConfidenceLength(LengthPolicy):
    """Draft up to `max_draft_tokens`, stopping a row when the draft's probability of its token falls
    below `confidence_threshold` (that token is still proposed)."""

    uses_draft_probs = True

    def limits(self, n: int) -> torch.Tensor:
        return torch.full((n,), self.spec.max_draft_tokens, dtype=torch.int64, device=self.slots.device)

    def keep(self, step, token_prob, hidden):
        return token_prob >= self.spec.confidence_threshold


class GoodputLength(LengthPolicy):
    """Batch-aware: one draft length K for the batch, chosen to maximise expected emitted tokens per
    second of the whole batch, K = 0 (no speculation) included.

    One K for all rows, because a round costs what its longest row costs (the draft steps and the
    target's verification run the batch as one padded tensor) and a longer draft never lowers a
    row's expected emitted tokens: given the round's cost, every row may as well use all of it.

    Expected tokens of a row with per-token acceptance a and K drafts: (1 - a^(K+1)) / (1 - a).
    a is accepted / tested tokens, where a round tests its accepted tokens plus the first rejected
    one (tokens after a rejection are never tested; accepted / drafted would bias a low for long
    drafts), shrunk towards the batch-wide rate (a Beta prior worth `prior_weight` tokens).

    Round times are measured, not assumed, per (batch-size bucket, K), from the round's start to its
    first host sync (so a GPU's queued work is counted): the estimate is the minimum of the last
    `samples` measurements, since timing noise only ever adds. Only 0 and the neighbours of the
    current choice are tried when untimed (a hill climb, not a sweep), a neighbour last timed more
    than `refresh` rounds ago is timed again (one slow sample, say a first call at a new shape,
    cannot lock a choice in), and a bucket not yet timed borrows the nearest bucket's times scaled
    by batch size.
    """

    prior_weight = 4.0
    samples = 3
    refresh = 24

    def __init__(self, spec: SpecConfig, slots: Slots, memory: dict | None = None):
        super().__init__(spec, slots, memory)
        self.tested = slots.add("goodput_tested", dtype=torch.float64)
        self.accepted = slots.add("goodput_accepted", dtype=torch.float64)
        self.total = self.memory.setdefault("goodput_total", [1.0, 2.0])  # accepted, tested (weak 0.5 start)
        self.times: dict[tuple[int, int], list[float]] = self.memory.setdefault("goodput_times", {})
        self.stamp: dict[tuple[int, int], int] = self.memory.setdefault("goodput_stamp", {})
        self.memory.setdefault("goodput_round", 0)
        self._round: tuple[int, int, float] | None = None

    def admit(self, start: int, end: int) -> None:
        self.tested[start:end] = 0
        self.accepted[start:end] = 0

    def expected_tokens(self, n: int, k: int) -> float:
        rate = self.total[0] / self.total[1]
        w = self.prior_weight
        a = ((self.accepted[:n] + w * rate) / (self.tested[:n] + w)).clamp(0.0, 0.999)
        return float(((1 - a ** (k + 1)) / (1 - a)).sum())

    bucket = staticmethod(VerifyWidths.bucket)  # batch sizes timed per power of two

    def estimate(self, b: int, k: int) -> float | None:
        """Round time of length k at bucket b (as if full): measured, else scaled from the nearest bucket."""
        if (b, k) in self.times:
            return min(self.times[(b, k)])
        known = [bb for (bb, kk) in self.times if kk == k]
        if not known:
            return None
        near = min(known, key=lambda bb: abs(bb.bit_length() - b.bit_length()))
        return min(self.times[(near, k)]) * b / near

    def choose(self, n: int) -> int:
        top, b = self.spec.max_draft_tokens, self.bucket(n)
        best = self.memory.get("goodput_best", min(self.spec.num_draft_tokens, top))
        # explore around the current choice only: no sweep of every length at every batch size
        near = [k for k in sorted({0, best - 1, best, best + 1}) if 0 <= k <= top]
        for k in near:
            if self.estimate(b, k) is None:
                return k
        now = self.memory["goodput_round"]
        for k in near:
            if k != best and (b, k) in self.stamp and now - self.stamp[(b, k)] > self.refresh:
                return k
        timed = [k for k in range(top + 1) if self.estimate(b, k) is not None]
        best = max(timed, key=lambda k: self.expected_tokens(n, k) / (self.estimate(b, k) * n / b))
        self.memory["goodput_best"] = best
        return best

    def limits(self, n: int) -> torch.Tensor:
        k = self.choose(n)
        self._round = (self.bucket(n), k, time.perf_counter())
        return torch.full((n,), k, dtype=torch.int64, device=self.slots.device)

    def observe(self, n: int, drafted: torch.Tensor, accepted: torch.Tensor) -> None:
        if self._round is not None:
            rn, k, t0 = self._round
            dt = (time.perf_counter() - t0) * rn / n  # as if the bucket were full
            self.times[(rn, k)] = (self.times.get((rn, k), []) + [dt])[-self.samples:]
            self.stamp[(rn, k)] = self.memory["goodput_round"]
            self._round = None
        self.memory["goodput_round"] += 1
        a = accepted.to(torch.float64)
        tested = a + (accepted < drafted).to(torch.float64)  # the first rejected token was tested too
        self.accepted[:n] += a
        self.tested[:n] += tested
        self.total[0] += float(a.sum())
        self.total[1] += float(tested.sum())


class AcceptanceHeadLength(LengthPolicy):
    """SpecDec++: draft until 1 - prod_i P_acc(x_i) exceeds `acceptance_head_threshold`, at least
    `min_tokens` and at most `max_draft_tokens`; P_acc from the trained head on the draft's hidden state
    (after x_i was fed, or the state that drew x_i plus q(x_i): whichever the head was trained on)."""

    min_tokens = 2

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

    def limits(self, n: int) -> torch.Tensor:
        self.survive = torch.ones(n, device=self.slots.device)
        return torch.full((n,), self.spec.max_draft_tokens, dtype=torch.int64, device=self.slots.device)

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
