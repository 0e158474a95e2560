"""The state of a batch's active rows, and moving host arrays to the device without waiting.

Rows [0, n) are active: their tokens live in one device buffer (`seq`), their lengths on the host
(`lens`: the host knows them, so no forward reads them back), their per-row records in `rows`. A
finished row leaves by swap-remove (`move_row`): the last active row moves into its slot, with its
cache rows, its proposer state and everything registered in `slots`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from .config import SampleResult, SamplingParams
from .sampling import RowSettings
from .slots import Slots

if TYPE_CHECKING:
    from .grammar import Constraints
    from .prefix import Prefixes
    from .proposers.base import Proposer
    from .runner import ModelRunner
    from .tp import TPRunner


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


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on the device without waiting for it: a pinned staging copy, sent asynchronously."""
    t = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.clone()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Batch:
    """The active rows [0, n): token buffer, lengths (on the host), per-row records and settings."""

    proposer: Proposer  # set by the engine once the batch exists (a proposer keeps per-row state of it)
    constraints: Constraints | None = None  # the rows' output formats, when some row may have one
    noise: torch.Tensor | None = None  # coupled sampling: this round's Gumbel noise [n, width, vocab] by position
    prefixes: Prefixes | None = None  # the engine's prefix stores (specdec/prefix.py), when prefix caching is on

    def __init__(self, target: ModelRunner | TPRunner, capacity: int, max_len: int, vocab_size: int,
                 sampling: SamplingParams):
        self.target = target
        self.device = target.device
        self.vocab_size = vocab_size  # the target's: logits past it are dropped, draft distributions padded to it
        self.capacity = capacity
        self.max_len = max_len
        self.seq = torch.zeros((capacity, max_len), dtype=torch.int64, device=self.device)
        self.slots = Slots(capacity, self.device)
        self.lens = self.slots.add_host("seq_len")  # tokens per row (prompt + emitted), known on the host
        self.cached = self.slots.add_host("target_len")  # of them in the target's cache: lens - 1 but after jump-forward
        self.sp = RowSettings(self.slots, sampling)  # each row's sampling settings (`sp.view(n)`)
        self.rows: list[Row | None] = [None] * capacity
        self.n = 0

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        return to_device(array, self.device)

    def write_rows(self, start: int, rows: list[Row]) -> None:
        """Rows [start, start + len(rows)) are new and hold these rows' tokens (one copy to the device)."""
        end, t = start + len(rows), max(len(r.tokens) for r in rows)
        self.slots.admit(start, end)
        tokens = np.zeros((len(rows), t), dtype=np.int64)
        for i, (slot, row) in enumerate(zip(range(start, end), rows)):
            tokens[i, : len(row.tokens)] = row.tokens
            self.rows[slot] = row
            self.sp.set(slot, row.sp)
        self.seq[start:end, :t] = self.to_device(tokens)
        self.lens[start:end] = [len(r.tokens) for r in rows]

    def prefill(self, runner: ModelRunner, start: int, end: int, model: str = "draft") -> np.ndarray:
        """Cache all but the pending token of rows [start, end), taking what `model`'s prefix store holds of them
        (specdec/prefix.py); returns their cached lengths."""
        self._prefill(runner, start, end, model)
        return self.lens[start:end] - 1

    def prefill_target(self, start: int, end: int, top: int = 0) -> tuple[np.ndarray | None, np.ndarray]:
        """The target's prefill of rows [start, end): with `top` > 0, its top ids at every cached position
        [rows, t, top] on the host (read back once per admission, not per round; computed at every position, no
        stored prefix taken); and each row's prompt tokens taken from the prefix store [rows]."""
        reused, ids = self._prefill(self.target, start, end, "target", top)
        self.cached[start:end] = self.lens[start:end] - 1
        if top and ids is None:
            ids = torch.zeros((end - start, 0, top), dtype=torch.int64)
        return (None if ids is None else ids.cpu().numpy()), reused

    def _prefill(self, runner, start: int, end: int, model: str, top: int = 0) -> tuple[np.ndarray, torch.Tensor | None]:
        """Prefill rows [start, end) after the slots the prefix store of `model` gives them, then store their
        blocks; returns the tokens each took from the store, and the top ids (with `top`)."""
        cached = self.lens[start:end] - 1
        store = None if top or self.prefixes is None else self.prefixes[model]
        reused = np.zeros(end - start, dtype=np.int64)
        if store is not None:
            for i, slot in enumerate(range(start, end)):
                reused[i] = store.load(runner.cache.k, runner.cache.v, slot,
                                       store.match(self.rows[slot].tokens, int(cached[i])))
        t = int((cached - reused).max(initial=0))
        ids = None
        if t > 0 and reused.any():
            cols = np.minimum(reused[:, None] + np.arange(t), self.max_len - 1)
            runner.prefill(self.seq[start:end].gather(1, self.to_device(cols)), start, end, offsets=reused)
        elif t > 0:
            lengths = self.to_device(cached) if top else None
            ids = runner.prefill(self.seq[start:end, :t], start, end, top, lengths)
        if store is not None:
            for i, slot in enumerate(range(start, end)):
                store.store(runner.cache.k, runner.cache.v, slot, self.rows[slot].tokens, int(cached[i]))
        return reused, ids

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

    def copy_row(self, src: int, dst: int) -> None:
        """Row dst, just admitted with row src's prompt, takes src's caches instead of a prefill of its own."""
        self.target.cache.move_row(src, dst, int(self.cached[src]))
        self.proposer.copy_row(src, dst)
        self.slots.move(src, dst)

    def move_row(self, src: int, dst: int) -> None:
        if src == dst:
            return
        length = int(self.lens[src])
        self.target.cache.move_row(src, dst, length)
        self.proposer.move_row(src, dst)
        self.seq[dst, :length] = self.seq[src, :length]
        self.slots.move(src, dst)
        if self.constraints is not None:
            self.constraints.move(src, dst)
        self.rows[dst] = self.rows[src]
