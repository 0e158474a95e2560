"""The draft-length policy seam: `plan` a round, `observe` what it did.

Before every round the engine shows a policy the batch (`BatchView`) and asks how many tokens each
row may draft: one int for every row (the common case) or an array per row (0 = no speculation; the
engine clips to `max_draft_tokens` and to each row's room); a drafter of token trees reads how wide
from the policy's `siblings` after `plan`. After the round's one read-back it shows
what happened (`RoundResult`). A policy owns its state: what it learns lives on the policy (one per
engine, so it outlives batches), what it keeps per row lives in the batch's `Slots`, registered by
`attach` and reset there when rows join.

Optional, where a policy needs them: `drafts_soon` and `widens_soon` (will the next round draft, with
siblings? if not, a drafter may defer or skip work for rows joining now) and a `stopper` (stops rows' drafts on the draft's own outputs, at
the price of a host sync per draft step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from ...config import SpecConfig
    from ..costmodel import CostModel
    from ...sched.slots import Slots


@dataclass
class PolicyEnv:
    """What the engine gives the policies it builds."""

    device: torch.device | str = "cpu"
    costs: CostModel | None = None  # measured costs, for a policy that plans from them (`Policy.needs_costs`)
    row_tokens: int = 0  # the tokens a row emits unless it stops early: max_new_tokens
    siblings: int = 0  # the most siblings per node of the method's token trees (0: chains)


@dataclass
class BatchView:
    n: int  # active rows [0, n)
    waiting: int  # prompts queued for a free slot
    admitted: int = 0  # rows admitted since the last round
    reach: np.ndarray | None = None  # [n, S + 1] the deepest draft row i can make now with s siblings per node
    # (`Proposer.reach`; None: as deep as asked)


@dataclass
class RoundResult:
    n: int
    drafted: np.ndarray  # [n] tokens each row proposed (tree nodes, for token trees)
    accepted: np.ndarray  # [n] of them accepted (a tree's: the accepted path's depth)
    finished: np.ndarray  # [n] bool: rows that leave the batch after this round
    seconds: float | None  # the round's time from plan to read-back; None: no sample of its length's cost
    depth: np.ndarray | None = None  # [n] a token tree's depth per row (None: chains, whose depth is `drafted`)
    width: int | None = None  # tokens per row its target forward verified (None: the most drafted + 1)

    @property
    def depths(self) -> np.ndarray:
        return self.drafted if self.depth is None else self.depth

    @property
    def verify_width(self) -> int:
        return self.width if self.width is not None else int(self.drafted.max(initial=0)) + 1


class DraftStopper:
    """Stops rows' drafts on the draft's outputs: after draft step `step`, `keep` says which rows go on."""

    needs_probs = False  # keep() reads q(x) of the drafted token
    after_feed = False  # keep() reads the draft's hidden state after x was fed back

    def start(self, n: int) -> None:
        """A round of n rows begins."""

    def keep(self, step: int, token_prob: torch.Tensor | None, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class LengthPolicy:
    stopper: DraftStopper | None = None
    siblings: int | None = None  # a token tree's most siblings per node in the planned round (None: as configured)

    def __init__(self, spec: SpecConfig, env: PolicyEnv | None = None):
        self.spec = spec
        self.env = env or PolicyEnv()

    def attach(self, slots: Slots) -> None:
        """A new batch: register per-row state in its slots."""

    def plan(self, view: BatchView) -> int | np.ndarray:
        raise NotImplementedError

    def observe(self, result: RoundResult) -> None:
        pass

    def drafts_soon(self, view: BatchView) -> bool:
        return True

    def most_drafted(self) -> int | None:
        """The most tokens a row drafts in a round under this policy (None: up to the method's `max_draft`)."""
        return None

    def widens_soon(self, view: BatchView) -> bool:
        """Will the next round draft token trees with siblings? (if not, rows joining now skip alignment
        sampling's top ids: the output head over their whole prompts)"""
        return self.siblings is None or self.siblings > 0
