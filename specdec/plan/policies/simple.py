"""The training-free policies, and SpecDec++'s acceptance head."""

from __future__ import annotations

import numpy as np
import torch

from .base import BatchView, DraftStopper, LengthPolicy, RoundResult


class NoDrafts(LengthPolicy):
    """A method that never drafts (plain decoding): every round is a plain one."""

    def plan(self, view: BatchView) -> int:
        return 0

    def drafts_soon(self, view: BatchView) -> bool:
        return False

    def most_drafted(self) -> int:
        return 0


class FixedLength(LengthPolicy):
    """`num_draft_tokens` every round."""

    def plan(self, view: BatchView) -> int:
        return self.spec.num_draft_tokens

    def drafts_soon(self, view: BatchView) -> bool:
        return self.spec.num_draft_tokens > 0

    def most_drafted(self) -> int:
        return self.spec.num_draft_tokens


class HeuristicLength(LengthPolicy):
    """transformers' schedule: +2 after a fully accepted round, otherwise -1 (at least 1)."""

    def attach(self, slots) -> None:
        self.k = slots.add_host("heuristic_k", fill=self.spec.num_draft_tokens)

    def plan(self, view: BatchView) -> np.ndarray:
        return self.k[: view.n].copy()

    def observe(self, r: RoundResult) -> None:
        k = self.k[: r.n]
        full = (r.accepted >= r.drafted) & (r.drafted > 0)
        k[:] = np.minimum(np.where(full, k + 2, np.maximum(k - 1, 1)), self.spec.max_draft_tokens)


class _BelowConfidence(DraftStopper):
    needs_probs = True

    def __init__(self, threshold: float):
        self.threshold = threshold

    def keep(self, step, token_prob, hidden):
        return token_prob >= self.threshold


class ConfidenceLength(LengthPolicy):
    """Draft up to `max_draft_tokens`, stopping a row when the draft's probability of its token falls
    below `confidence_threshold` (that token is still proposed)."""

    def __init__(self, spec, env=None):
        super().__init__(spec, env)
        self.stopper = _BelowConfidence(spec.confidence_threshold)

    def plan(self, view: BatchView) -> int:
        return self.spec.max_draft_tokens


class _HeadStopper(DraftStopper):
    """Stops a row once 1 - prod P_acc exceeds the threshold, after at least `min_tokens` drafts."""

    min_tokens = 2

    def __init__(self, head, threshold: float, device):
        self.head, self.threshold, self.device = head, threshold, device
        self.needs_probs = head.cfg.reads == "proposing"
        self.after_feed = not self.needs_probs
        self.survive: torch.Tensor | None = None

    def start(self, n: int) -> None:
        self.survive = torch.ones(n, device=self.device)

    def keep(self, step, token_prob, hidden):
        self.survive = self.survive * self.head.p_accept(self.head.features(hidden, token_prob))  # P(no rejection)
        return ((1 - self.survive) <= self.threshold) | (step + 1 < self.min_tokens)


class AcceptanceHeadLength(LengthPolicy):
    """SpecDec++: draft until 1 - prod_i P_acc(x_i) exceeds `acceptance_head.threshold`, at least 2 and at
    most `max_draft_tokens`; P_acc from the trained head on the draft's hidden state (after x_i was fed,
    or the state that drew x_i plus q(x_i): whichever the head was trained on)."""

    def __init__(self, spec, env=None):
        super().__init__(spec, env)
        from ..head import AcceptanceHead

        head = AcceptanceHead.load(spec.acceptance_head.path, self.env.device)
        self.stopper = _HeadStopper(head, spec.acceptance_head.threshold, self.env.device)

    def plan(self, view: BatchView) -> int:
        return self.spec.max_draft_tokens
