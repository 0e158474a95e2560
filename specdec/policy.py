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


import numpy as np
import torch

from .config import SpecConfig


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
    profiles = False  # plans from measured costs: the engine gives it a cost model (SpecEngine.measure_costs)
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


class AcceptanceHeadLength(LengthPolicy):
    """SpecDec++: draft until 1 - prod_i P_acc(x_i) exceeds `acceptance_head.threshold`, at least
    `min_tokens` and at most `max_draft_tokens`; P_acc from the trained head on the draft's hidden state
    (after x_i was fed, or the state that drew x_i plus q(x_i): whichever the head was trained on)."""

    min_tokens = 2
    stops_early = True

    def __init__(self, spec: SpecConfig, slots: Slots, memory: dict | None = None):
        super().__init__(spec, slots, memory)
        if spec.acceptance_head is None:
            raise ValueError("speculation.draft_length acceptance_head needs speculation.acceptance_head.path "
                             "(make one with `specbatch train-head`)")
        from .head import AcceptanceHead

        if "head" not in self.memory:
            self.memory["head"] = AcceptanceHead.load(spec.acceptance_head.path, slots.device)
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
        return ((1 - self.survive) <= self.spec.acceptance_head.threshold) | (step + 1 < self.min_tokens)


POLICY_NAMES = ("fixed", "heuristic", "confidence", "goodput", "acceptance_head")


def policy_class(name: str) -> type[LengthPolicy]:
    if name == "goodput":
        from .goodput import GoodputLength  # built on this module's LengthPolicy

        return GoodputLength
    classes = {"fixed": FixedLength, "heuristic": HeuristicLength, "confidence": ConfidenceLength,
               "acceptance_head": AcceptanceHeadLength}
    if name not in classes:
        raise ValueError(f"speculation.draft_length {name!r} is not available; choose one of {sorted(POLICY_NAMES)}")
    return classes[name]


def make_policy(spec: SpecConfig, slots: Slots, memory: dict | None = None) -> LengthPolicy:
    return policy_class(spec.draft_length)(spec, slots, memory)
