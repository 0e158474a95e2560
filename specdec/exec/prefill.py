"""Prefills: a model's cache rows filled with their tokens, planned on the host, then run.

`Prefiller.plan` decides, for each row of a prefill and without touching the device, the slots its cache is to hold
(all but its pending token), what the model's prefix store gives of them (specdec/exec/prefix.py), what the row holds
already, and up to where the prefill's own forwards compute (`RowPrefill`). `Prefiller.run` then loads the store's
blocks, runs forwards of at most `chunk` tokens (rows x tokens) over the token buffer, and stores the prompts' blocks.
A plan with a tail (`PrefillPlan.tail`) stops each row short of its last slots: a round's forward computes them
(specdec/exec/inputs.py `Join`), and the store takes the rows' blocks after it (`Prefiller.keep`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .inputs import to_device
from .prefix import PrefixStore


@dataclass
class RowPrefill:
    """One row's prefill, as planned."""

    slot: int  # its cache row
    tokens: Sequence[int]  # its tokens on the host
    prompt: int  # how many of them are its prompt (the store takes the prompt's blocks)
    cached: int  # slots its cache holds once the prefill ends: all but the pending token
    keys: list[int]  # the store's blocks it loads (none when they give no more than it holds)
    reused: int  # tokens those blocks give
    done: int  # slots it holds before any forward: what it had, the store's blocks, the blocks it shares
    upto: int  # slots it holds once the prefill's own forwards ran (below `cached`: a round's forward ends it)


@dataclass
class PrefillPlan:
    """A prefill of the consecutive rows `rows`; `top_ids`: the model's most likely ids wanted at every position."""

    rows: list[RowPrefill]
    top_ids: int = 0

    @property
    def start(self) -> int:
        return self.rows[0].slot

    @property
    def end(self) -> int:
        return self.rows[-1].slot + 1

    @property
    def tail(self) -> bool:
        """Some row's last slots wait for a round's forward."""
        return any(r.upto < r.cached for r in self.rows)

    def counts(self, name: str) -> np.ndarray:
        """[rows] host: one of the rows' counts (`done`, `upto`, `cached`, `reused`)."""
        return np.array([getattr(r, name) for r in self.rows], dtype=np.int64)


class Prefiller:
    """Prefills of one model's cache rows (`runner`) from a batch's token buffer `seq` [rows, max_len], taking what
    its prefix store holds (None: no prefix caching), in forwards of at most `chunk` tokens (None: one forward)."""

    def __init__(self, runner, seq: torch.Tensor, store: PrefixStore | None, chunk: int | None):
        self.runner, self.seq, self.store, self.chunk = runner, seq, store, chunk
        self.max_len = seq.shape[1]

    def plan(self, start: int, tokens: Sequence[Sequence[int]], prompts: Sequence[int], cached: np.ndarray,
             have: np.ndarray | None = None, top_ids: int = 0, tail: bool = False) -> PrefillPlan:
        """The prefill of rows start.. holding `tokens` (prompts: how many of each are the prompt), whose caches are
        to hold `cached` slots and hold `have` already (None: none). With `tail` (no `top_ids`), the last `chunk`
        tokens of all the rows (an even share each; None: all) are left to a round's forward. Host only."""
        rows = []
        for i, row in enumerate(tokens):
            slot, want, held = start + i, int(cached[i]), 0 if have is None else int(have[i])
            keys = [] if self.store is None else self.store.match(row, want, top_ids)
            reused = len(keys) * self.store.block if keys else 0
            if reused <= held:
                keys, reused = [], 0
            done = max(held, reused, self.runner.cache.held_slots(slot))  # shared since it joined: never written
            rows.append(RowPrefill(slot, row, int(prompts[i]), want, keys, reused, done, want))
        if tail and not top_ids:
            share = None if self.chunk is None else self.chunk // len(rows)  # the tail's tokens per row
            for r in rows:
                r.upto = r.done if share is None else max(r.done, r.cached - share)
        return PrefillPlan(rows, top_ids)

    def run(self, plan: PrefillPlan) -> np.ndarray | None:
        """Load the store's blocks, compute the rest up to each row's `upto`, and (without a tail) store the prompts'
        blocks; returns, with `top_ids`, the model's most likely ids at every cached position [rows, t, top_ids] on
        the host, the stored blocks' and the computed ones (read back once)."""
        top = plan.top_ids
        ids = np.zeros((len(plan.rows), int(plan.counts("cached").max()), top), dtype=np.int64) if top else None
        for i, r in enumerate(plan.rows):
            if r.keys:
                self.store.load(self.runner.cache, r.slot, r.keys)
                if top:
                    ids[i, : r.reused] = self.store.top_ids(r.keys, top)
        done = plan.counts("done")
        computed = self.forwards(plan.start, done, plan.counts("upto"), top)
        if computed is not None:  # row i's computed ids begin at its position done[i]
            computed = computed.cpu().numpy()
            for i, r in enumerate(plan.rows):
                ids[i, r.done : r.cached] = computed[i, : r.cached - r.done]
        if not plan.tail:
            self.keep(plan, ids)
        return ids

    def finish(self, plan: PrefillPlan) -> None:
        """A plan's tail in a forward of its own (a round that cannot take it), then the store."""
        self.forwards(plan.start, plan.counts("upto"), plan.counts("cached"))
        self.keep(plan)

    def keep(self, plan: PrefillPlan, ids: np.ndarray | None = None) -> None:
        """The prefix store takes the blocks of the plan's prompts, cached now (with `ids`: their top ids)."""
        if self.store is None:
            return
        for i, r in enumerate(plan.rows):
            self.store.store(self.runner.cache, r.slot, r.tokens, min(r.cached, r.prompt - 1),
                             None if ids is None else ids[i])

    def forwards(self, start: int, done: np.ndarray, upto: np.ndarray, top_ids: int = 0) -> torch.Tensor | None:
        """Cache positions done[i]..upto[i]-1 of rows start + i, in forwards of at most `chunk` tokens (rows x
        columns, the columns of a forward being the same for its rows: a whole prompt's tokens when the chunk
        allows); returns the top ids at those positions [rows, max(upto - done), top_ids] (with `top_ids`; row i's
        from position done[i])."""
        n, t = len(done), int((upto - done).max(initial=0))
        if t <= 0:
            return None
        device = self.seq.device
        chunk = self.chunk or n * t
        group = min(n, chunk)  # rows per forward
        width = max(1, chunk // group)  # tokens per row per forward
        parts = []
        for a in range(0, n, group):
            b = min(n, a + group)
            lo, hi = start + a, start + b
            left = upto[a:b] - done[a:b]
            most = int(left.max())
            cols = []
            for c in range(0, most, width):
                w = min(width, most - c)
                offsets = done[a:b] + c
                lengths = to_device(np.clip(left - c, 0, w), device) if top_ids else None
                if offsets.any():
                    at = np.minimum(offsets[:, None] + np.arange(w), self.max_len - 1)
                    cols.append(self.runner.prefill(self.seq[lo:hi].gather(1, to_device(at, device)), lo, hi, top_ids,
                                                    lengths, offsets=offsets))
                else:  # fresh rows from position 0
                    cols.append(self.runner.prefill(self.seq[lo:hi, :w], lo, hi, top_ids, lengths))
            if top_ids:
                ids = torch.cat(cols, dim=1)
                parts.append(torch.nn.functional.pad(ids, (0, 0, 0, t - ids.shape[1])))
        return torch.cat(parts) if top_ids else None
