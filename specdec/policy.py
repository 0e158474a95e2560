"""Draft-length policies: how many tokens each row drafts this round.

A policy is asked three things by the engine, all per row and as tensors:
- `limits(n)`: the most tokens each active row may draft this round (0 = no speculation for it);
- `keep(step, token_prob, hidden)`: after draft step `step`, which rows go on drafting (None = all);
- `observe(drafted, accepted)`: what happened, to adapt.
Per-row state lives in `Slots` tensors, which follow rows when finished rows are compacted away.
"""

from __future__ import annotations

import torch

from .config import SpecConfig


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

    def __init__(self, spec: SpecConfig, slots: Slots):
        self.spec = spec
        self.slots = slots

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

    def __init__(self, spec: SpecConfig, slots: Slots):
        super().__init__(spec, slots)
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


POLICIES: dict[str, type[LengthPolicy]] = {
    "fixed": FixedLength,
    "heuristic": HeuristicLength,
    "confidence": ConfidenceLength,
}


def make_policy(spec: SpecConfig, slots: Slots) -> LengthPolicy:
    try:
        cls = POLICIES[spec.draft_length]
    except KeyError:
        raise ValueError(
            f"speculation.draft_length {spec.draft_length!r} is not available; choose one of {sorted(POLICIES)}"
        ) from None
    return cls(spec, slots)
