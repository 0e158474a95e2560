"""A batch's active rows, their records, and what the target reads of them in a round.

Rows [0, n) are active. Their state lives in the batch's `Slots` (specdec/sched/slots.py): tokens, lengths, and
whatever each part registered there; their records (`Row`) and sampling settings too. A batch is built whole, once
its parts exist: the target's runner and its `Prefiller`, the proposer, the rows' output formats. Rows join by a
prefill (`prefill_target`); a prefill that leaves its rows' last prompt tokens to the next round's forward returns
its plan, which that round takes as an argument (`target_inputs`, `end_prefill`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..config import SampleResult, SamplingParams
from ..exec.inputs import Join, TargetInputs, to_device
from ..exec.prefill import PrefillPlan, Prefiller
from ..spec import trees
from .slots import RowSettings, Slots

if TYPE_CHECKING:
    from ..exec.runner import ModelRunner
    from ..exec.tp import TPRunner
    from ..spec.draft import Draft
    from ..spec.grammar import Constraints
    from ..spec.proposers.base import Proposer
    from ..spec.verify import Verdict


@dataclass
class Row:
    index: int  # position in the caller's prompt list
    result: SampleResult
    tokens: list[int]  # prompt + emitted so far (host copy, for prompt lookup and stop checks)
    generator: torch.Generator | None
    t0: float
    sp: SamplingParams  # this row's settings (the engine's, or the row's own)

    @property
    def done(self) -> bool:
        """Failed, stopped, or at max_new_tokens: the row leaves the batch."""
        r = self.result
        return r.finish_reason in ("stop", "error") or r.generated_tokens >= self.sp.max_new_tokens


class Batch:
    """The active rows [0, n) of `slots`: their records and settings, the target's cache rows, and the proposer
    and output formats (`constraints`, when some row may have one) that keep state of them. `slack`: slots a row
    may hold past its prompt and max_new_tokens (the draft's; None: a whole row)."""

    def __init__(self, slots: Slots, target: ModelRunner | TPRunner, prefill: Prefiller, proposer: Proposer,
                 vocab_size: int, slack: int | None = None, constraints: Constraints | None = None):
        self.slots, self.target, self.prefill, self.proposer = slots, target, prefill, proposer
        self.device = slots.device
        self.vocab_size = vocab_size  # the target's: logits past it are dropped, draft distributions padded to it
        self.capacity, self.max_len = slots.capacity, slots.max_len
        self.slack, self.constraints = slack, constraints
        self.seq, self.lens = slots.seq, slots.lens
        self.cached = slots.add_host("target_len")  # of lens in the target's cache: lens - 1 but after jump-forward
        slots.add_cache(target.cache, self.cached)
        self.sp = RowSettings(slots)  # each row's sampling settings (`sp.view(n)`)
        self.rows: list[Row | None] = slots.add_objects("row", lambda src, dst: dst)  # a copy keeps its own
        self.n = 0

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        return to_device(array, self.device)

    def write_rows(self, start: int, rows: list[Row]) -> None:
        """Rows [start, start + len(rows)) are new, active, and hold these rows' tokens (one copy to the device)."""
        end, t = start + len(rows), max(len(r.tokens) for r in rows)
        self.slots.admit(start, end, [self.row_slots(len(r.tokens), r.sp.max_new_tokens) for r in rows],
                         [r.tokens for r in rows])
        tokens = np.zeros((len(rows), t), dtype=np.int64)
        for i, (slot, row) in enumerate(zip(range(start, end), rows)):
            tokens[i, : len(row.tokens)] = row.tokens
            self.rows[slot] = row
            self.slots.history[slot] = row.tokens
            self.sp.set(slot, row.sp)
        self.seq[start:end, :t] = self.to_device(tokens)
        self.lens[start:end] = self.slots.prompt_lens[start:end] = [len(r.tokens) for r in rows]
        lens = self.lens[start:end]
        self.slots.lens_dev[start:end], self.slots.ends_dev[start:end] = self.to_device(
            np.stack([lens, lens + self.sp.host["max_new"][start:end]]))  # one copy
        self.n = end

    def row_slots(self, prompt: int, max_new: int) -> int:
        """Cache slots a row of a `prompt`-token prompt and `max_new` new tokens may come to hold."""
        return self.max_len if self.slack is None else min(self.max_len, prompt + max_new + self.slack)

    def room(self, rows: list[tuple[list[int], int]]) -> int:
        """How many of these rows ((prompt, max_new_tokens), in order) the caches have room for now, within the
        batch's free rows."""
        rows = rows[: self.capacity - self.n]
        return self.slots.room([self.row_slots(len(p), m) for p, m in rows], [p for p, _ in rows])

    def prefill_target(self, start: int, end: int, top_ids: int = 0, tail: bool = False) -> tuple[
            np.ndarray | None, PrefillPlan]:
        """The target's prefill of rows [start, end) (specdec/exec/prefill.py): with `top_ids` > 0, its most likely
        ids at every cached position [rows, t, top_ids] on the host (read back once per admission, not per round; a
        stored prefix gives its own); and its plan (each row's prompt tokens taken from the prefix store: `reused`).
        `tail` (no `top_ids`): the last `prefill_chunk` tokens of the prompts are left to the next round's forward,
        which takes the plan (`PrefillPlan.tail`)."""
        s = self.slots
        plan = self.prefill.plan(start, s.history[start:end], s.prompt_lens[start:end], self.lens[start:end] - 1,
                                 top_ids=top_ids, tail=tail)
        ids = self.prefill.run(plan)
        self.cached[start:end] = self.lens[start:end] - 1
        return ids, plan

    def append(self, tokens: dict[int, list[int]]) -> None:
        """Rows (by slot) emitted these tokens outside a round (jump-forward): one copy to the device."""
        if not tokens:
            return
        rows = np.concatenate([np.full(len(t), slot) for slot, t in tokens.items()])
        cols = np.concatenate([self.lens[slot] + np.arange(len(t)) for slot, t in tokens.items()])
        values = np.concatenate([np.asarray(t, dtype=np.int64) for t in tokens.values()])
        at = self.to_device(np.stack([rows, cols.clip(max=self.max_len - 1), values]))
        self.seq[at[0], at[1]] = at[2]
        for slot, t in tokens.items():
            self.lens[slot] += len(t)
        self.slots.lens_dev.index_add_(0, at[0], torch.ones_like(at[0]))

    def target_inputs(self, n: int, draft: Draft, width: int, joining: PrefillPlan | None = None) -> TargetInputs:
        """The target's inputs for verifying `draft` over rows [0, n): a chain padded to `width` >= k + 1 tokens
        per row, or a token tree (node j at slot base + j, position base + its depth, seeing its ancestors). Rows
        ending their prefill in this round (`joining`: rows [start, n), chains) come as a `Join` beside the others'
        chains, for the same forward."""
        if joining is not None and draft.tree is not None:
            self.prefill.finish(joining)  # a tree's forward reads the joining rows as others
            joining = None
        lens = self.lens[:n].copy()
        base = self.slots.lens_dev[:n] - 1  # the device's: a round in flight may have grown them
        if joining is not None:  # the rows before the joining ones verify as a chain; those, beside them
            j = joining.start
            inputs = self._chain(lens[:j], base[:j], self.cached[:j], draft.tokens[:j], width)
            return replace(inputs, lens=lens, base=base, join=self._join(lens, draft.tokens[j:], width, joining))
        if draft.tree is None:
            return self._chain(lens, base, self.cached[:n], draft.tokens, width)
        lag, tokens = self._unread(lens, base, self.cached[:n], draft.tokens)
        kv_len = int(lens.max()) - 1 + width + self.slots.in_flight
        t = draft.tree
        positions, slots, mask = trees.tree_inputs(t.parent, t.depth, base, kv_len, t.max_depth, lag - 1)
        return TargetInputs(tokens, positions, kv_len, lag, lens, base, slots, mask)

    def _chain(self, lens: np.ndarray, base: torch.Tensor, cached: np.ndarray, draft: torch.Tensor,
               width: int) -> TargetInputs:
        """Rows [0, len(lens)) verifying chains `draft` [rows, k] at `width` tokens, after the `lag` tokens the
        rows with the most not cached yet lack."""
        lag, tokens = self._unread(lens, base, cached, draft)
        positions = (base[:, None] + self.slots.span(1 - lag, width)[None, :]).clamp(min=0)
        kv_len = int(lens.max(initial=1)) - 1 + width + self.slots.in_flight  # past every row's, in flight or not
        junk = width - draft.shape[1] - 1
        return TargetInputs(torch.nn.functional.pad(tokens, (0, junk)) if junk else tokens, positions, kv_len, lag,
                            lens, base)

    def _unread(self, lens: np.ndarray, base: torch.Tensor, cached: np.ndarray,
                draft: torch.Tensor) -> tuple[int, torch.Tensor]:
        """(lag, tokens [rows, lag + k]): each of rows [0, len(lens)) reads the `lag` tokens up to its pending one
        (the most any of them lacks in its cache), then its draft [rows, k]."""
        lag = int((lens - cached).max(initial=1))
        behind = (base[:, None] + self.slots.span(1 - lag, 1)[None, :]).clamp(min=0)  # [n, lag]
        unread = self.seq[: len(lens)].gather(1, behind)
        return lag, torch.cat([unread, draft], dim=1) if draft.shape[1] else unread

    def _join(self, lens: np.ndarray, draft: torch.Tensor, width: int, joining: PrefillPlan) -> Join:
        """The joining rows' part of a round's forward: each row's prompt after the `upto` slots its cache holds,
        its pending token and its draft [m, k], padded to the longest; the logits wanted at the pending token and
        the draft."""
        k, held = draft.shape[1], joining.counts("upto")
        lens = lens[joining.start: joining.end]
        first = lens - held  # columns before the draft: the prompt's rest and the pending token
        t = int(first.max()) + width - 1
        cols = held[:, None] + np.arange(t)
        tokens = self.seq[joining.start: joining.end].gather(1, self.to_device(np.minimum(cols, self.max_len - 1)))
        at = self.to_device(first - 1)[:, None] + self.slots.span(0, k + 1)[None, :]  # [m, k + 1]
        tokens.scatter_(1, at[:, 1:], draft)
        return Join(tokens, self.to_device(cols), int(lens.max()) - 1 + width, joining.start, at)

    def accept(self, n: int, inputs: TargetInputs, verdict: Verdict, draft: Draft) -> torch.Tensor:
        """Rows [0, n) take their accepted tokens and the rule's next token into `seq` (a tree's accepted path's
        keys and values moved into place first); returns them, [n, w]: x_1..x_a, y (stale past a + 1)."""
        base, new = inputs.base, draft.tokens
        if verdict.path is not None:
            ar = self.slots.span(1, verdict.path.shape[1] + 1)[None, :]
            self.target.cache.move_slots(base[:, None] + verdict.path, base[:, None] + ar)
            new = draft.tokens.gather(1, (verdict.path - 1).clamp(min=0))
        if new.shape[1]:  # y after the accepted tokens (and at the end: a chain that passed whole ends in it)
            new = torch.cat([new, verdict.next_token[:, None]], dim=1)
            new.scatter_(1, verdict.accepted[:, None], verdict.next_token[:, None])
        else:
            new = verdict.next_token[:, None]
        write = (base[:, None] + self.slots.span(1, new.shape[1] + 1)[None, :]).clamp(max=self.max_len - 1)
        self.seq[:n].scatter_(1, write, new)
        self.slots.lens_dev[:n].add_(verdict.accepted + 1)
        return new

    def grow(self, n: int, lens: np.ndarray, accepted: np.ndarray) -> None:
        """Rows [0, n), `lens` long before the round, accepted `accepted` drafted tokens and one more (the host's
        count, once the round is read back; the device's advanced in `accept`)."""
        self.lens[:n] = lens + accepted + 1
        self.cached[:n] = self.lens[:n] - 1

    def rewind(self, n: int, length: int) -> None:
        """Rows [0, n) cut back to `length` tokens (synthetic rows, start-up profile): their caches forget what
        lies past it."""
        self.lens[:n] = length
        self.slots.lens_dev[:n] = length
        self.cached[:n] = length - 1
        self.proposer.rewind(n)

    def copy_row(self, src: int, dst: int) -> None:
        """Row dst, just admitted with row src's prompt, takes src's caches instead of a prefill of its own."""
        self.slots.copy(src, dst)

    def remove(self, slot: int) -> Row:
        """Row `slot` leaves (swap-remove: the last active row moves into its place); returns its record."""
        row, last = self.rows[slot], self.n - 1
        self.slots.move(last, slot)
        self.rows[last] = None
        self.n = last
        return row
