"""Prompt lookup decoding, and AASD's alignment-sampled token trees (Wang et al.).

Each row keeps a pool mapping every n-gram (n = 1..`max_ngram`) of its prompt and output to the
positions that follow each of its occurrences, updated as tokens are accepted (`NgramPool.extend`: the
n-grams ending at each new token, never a rescan). Plain prompt lookup drafts the continuation of the
latest occurrence of the longest suffix n-gram that hits (down to `min_ngram`). A round queued while the one
before is in flight finds the same chains and trees on the device (`device_chains`, `device_trees`: every window of
the rows' tokens there against their suffixes, up to the device's lengths), so it needs none of that round's tokens
on the host (on a GPU: its verification is as wide as the limits, not the longest draft found).

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

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

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
        # and, for trees built on the device, each row's top ids there ([max_len, top], the first `top_lens` rows)
        self.top_dev = slots.add("prompt_top_ids_dev", torch.int32, trailing=(slots.max_len, prompt_top_ids)) \
            if prompt_top_ids else None
        self.top_lens = slots.add("prompt_top_len_dev") if prompt_top_ids else None

    def admit(self, start: int, end: int, target_top_ids: np.ndarray | None = None, drafting: bool = True) -> None:
        for slot in range(start, end):
            self.pools[slot] = self.new_pool()
            prompt = int(self.slots.prompt_lens[slot])
            self.top_ids[slot] = None if target_top_ids is None else target_top_ids[slot - start, : prompt - 1]
        self.prompt_lens_dev[start:end] = to_device(self.slots.prompt_lens[start:end], self.slots.device)
        if self.top_dev is not None:
            lens = np.array([0 if self.top_ids[i] is None else len(self.top_ids[i]) for i in range(start, end)])
            self.top_lens[start:end] = to_device(lens, self.slots.device)
            if lens.any():
                t = min(target_top_ids.shape[1], self.slots.max_len)
                self.top_dev[start:end, :t] = to_device(target_top_ids[:, :t].astype(np.int32), self.slots.device)

    def drafts_ahead(self, n: int) -> bool:
        """Chains and token trees are drafted on the device (`device_chains`, `device_trees`: verified as wide as
        the limits), where that pays (`ahead_pays`)."""
        return self.ahead_pays

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
        if self.slots.in_flight:  # the host lacks the round in flight's tokens
            return self.device_chains(n, limits) if s == 0 else self.device_trees(n, limits, s)
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
        return Draft(tokens, both[:, 0], tree=tree, relaxed=relaxed.bool(), host_tokens=host[:, 1 : 1 + t])

    def followers(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Where `_row`'s drafts start, found on the device from its tokens and lengths (`Slots.seq`, `lens_dev`): for
        every window end before a row's last token, how many of the tokens up to it equal the row's last ones (up to
        `max_ngram`); a row's starts follow the ends where that is longest (and at least `min_ngram`), as its pool's
        `lookup` finds them. Returns starts [n, W] (bool, by position), the rows' tokens seq [n, W] and lengths [n]."""
        s, dev = self.slots, self.slots.device
        lens = s.lens_dev[:n]
        width = min(int(s.lens[:n].max()) + s.in_flight, s.max_len)  # no row is longer
        seq = s.seq[:n, :width]
        most = max(1, min(self.cfg.max_ngram, width - 1))
        back = torch.arange(width, device=dev) - torch.arange(most, device=dev)[:, None]  # [most, W]: end - j
        ends = seq.gather(1, back.clamp(min=0).flatten()[None].expand(n, -1)).view(n, most, width)
        last = seq.gather(1, (lens[:, None] - 1 - torch.arange(most, device=dev)).clamp(min=0))  # [n, most]
        run = ((ends == last[:, :, None]) & (back >= 0)).int().cumprod(1).sum(1)  # [n, W]
        run = torch.where(torch.arange(width, device=dev) < lens[:, None] - 1, run, 0)
        longest = run.amax(1, keepdim=True)
        starts = (run >= longest) & (longest >= self.cfg.min_ngram)
        return F.pad(starts[:, :-1], (1, 0)), seq, lens  # the window ending at e is followed by e + 1

    def depth_room(self, n: int, limits: np.ndarray, lens: torch.Tensor) -> torch.Tensor:
        """[n] each row's deepest draft: its limit, within the room the device counts before max_new_tokens."""
        return torch.minimum(to_device(limits, self.slots.device), (self.slots.ends_dev[:n] - lens - 1).clamp(min=0))

    def device_chains(self, n: int, limits: np.ndarray) -> Draft:
        """The chains `_row` drafts with no siblings, found on the device (`followers`): a row drafts after the
        latest start, up to limits[i] tokens, its last token and the room before max_new_tokens (`depth_room`)."""
        s, dev, k = self.slots, self.slots.device, int(limits.max(initial=0))
        if k == 0:
            return Draft.empty(n, dev)
        starts, _, lens = self.followers(n)
        start = torch.where(starts, torch.arange(starts.shape[1], device=dev), -1).amax(1)  # -1: no hit
        lengths = torch.where(start >= 0, torch.minimum(self.depth_room(n, limits, lens), lens - start), 0)
        at = start[:, None] + torch.arange(k, device=dev)
        tokens = s.seq[:n].gather(1, at.clamp(0, s.max_len - 1))
        return Draft(tokens, lengths, relaxed=at < self.prompt_lens_dev[:n, None])

    def device_trees(self, n: int, limits: np.ndarray, s: int) -> Draft:
        """The token trees `_row` drafts with at most s siblings per node, built on the device (`followers`), nodes
        in `_row`'s order. A tree node is a distinct prefix of the starts' continuations (start p's first d tokens,
        the latest start first); the start that meets it first creates it, where it is among the first s + 1
        children its parent's creators make, its parent exists, and the tree's budget of k (1 + s) nodes is not
        spent. Then the alignment siblings: each prompt-retrieved node's top ids where the target's first is not
        it, in node order, each new to its parent while the parent has at most s children. Padded to k (1 + s)
        nodes and depth k (k: the largest limit)."""
        dev, k = self.slots.device, int(limits.max(initial=0))
        if k == 0:
            return Draft.empty(n, dev)
        starts, seq, lens = self.followers(n)
        w, t = seq.shape[1], k * (1 + s)
        room = self.depth_room(n, limits, lens)
        p = torch.arange(w, device=dev)
        at = p[:, None] + torch.arange(k, device=dev)  # [w, k]: where start p's d-th token lies
        valid = starts[:, :, None] & (at < lens[:, None, None]) & (torch.arange(k, device=dev) < room[:, None, None])
        tok = torch.where(valid, seq.gather(1, at.clamp(max=w - 1).flatten()[None].expand(n, -1)).view(n, w, k), -1)
        # the starts in the order of their continuations (lexicographic): each prefix's starts are consecutive
        order = p.expand(n, w)
        for d in reversed(range(k)):
            order = order.gather(1, tok[:, :, d].gather(1, order).argsort(dim=1, stable=True))
        ranked = tok.gather(1, order[:, :, None].expand(-1, -1, k))
        fresh = F.pad(ranked[:, 1:] != ranked[:, :-1], (0, 0, 1, 0), value=True).cummax(2).values
        group = fresh.int().cumsum(1)  # [n, w, k]: which prefix of each depth a start (so ordered) continues with
        creator = torch.full_like(group, -1, dtype=torch.int64).scatter_reduce(
            1, group - 1, order[:, :, None].expand(-1, -1, k), "amax").gather(1, group - 1)  # its latest start
        unsort = torch.empty_like(order).scatter_(1, order, p.expand(n, w))  # where each start is in `order`
        creator = creator.gather(1, unsort[:, :, None].expand(-1, -1, k))
        group = group.gather(1, unsort[:, :, None].expand(-1, -1, k))
        own = valid & (creator == p[:, None])  # the start that meets a prefix first creates its node
        # each created node's rank among its parent's children, creators in order (latest start first)
        parent = F.pad(group[:, :, :-1], (1, 0))  # the parent prefix's group (depth 1: the root, 0)
        key = (torch.arange(k, device=dev) * (w + 1) + parent) * w + (w - 1 - p)[:, None]
        rank = _rank_within(torch.where(own, key, torch.iinfo(torch.int64).max).flatten(1), w).view(n, w, k)
        made = own & (rank <= s)
        up_ok = torch.ones((n, w), dtype=torch.bool, device=dev)
        for d in range(k):  # a node exists where its parent does
            made[:, :, d] &= up_ok
            up_ok = valid[:, :, d] & made[:, :, d].gather(1, creator[:, :, d])
        # nodes in `_row`'s order (latest start first, then depth) within the budget
        number = made.flip(1).flatten(1).cumsum(1).view(n, w, k).flip(1)  # 1.. in that order
        budget = room * (1 + s)
        made &= number <= budget[:, None, None]
        # each node's parent's number (depth 1's: the root, 0)
        up_number = F.pad(number[:, :, :-1].gather(1, creator[:, :, :-1]), (1, 0)).flatten(1)
        plen = self.prompt_lens_dev[:n, None]
        nodes = _Nodes(n, t, dev)

        def fields(i):  # start i // k, depth i % k + 1: its token lies at i // k + i % k
            src = i // k + i % k
            return [tok.flatten(1).gather(1, i), up_number.gather(1, i), i % k + 1, src < plen, src]

        nodes.put(made.flatten(1), number.flatten(1), fields)
        if self.top_dev is not None and any(self.top_ids[i] is not None for i in range(n)):
            self.align(n, nodes, s, budget)
        return nodes.draft(k)

    def align(self, n: int, nodes: _Nodes, s: int, budget: torch.Tensor) -> None:
        """AASD's alignment siblings of the prompt-retrieved nodes of trees built on the device (`_row`'s second
        pass): each node's target top ids (where the first is not it), in node order then rank, each that is new to
        the node's parent while the parent has at most s children, within the budget."""
        dev, t, m = self.slots.device, nodes.t, nodes.count
        top = self.top_dev[:n]  # [n, max_len, K]
        K = top.shape[2]
        at = nodes.src[:, :t]
        tok, par, dep = nodes.tokens[:, :t], nodes.parent[:, :t], nodes.depth[:, :t]
        occ = torch.arange(t, device=dev) < m[:, None]  # [n, t] the nodes so far
        ids = top.gather(1, (at - 1).clamp(0, top.shape[1] - 1)[:, :, None].expand(-1, -1, K)).long()  # [n, t, K]
        asks = occ & (at >= 1) & (at - 1 < self.top_lens[:n, None]) & (ids[:, :, 0] != tok)
        cand = ids.flatten(1)  # [n, C]: node j's K ids in turn, nodes in order
        cpar = par[:, :, None].expand(-1, -1, K).flatten(1)
        child = (cpar[:, :, None] == par[:, None, :]) & occ[:, None, :]  # [n, C, t]: node is a child of cand's parent
        new = asks[:, :, None].expand(-1, -1, K).flatten(1) & ~(child & (cand[:, :, None] == tok[:, None, :])).any(2)
        earlier = torch.ones(cand.shape[1], cand.shape[1], dtype=torch.bool, device=dev).tril(-1)  # [i, j]: j < i
        sibling = (cpar[:, :, None] == cpar[:, None, :]) & earlier
        new &= ~(sibling & (cand[:, :, None] == cand[:, None, :]) & new[:, None, :]).any(2)  # the first of equals
        add = new & (child.sum(2) + (sibling & new[:, None, :]).sum(2) <= s)  # the parent's children before it
        number = m[:, None] + add.cumsum(1)
        add &= number <= budget[:, None]
        depth = dep[:, :, None].expand(-1, -1, K).flatten(1)
        nodes.put(add, number, lambda i: [cand.gather(1, i), cpar.gather(1, i), depth.gather(1, i),
                                          torch.ones_like(i), torch.zeros_like(i)])  # relaxed, from no position

    def rewind(self, n: int) -> None:
        for slot in range(n):  # rows were cut back: index them again when next asked
            self.pools[slot] = self.new_pool()


class _Nodes:
    """The nodes of n token trees being built on the device (`PromptLookupProposer.device_trees`): up to t each,
    and a column past them that what is not kept is written to. Per node, in one tensor: its token, its parent's
    number, its depth, whether it is relaxed, and the position its token came from."""

    def __init__(self, n: int, t: int, device):
        self.t = t
        self.data = torch.zeros((n, t + 1, 5), dtype=torch.int64, device=device)
        self.data[:, :, 2] = 1  # padding: depth 1 under the root (never accepted)
        self.count = torch.zeros(n, dtype=torch.int64, device=device)

    def put(self, keep: torch.Tensor, number: torch.Tensor, fields: Callable) -> None:
        """The candidates [n, M] where `keep`, each as node `number` (1..t): fields(i) gives, for candidates i
        [n, t + 1] (each node's; 0 where none), their tokens, parents' numbers, depths, relaxed flags and the
        positions their tokens came from (0 for an alignment sibling)."""
        n, m = keep.shape
        pick = torch.full((n, self.t + 1), -1, dtype=torch.int64, device=keep.device)
        pick.scatter_(1, torch.where(keep, number - 1, self.t), torch.arange(m, device=keep.device).expand(n, m))
        values = torch.stack([x.to(torch.int64) for x in fields(pick.clamp(min=0))], -1)
        self.data = torch.where((pick >= 0)[:, :, None], values, self.data)
        self.count += keep.sum(1)

    def __getattr__(self, name: str) -> torch.Tensor:
        """tokens, parent, depth, relaxed, src: [n, t + 1] views."""
        fields = ("tokens", "parent", "depth", "relaxed", "src")
        if name not in fields:
            raise AttributeError(name)
        return self.data[:, :, fields.index(name)]

    def draft(self, depth: int) -> Draft:
        t = self.t
        tree = Tree(self.parent[:, :t], self.depth[:, :t], depth)
        return Draft(self.tokens[:, :t], self.count, tree=tree, relaxed=self.relaxed[:, :t].bool())


def _rank_within(keys: torch.Tensor, width: int) -> torch.Tensor:
    """For keys [n, m] of the form group * width + order (order < width), each one's rank in its row's group by
    order (0: first)."""
    flat, order = keys.sort(1)
    group = flat.div(width, rounding_mode="floor")
    i = torch.arange(keys.shape[1], device=keys.device).expand_as(keys)
    head = torch.where(F.pad(group[:, 1:] != group[:, :-1], (1, 0), value=True), i, 0).cummax(1).values
    return torch.empty_like(flat).scatter_(1, order, i - head)
