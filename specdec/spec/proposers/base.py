"""The proposer seam: what a drafter returns, and the calls the engine makes on it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from ...sched.batch import Batch
    from ..sampling import Draws, Rows


@dataclass
class Tree:
    """The shape of a token-tree draft (specdec/spec/trees.py); node 0 is the row's pending token."""

    parent: torch.Tensor  # [n, T] each node's parent (0: the pending token)
    depth: torch.Tensor  # [n, T] each node's depth (1: a child of the pending token)
    max_depth: int  # host: the deepest node
    host_parent: np.ndarray | None = None  # [n, T] `parent` on the host, where the proposer has it


@dataclass
class Draft:
    tokens: torch.Tensor  # [n, T] drafted token ids (chain positions, or tree nodes); padding past `lengths` is junk
    lengths: torch.Tensor  # [n] tokens (nodes) proposed per row
    q: torch.Tensor | None = None  # [n, T, vocab] distributions the tokens were drawn from; None = point mass
    tree: Tree | None = None  # None: each row's tokens are a chain
    forwards: int = 0  # draft-model forwards run for this round (the whole batch takes part)
    non_finite: torch.Tensor | None = None  # [n] bool: the draft's logits for the row held NaN or inf
    # what relaxed rules read (specdec/spec/verify.py): nodes conditional verification may pass (taken from the
    # prompt), and the draft's raw distributions that fuzzy verification compares with the target's
    relaxed: torch.Tensor | None = None  # [n, T] bool
    raw_q: torch.Tensor | None = None  # [n, T, vocab]
    host_tokens: np.ndarray | None = None  # [n, T] `tokens` on the host, where the proposer has them
    allowed: torch.Tensor | None = None  # [n, T+1, vocab] bool: the output formats' masks (specdec/spec/grammar.py)
    host_depth: np.ndarray | None = None  # [n] host: each row's depth (None: chains, whose depth is `lengths`)

    @property
    def depth(self) -> int:
        """Host: how many tokens a row can accept this round (a chain's K, a tree's depth)."""
        return self.tree.max_depth if self.tree is not None else self.tokens.shape[1]

    @classmethod
    def empty(cls, n: int, device) -> "Draft":
        return cls(torch.zeros((n, 0), dtype=torch.int64, device=device), torch.zeros(n, dtype=torch.int64, device=device))


class Proposer:
    """Drafts tokens for the active rows [0, n) of a batch; the base class never drafts (method none). What a
    proposer keeps per row it registers in the batch's `slots`, which move it with its row."""

    prompt_top_ids = 0  # the target's most likely ids the proposer wants at every prompt position (0: none)

    def __init__(self, batch: Batch):
        self.batch = batch

    def admit(self, start: int, end: int, target_top_ids: np.ndarray | None = None, drafting: bool = True) -> None:
        """Rows [start, end) joined the batch (their prompts are in batch.seq); `target_top_ids` [rows, t,
        prompt_top_ids]: the target's most likely ids at each prompt position, from its prefill; `drafting`:
        whether the next round drafts (if not, a drafter may defer work for these rows)."""

    def propose(self, n: int, limits: np.ndarray, rows: Rows, draws: Draws, siblings: int | None = None) -> Draft:
        """Draft up to limits[i] tokens for row i of [0, n) (a host array), by the rows' sampling settings and the
        round's randomness (`draws.draft`: a uniform per step; or Gumbel noise by position); `siblings`: a token
        tree's most siblings per node this round (None: the configured most; drafters of chains ignore it)."""
        return Draft.empty(n, self.batch.device)

    def reach(self, n: int) -> np.ndarray | None:
        """[n, S + 1] the deepest draft each of rows [0, n) can make now with s = 0..S siblings per node (S: the
        most this proposer drafts; 0 for chains), or None where a draft is as deep as asked (a draft model)."""
        return None

    def commit(self, n: int, old_len: np.ndarray, accepted: np.ndarray) -> None:
        """Verification accepted `accepted` [n] of the drafted tokens of rows whose length was `old_len`
        (host arrays, from the round's read-back)."""

    def rewind(self, n: int) -> None:
        """Rows [0, n) were cut back to `batch.lens`: forget what lies past it (start-up profile)."""
