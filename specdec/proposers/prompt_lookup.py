"""Prompt lookup decoding, and AASD's alignment-sampled token trees (Wang et al.).

Each row keeps a pool mapping every n-gram (n = 1..`max_ngram`) of its prompt and output to the
position that follows its latest occurrence, updated as tokens are accepted (`NgramPool.extend`: the
n-grams ending at each new token, never a rescan). The draft is the continuation of the longest suffix
n-gram that hits (down to `min_ngram`).

Alignment sampling (`alignment_sampling` = s > 0): the target's prefill keeps its top s + 1 ids at
every prompt position. Where a token retrieved from the prompt is not the target's top choice there,
up to s of those top ids join the draft as siblings of that token (leaves sharing its parent): the
draft becomes a token tree (specdec/trees.py). Prompt-retrieved tokens and siblings are `relaxed`
(conditional verification may pass them); tokens retrieved from generated text stay strict.
Deterministic either way: q is a point mass on each node.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .base import Draft, Proposer, Tree

if TYPE_CHECKING:
    from ..batch import Batch
    from ..config import PromptLookupConfig


class NgramPool:
    """The n-grams of one row's tokens, each mapped to the index that follows its latest occurrence."""

    def __init__(self, max_ngram: int, min_ngram: int):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.index: dict[tuple[int, ...], int] = {}
        self.upto = 0  # n-grams ending before token upto - 1 are indexed (each needs a follower)

    def extend(self, tokens: list[int]) -> None:
        """Index the n-grams that ended before the last token and are not indexed yet."""
        for end in range(max(self.upto - 1, 0), len(tokens) - 1):  # n-grams ending at `end`, followed by end + 1
            for n in range(1, min(self.max_ngram, end + 1) + 1):
                self.index[tuple(tokens[end - n + 1 : end + 1])] = end + 1
        self.upto = len(tokens)

    def lookup(self, tokens: list[int], k: int) -> int | None:
        """Where the draft starts: the follower of the longest suffix of `tokens` seen earlier (None if none)."""
        self.extend(tokens)
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            start = self.index.get(tuple(tokens[len(tokens) - n :]))
            if start is not None:
                return start
        return None


class PromptLookupProposer(Proposer):
    def __init__(self, batch: Batch, cfg: PromptLookupConfig):
        super().__init__(batch)
        self.cfg = cfg
        self.prefill_top = cfg.alignment_sampling + 1 if cfg.alignment_sampling else 0
        self.pools: list[NgramPool | None] = [None] * batch.capacity
        self.prompt_len = [0] * batch.capacity
        self.top: list[np.ndarray | None] = [None] * batch.capacity  # [prompt_len - 1, s + 1] target top ids

    def admit(self, start: int, end: int, target_top: np.ndarray | None = None, drafting: bool = True) -> None:
        for slot in range(start, end):
            row = self.batch.rows[slot]
            self.pools[slot] = NgramPool(self.cfg.max_ngram, self.cfg.min_ngram)
            self.prompt_len[slot] = len(row.tokens)
            self.top[slot] = None if target_top is None else target_top[slot - start, : len(row.tokens) - 1]

    def _row(self, slot: int, k: int) -> tuple[list[int], list[int], list[int], list[bool]]:
        """Row `slot`'s draft of at most k chain tokens: tokens, parents, depths, relaxed flags (chain first,
        then alignment siblings)."""
        tokens = self.batch.rows[slot].tokens
        start = self.pools[slot].lookup(tokens, k) if k > 0 else None
        if start is None:
            return [], [], [], []
        chain = tokens[start : start + k]
        plen, top = self.prompt_len[slot], self.top[slot]
        toks, parents, depths = list(chain), list(range(len(chain))), list(range(1, len(chain) + 1))
        relaxed = [start + i < plen for i in range(len(chain))]
        if top is not None:
            for i, x in enumerate(chain):
                at = start + i - 1  # the prompt position whose prediction is token start + i
                if not 0 <= at < len(top) or top[at, 0] == x:
                    continue
                siblings = [int(t) for t in top[at] if t != x][: self.cfg.alignment_sampling]
                toks += siblings
                parents += [i] * len(siblings)
                depths += [i + 1] * len(siblings)
                relaxed += [True] * len(siblings)
        return toks, parents, depths, relaxed

    def propose(self, n: int, limits: np.ndarray, u=None) -> Draft:
        b = self.batch
        rows = [self._row(i, int(limit)) for i, limit in enumerate(limits.tolist())]
        t = max((len(r[0]) for r in rows), default=0)
        # one host array, one copy: lengths, then tokens, parents, depths and relaxed flags
        host = np.zeros((n, 1 + 4 * t), dtype=np.int64)
        host[:, 1 + 2 * t : 1 + 3 * t] = 1  # padding nodes: depth 1 under the root (never accepted)
        for i, (toks, parents, depths, relaxed) in enumerate(rows):
            m = len(toks)
            host[i, 0] = m
            for j, values in enumerate((toks, parents, depths, relaxed)):
                host[i, 1 + j * t : 1 + j * t + m] = values
        both = b.to_device(host)
        tokens, parent, depth, relaxed = (both[:, 1 + j * t : 1 + (j + 1) * t] for j in range(4))
        branched = self.prefill_top and any(len(r[0]) > (max(r[2]) if r[2] else 0) for r in rows)
        max_depth = max((max(r[2]) for r in rows if r[2]), default=0)
        tree = Tree(parent, depth, max_depth, host[:, 1 + t : 1 + 2 * t]) if branched else None
        return Draft(tokens, both[:, 0], tree=tree, relaxed=relaxed.bool(), host_tokens=host[:, 1 : 1 + t])

    def rewind(self, n: int) -> None:
        for slot in range(n):  # rows were cut back: index them again when next asked
            self.pools[slot] = NgramPool(self.cfg.max_ngram, self.cfg.min_ngram)

    def move_row(self, src: int, dst: int) -> None:
        for state in (self.pools, self.prompt_len, self.top):
            state[dst] = state[src]

    def copy_row(self, src: int, dst: int) -> None:
        self.move_row(src, dst)
        self.pools[dst] = NgramPool(self.cfg.max_ngram, self.cfg.min_ngram)  # its own: rows grow apart
