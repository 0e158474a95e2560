"""The proposer seam: what a drafter returns and the calls the engine makes on it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Draft:
    tokens: torch.Tensor  # [n, K] drafted token ids; padding past a row's length is ignored
    lengths: torch.Tensor  # [n] tokens proposed per row (0..K)
    q_probs: torch.Tensor | None  # [n, K, vocab] distributions the tokens were sampled from; None = point mass
    forwards: int = 0  # draft model forward passes run for this round (the whole batch takes part)
    bad: torch.Tensor | None = None  # [n] bool: the draft's logits for the row held NaN or inf
    relaxed: torch.Tensor | None = None  # [n, K] bool: tokens conditional verification may pass (from the prompt)
    parent: torch.Tensor | None = None  # [n, K] a token tree: each node's parent (0: the pending token); None: chains
    depth: torch.Tensor | None = None  # [n, K] each node's depth (1: a child of the pending token)
    max_depth: int = 0  # host: the deepest node (a chain's K)
    raw_q: torch.Tensor | None = None  # [n, K, vocab] softmax of the draft's raw logits (fuzzy verification)

    @classmethod
    def empty(cls, n: int, device) -> "Draft":
        return cls(torch.zeros((n, 0), dtype=torch.int64, device=device),
                   torch.zeros(n, dtype=torch.int64, device=device), None, 0)


class Proposer:
    """Drafts tokens for the active rows [0, n) of a batch (see engine.Batch)."""

    deterministic = True  # q is a point mass on each drafted token

    def __init__(self, batch):
        self.batch = batch

    prefill_top = 0  # the target's top ids the proposer wants at every prompt position (0: none)

    def admit(self, start: int, end: int, target_top: np.ndarray | None = None) -> None:
        """Rows [start, end) joined the batch (their prompts are in batch.seq); `target_top` [rows, t,
        prefill_top]: the target's top ids at each prompt position, from its prefill."""

    def propose(self, n: int, limits: np.ndarray) -> Draft:
        """Draft up to limits[i] tokens for row i of [0, n) (a host array)."""
        raise NotImplementedError

    def commit(self, n: int, old_len: np.ndarray, accepted: np.ndarray) -> None:
        """Verification accepted `accepted` [n] of the drafted tokens of rows whose length was `old_len`
        (host arrays, from the round's read-back)."""

    def rewind(self, n: int) -> None:
        """Rows [0, n) were cut back to `batch.lens`: forget what lies past it (start-up profile)."""

    def move_row(self, src: int, dst: int) -> None:
        """Row src now lives at dst (swap-remove of a finished row)."""
