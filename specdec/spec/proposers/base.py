"""The proposer seam: the calls the engine makes on a drafter. A proposer sees the batch as its rows' `Slots`
(specdec/sched/slots.py: their tokens, lengths, and the state it registers there) and returns a `Draft`
(specdec/spec/draft.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from ..draft import Draft

if TYPE_CHECKING:
    from ...sched.slots import Slots
    from ..sampling import Draws, Rows


class Proposer:
    """Drafts tokens for the active rows [0, n) of a batch; the base class never drafts (method none). What a
    proposer keeps per row it registers in the batch's `slots`, which move it with its row."""

    prompt_top_ids = 0  # the target's most likely ids the proposer wants at every prompt position (0: none)

    def __init__(self, slots: Slots):
        self.slots = slots

    def admit(self, start: int, end: int, target_top_ids: np.ndarray | None = None, drafting: bool = True) -> None:
        """Rows [start, end) joined the batch (their prompts are in `slots.seq`); `target_top_ids` [rows, t,
        prompt_top_ids]: the target's most likely ids at each prompt position, from its prefill; `drafting`:
        whether the next round drafts (if not, a drafter may defer work for these rows)."""

    def propose(self, n: int, limits: np.ndarray, rows: Rows, draws: Draws, siblings: int | None = None) -> Draft:
        """Draft up to limits[i] tokens for row i of [0, n) (a host array), by the rows' sampling settings and the
        round's randomness (`draws.draft`: a uniform per step; or Gumbel noise by position); `siblings`: a token
        tree's most siblings per node this round (None: the configured most; drafters of chains ignore it)."""
        return Draft.empty(n, self.slots.device)

    def reach(self, n: int) -> np.ndarray | None:
        """[n, S + 1] the deepest draft each of rows [0, n) can make now with s = 0..S siblings per node (S: the
        most this proposer drafts; 0 for chains), or None where a draft is as deep as asked (a draft model)."""
        return None

    def drafts_ahead(self, n: int) -> bool:
        """Whether rows [0, n) can be drafted for while the round before is in flight (`Slots.in_flight`): from the
        device's lengths alone, without that round's tokens on the host."""
        return False

    @property
    def ahead_pays(self) -> bool:
        """Whether drafting ahead at a cost pays (a draft run to its limit, a verification as wide as the limits):
        where a read waits for every round queued on the device (a GPU), not on a CPU, where it costs nothing."""
        return self.slots.device.type != "cpu"

    def advance(self, n: int, old_len: torch.Tensor, accepted: torch.Tensor, forwards: int) -> None:
        """On the device, as the round is queued: it accepted `accepted` [n] of the drafted tokens of rows whose
        length was `old_len` [n], after `forwards` draft forwards."""

    def commit(self, n: int, old_len: np.ndarray, accepted: np.ndarray, forwards: int) -> None:
        """The same on the host, from the round's read-back (`old_len`, `accepted`: host arrays)."""

    def rewind(self, n: int) -> None:
        """Rows [0, n) were cut back to `slots.lens`: forget what lies past it (start-up profile)."""
