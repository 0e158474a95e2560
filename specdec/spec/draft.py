"""What a drafter proposes for a round: a chain of tokens per row, or a token tree (`Tree`), with the distributions
they were drawn from and what the verification rules read (`Draft`). Tensors in, tensors out: a draft knows no
batch."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


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

    @property
    def depth(self) -> int:
        """Host: how many tokens a row can accept this round (a chain's K, a tree's depth)."""
        return self.tree.max_depth if self.tree is not None else self.tokens.shape[1]

    def row_depths(self) -> torch.Tensor | None:
        """[n] a token tree's depth per row, on the device (None: chains, whose depth is `lengths`)."""
        if self.tree is None:
            return None
        valid = torch.arange(self.tokens.shape[1], device=self.tokens.device) < self.lengths[:, None]
        return torch.where(valid, self.tree.depth, 0).amax(1)

    @classmethod
    def empty(cls, n: int, device) -> "Draft":
        """No token for any of n rows (its lengths a view of zeros kept per device: read, never written)."""
        zeros = _ZEROS.get(str(device))
        if zeros is None or zeros.shape[0] < n:
            zeros = _ZEROS[str(device)] = torch.zeros(max(n, 64), dtype=torch.int64, device=device)
        return cls(zeros[:n, None][:, :0], zeros[:n])


_ZEROS: dict[str, torch.Tensor] = {}  # Draft.empty's lengths, per device
