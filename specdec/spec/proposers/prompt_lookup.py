"""Prompt lookup decoding, and AASD's alignment-sampled token trees (Wang et al.).

Each row keeps a pool mapping every n-gram (n = 1..`max_ngram`) of its prompt and output to the
positions that follow each of its occurrences, updated as tokens are accepted (`NgramPool.extend`: the
n-grams ending at each new token, never a rescan). Plain prompt lookup drafts the continuation of the
latest occurrence of the longest suffix n-gram that hits (down to `min_ngram`). A round queued while the one
before is in flight finds the same chains on the device (`device_chains`: every window of the rows' tokens there
against their suffixes, up to the device's lengths), so it needs none of that round's tokens on the host (on a GPU:
its verification is as wide as the limits, not the longest chain found).

AASD (`alignment_sampling` = s > 0) makes the draft a token tree (specdec/spec/trees.py) with at most s
siblings per node (the length policy may ask for fewer in a round: `siblings`, 0 = the chain alone)
and at most (1 + s) nodes per level of depth. The continuations of every occurrence merge into one
tree, shared prefixes once, the latest occurrence's chain first (the paper's pool). Then alignment
sampling: the target's prefill keeps its top s + 1 ids at every prompt position; where a node
retrieved from the prompt is not the target's top choice there, those top ids join as its siblings,
within the budget. Prompt-retrieved nodes and siblings are `relaxed` (conditional verification may
pass them); tokens retrieved from generated text stay strict. Deterministic either way: q is a point
mass on each node.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from ...exec.inputs import to_device
from ..draft import Draft, Tree
from .base import Proposer

if TYPE_CHECKING:
    from ...config import PromptLookupConfig
    from ...sched.slots import Slots


class NgramPool:
    """The n-grams of one row's tokens, each mapped to the indices that follow its occurrences (latest last)."""

    def __init__(self, max_ngram: int, min_ngram: int):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.index: dict[tuple[int, ...], list[int]] = {}
        self.upto = 0  # n-grams ending before token upto - 1 are indexed (each needs a follower)
        self.found: tuple[int, list[int]] = (-1, [])  # the last lookup: (tokens' length, its answer)

    def extend(self, tokens: list[int]) -> None:
        """Index the n-grams that ended before the last token and are not indexed yet."""
        for end in range(max(self.upto - 1, 0), len(tokens) - 1):  # n-grams ending at `end`, followed by end + 1
            for n in range(1, min(self.max_ngram, end + 1) + 1):
                self.index.setdefault(tuple(tokens[end - n + 1 : end + 1]), []).append(end + 1)
        self.upto = len(tokens)

    def lookup(self, tokens: list[int]) -> list[int]:
        """Where drafts start: the followers of every earlier occurrence of the longest suffix of `tokens` that
        occurred before, latest last (empty if none). The pool's own list, not a copy: read it, never change it.
        Rows only grow, so a second lookup at the same length (a round's `reach`, then its draft) is the first's."""
        if self.found[0] == len(tokens):
            return self.found[1]
        self.extend(tokens)
        starts = next((hit for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1)
                       if (hit := self.index.get(tuple(tokens[len(tokens) - n :])))), [])
        self.found = (len(tokens), starts)
        return starts


class PromptLookupProposer(Proposer):
    def __init__(self, slots: Slots, cfg: PromptLookupConfig, prompt_top_ids: int = 0):
        super().__init__(slots)
        self.cfg = cfg
        self.prompt_top_ids = prompt_top_ids
        # a sample sharing a prompt starts with a pool of its own: rows grow apart
        self.pools: list[NgramPool | None] = slots.add_objects("ngram_pool", lambda src, dst: self.new_pool())
        self.top_ids: list[np.ndarray | None] = slots.add_objects("prompt_top_ids")  # [prompt_len - 1, s + 1]
        self.prompt_lens_dev = slots.add("prompt_len_dev")  # on the device: which drafted tokens are the prompt's

    def admit(self, start: int, end: int, target_top_ids: np.ndarray | None = None, drafting: bool = True) -> None:
        for slot in range(start, end):
            self.pools[slot] = self.new_pool()
            prompt = int(self.slots.prompt_lens[slot])
            self.top_ids[slot] = None if target_top_ids is None else target_top_ids[slot - start, : prompt - 1]
        self.prompt_lens_dev[start:end] = to_device(self.slots.prompt_lens[start:end], self.slots.device)

    def drafts_ahead(self, n: int) -> bool:
        """Chains are drafted on the device (`device_chains`, verified as wide as the limits, where that pays:
        `ahead_pays`); token trees (alignment sampling) from the host's tokens."""
        return self.cfg.alignment_sampling == 0 and self.ahead_pays

    def new_pool(self) -> NgramPool:
        return NgramPool(self.cfg.max_ngram, self.cfg.min_ngram)

    def _row(self, slot: int, k: int, s: int) -> tuple[list[int], list[int], list[int], list[bool]]:
        """Row `slot`'s draft of depth at most k with at most s siblings per node: tokens, parents, depths,
        relaxed flags of its nodes (the latest occurrence's chain first)."""
        tokens = self.slots.history[slot]
        starts = self.pools[slot].lookup(tokens) if k > 0 else []
        if not starts:
            return [], [], [], []
        plen, top = int(self.slots.prompt_lens[slot]), self.top_ids[slot]
        toks, parents, depths, relaxed, src = [], [], [], [], []
        children: dict[int, dict[int, int]] = {0: {}}  # node -> its children's tokens -> node
        budget = k * (1 + s)

        def add(token: int, parent: int, at: int | None) -> int:
            toks.append(token)
            parents.append(parent)
            depths.append(depths[parent - 1] + 1 if parent else 1)
            relaxed.append(at is None or at < plen)  # prompt-retrieved, or an alignment sibling
            src.append(at)
            children[parent][token] = len(toks)
            children[len(toks)] = {}
            return len(toks)

        for j, start in enumerate(reversed(starts) if s else starts[-1:]):  # every occurrence's, latest first
            if len(toks) >= budget:
                break  # a full tree takes no more: later occurrences would only walk it
            node = 0
            for at in range(start, min(start + k, len(tokens))):
                x = tokens[at]
                if x in children[node]:
                    node = children[node][x]
                    continue
                if len(toks) >= budget or (j and len(children[node]) > s):
                    break
                node = add(x, node, at)
        if top is not None and s:  # alignment sampling on the prompt-retrieved nodes
            for i, at in enumerate(list(src)):
                if at is None or not 0 <= at - 1 < len(top) or top[at - 1, 0] == toks[i]:
                    continue  # top[at - 1]: the target's choices at the prompt position that predicts token `at`
                parent = parents[i]
                for t in top[at - 1].tolist():
                    if len(toks) >= budget or len(children[parent]) > s:
                        break
                    if t not in children[parent]:
                        add(int(t), parent, None)
        return toks, parents, depths, relaxed

    def reach(self, n: int) -> np.ndarray:
        """[n, S + 1]: the tokens after the latest occurrence of each row's suffix n-gram (a chain's depth), and
        after its earliest (a tree's, which merges every occurrence's); 0 where none occurred."""
        out = np.zeros((n, 1 + self.cfg.alignment_sampling), dtype=np.int64)
        for i in range(n):
            tokens = self.slots.history[i]
            starts = self.pools[i].lookup(tokens)
            if starts:
                out[i, 0], out[i, 1:] = len(tokens) - starts[-1], len(tokens) - starts[0]
        return out

    def propose(self, n: int, limits: np.ndarray, rows=None, draws=None, siblings: int | None = None) -> Draft:
        s = self.cfg.alignment_sampling if siblings is None else min(siblings, self.cfg.alignment_sampling)
        if s == 0 and self.slots.in_flight:  # the host lacks the round in flight's tokens
            return self.device_chains(n, limits)
        rows = [self._row(i, int(limit), s) for i, limit in enumerate(limits.tolist())]
        t = max((len(r[0]) for r in rows), default=0)
        # one host array, one copy: lengths, then tokens, parents, depths and relaxed flags
        host = np.zeros((n, 1 + 4 * t), dtype=np.int64)
        host[:, 1 + 2 * t : 1 + 3 * t] = 1  # padding nodes: depth 1 under the root (never accepted)
        for i, (toks, parents, depths, relaxed) in enumerate(rows):
            m = len(toks)
            host[i, 0] = m
            for j, values in enumerate((toks, parents, depths, relaxed)):
                host[i, 1 + j * t : 1 + j * t + m] = values
        both = to_device(host, self.slots.device)
        tokens, parent, depth, relaxed = (both[:, 1 + j * t : 1 + (j + 1) * t] for j in range(4))
        row_depth = np.array([max(r[2], default=0) for r in rows], dtype=np.int64)
        branched = bool((host[:, 0] > row_depth).any())
        tree = Tree(parent, depth, int(row_depth.max(initial=0)), host[:, 1 + t : 1 + 2 * t]) if branched else None
        return Draft(tokens, both[:, 0], tree=tree, relaxed=relaxed.bool(), host_tokens=host[:, 1 : 1 + t],
                     host_depth=row_depth if branched else None)

    def device_chains(self, n: int, limits: np.ndarray) -> Draft:
        """The chains `_row` drafts with no siblings, found on the device from its tokens and lengths (`Slots.seq`,
        `lens_dev`): for each n-gram size, longest first, every window of a row's tokens that ends before its last
        token is compared with its suffix; a row drafts after the latest hit of the longest size that hits, up to
        limits[i] tokens, its last token and the room the device counts before max_new_tokens."""
        s, dev, k = self.slots, self.slots.device, int(limits.max(initial=0))
        if k == 0:
            return Draft.empty(n, dev)
        lens = s.lens_dev[:n]
        width = min(int(s.lens[:n].max()) + s.in_flight, s.max_len)  # no row is longer
        seq = s.seq[:n, :width]
        start = torch.full((n,), -1, dtype=torch.int64, device=dev)  # where each row's draft starts (-1: no hit)
        for g in range(min(self.cfg.max_ngram, width - 1), self.cfg.min_ngram - 1, -1):
            cols = width - g  # windows seq[c : c + g] followed by a token within the bound
            suffix = seq.gather(1, (lens[:, None] - g + torch.arange(g, device=dev)).clamp(min=0))  # [n, g]
            at = torch.arange(cols, device=dev)
            hit = (seq.unfold(1, g, 1)[:, :cols] == suffix[:, None, :]).all(-1) & (at <= (lens - g - 1)[:, None])
            latest = torch.where(hit, at, -1).amax(1)
            start = torch.where((start < 0) & (latest >= 0), latest + g, start)
        room = torch.minimum(to_device(limits, dev), (s.ends_dev[:n] - lens - 1).clamp(min=0))
        lengths = torch.where(start >= 0, torch.minimum(room, lens - start), 0)
        at = start[:, None] + torch.arange(k, device=dev)
        tokens = s.seq[:n].gather(1, at.clamp(0, s.max_len - 1))
        return Draft(tokens, lengths, relaxed=at < self.prompt_lens_dev[:n, None])

    def rewind(self, n: int) -> None:
        for slot in range(n):  # rows were cut back: index them again when next asked
            self.pools[slot] = self.new_pool()
