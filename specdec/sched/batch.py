"""A batch's active rows, everything that belongs to each of them, and what the target reads of them in a round.

Rows [0, n) are active: their tokens live in one device buffer (`seq`), their lengths on the host (`lens`: the
host knows them, so no forward reads them back), their records in `rows`. Whatever else belongs to a row (its
sampling settings, its rows of each model's KV cache, a proposer's n-gram pool, a policy's estimate of it, its
output format's matcher) is registered once in the batch's `Slots`, which keeps it with its row: a finished row
leaves by swap-remove (the last active row moves into its slot, `move_row`), a sample of a prompt already
admitted starts as a copy of the row holding it (`copy_row`), and new rows start at each entry's fill value.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..spec import trees
from ..config import SampleResult, SamplingParams
from ..spec.sampling import Rows

if TYPE_CHECKING:
    from ..spec.grammar import Constraints
    from ..exec.prefix import Prefixes
    from ..spec.proposers.base import Draft, Proposer
    from ..exec.runner import ModelRunner
    from ..exec.tp import TPRunner
    from ..spec.verify import Verdict


class Slots:
    """Per-row state of a batch, kept aligned with its rows: device tensors (`add`), host arrays (`add_host`:
    what the host learns from each round's one read-back), Python objects (`add_objects`) and the rows of KV
    caches (`add_cache`)."""

    def __init__(self, capacity: int, device):
        self.capacity = capacity
        self.device = device
        self._values: dict[str, tuple[torch.Tensor | np.ndarray, object]] = {}  # name -> (per-row values, fill)
        self._objects: dict[str, tuple[list, Callable[[object, object], object]]] = {}  # name -> (objects, copy)
        self._caches: list[tuple[object, np.ndarray]] = []  # (a KV cache, each row's length in it)

    def add(self, name: str, dtype=torch.int64, fill=0, trailing: tuple[int, ...] = ()) -> torch.Tensor:
        t = torch.full((self.capacity, *trailing), fill, dtype=dtype, device=self.device)
        self._register(self._values, name, (t, fill))
        return t

    def add_host(self, name: str, dtype=np.int64, fill=0) -> np.ndarray:
        a = np.full(self.capacity, fill, dtype=dtype)
        self._register(self._values, name, (a, fill))
        return a

    def add_objects(self, name: str, copy: Callable[[object, object], object] = lambda src, dst: src) -> list:
        """Per-row objects (None for a new row); a copied row takes copy(the source's, its own)."""
        objects: list = [None] * self.capacity
        self._register(self._objects, name, (objects, copy))
        return objects

    @staticmethod
    def _register(entries: dict, name: str, entry) -> None:
        if name in entries:
            raise ValueError(f"per-row state {name!r} is registered twice")
        entries[name] = entry

    def add_cache(self, cache, length: np.ndarray) -> None:
        """A KV cache's rows (`move_row(src, dst, slots)`): a row moves with its first length[row] slots. Its rows
        start free (what an earlier batch left, e.g. after a failure, is released)."""
        for row in range(self.capacity):
            cache.release(row)
        self._caches.append((cache, length))

    def admit(self, start: int, end: int, slots: list[int] | None = None,
              prompts: list[list[int]] | None = None) -> None:
        """Rows [start, end) are new: every entry starts at its fill value, and each row reserves `slots[i]` slots
        of every cache (None: its whole row), sharing what a cache's prefix store holds of `prompts[i]`."""
        for values, fill in self._values.values():
            values[start:end] = fill
        for objects, _ in self._objects.values():
            objects[start:end] = [None] * (end - start)
        for cache, _ in self._caches:
            cache.reserve_rows(list(range(start, end)), [cache.max_len] * (end - start) if slots is None else slots,
                               prompts)

    def room(self, slots: list[int], prompts: list[list[int]] | None = None) -> int:
        """How many rows of `slots` slots each (in this order; `prompts`: their tokens) every cache has room for
        now."""
        fits = len(slots)
        prompts = prompts or [None] * len(slots)
        for cache, _ in self._caches:
            free = cache.free_slots()
            if free is None:
                continue
            for i in range(fits):  # the rows in order, as long as they fit (no lookups past the first that does not)
                free -= cache.reservation(slots[i], prompts[i])
                if free < 0:
                    fits = i
                    break
        return fits

    def move(self, src: int, dst: int) -> None:
        """Row src now lives at dst (what row dst held is released)."""
        for cache, _ in self._caches:
            cache.release(dst)
        self._carry(src, dst, lambda a, b: a)

    def copy(self, src: int, dst: int) -> None:
        """Row dst starts as row src is now (a sample of the same prompt: its prefill shared)."""
        self._carry(src, dst, None)

    def _carry(self, src: int, dst: int, copy) -> None:
        if src == dst:
            return
        for cache, length in self._caches:
            (cache.copy_row if copy is None else cache.move_row)(src, dst, int(length[src]))
        for values, _ in self._values.values():
            values[dst] = values[src]
        for objects, copy_object in self._objects.values():
            objects[dst] = (copy or copy_object)(objects[src], objects[dst])


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


class RowSettings:
    """Each row's sampling settings, in the batch's slots; `view(n)` gives those of rows [0, n) as `Rows`."""

    def __init__(self, slots: Slots):
        self.temperature = slots.add("sp_temperature", torch.float32, 1.0)
        self.top_k = slots.add("sp_top_k")
        self.top_p = slots.add("sp_top_p", torch.float32, 1.0)
        self.greedy_rows = slots.add("sp_greedy", torch.bool, True)
        self.host = {name: slots.add_host(f"sp_{name}_host", dtype, fill) for name, dtype, fill in
                     (("greedy", bool, True), ("top_k", np.int64, 0), ("top_p", np.float64, 1.0))}

    def set(self, slot: int, sp: SamplingParams) -> None:
        self.temperature[slot] = 1.0 if sp.greedy else sp.temperature
        self.top_k[slot] = 0 if sp.greedy else sp.top_k
        self.top_p[slot] = 1.0 if sp.greedy else sp.top_p
        self.greedy_rows[slot] = sp.greedy
        self.host["greedy"][slot] = sp.greedy
        self.host["top_k"][slot] = 0 if sp.greedy else sp.top_k
        self.host["top_p"][slot] = 1.0 if sp.greedy else sp.top_p

    def view(self, n: int) -> Rows:
        g = self.host["greedy"][:n]
        return Rows(self.temperature[:n], self.top_k[:n], self.top_p[:n], self.greedy_rows[:n], bool(g.all()),
                    bool(g.any()), bool((self.host["top_k"][:n] > 0).any()), bool((self.host["top_p"][:n] < 1).any()))


@dataclass
class TargetInputs:
    """What the target reads in a round's forward: each row's `lag` tokens it has not read yet (the pending
    token, and those a grammar forced since), then the draft (a chain padded with junk to the round's width, or a
    token tree)."""

    tokens: torch.Tensor  # [n, lag + width - 1] (a tree's: [n, lag + T])
    positions: torch.Tensor  # [n, same]
    kv_len: int  # cache slots the forward attends over (host)
    lag: int  # host: the most tokens a row's target cache lacks (1 but after jump-forward)
    lens: np.ndarray  # [n] host: the rows' lengths before the round
    base: torch.Tensor  # [n] the pending token's slot
    slots: torch.Tensor | None = None  # [n, same] a tree's cache slots
    mask: torch.Tensor | None = None  # [n, 1, same, kv_len] a tree's attention mask
    join: Join | None = None  # rows [join.start, n) joining the batch, in the same forward (the fields above but
    # lens and base are then the rows before them)


@dataclass
class Joining:
    """Rows [start, end), just admitted, whose target caches hold `done` [rows] slots of their prompts (host): the
    next round's forward computes the rest with their drafts (`Batch.target_inputs`)."""

    start: int
    end: int
    done: np.ndarray


@dataclass
class Join:
    """Rows [start, start + m) joining the batch, in a round's forward (`ModelRunner.step_joined`): the last
    tokens of their prompts that their caches lack, then their pending token and draft, at `positions`; the
    forward attends over `kv_len` slots and gives their logits at columns `at` [m, w]."""

    tokens: torch.Tensor  # [m, T]
    positions: torch.Tensor  # [m, T]
    kv_len: int
    start: int
    at: torch.Tensor  # [m, w]


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

    proposer: Proposer  # set once the batch exists (a proposer keeps per-row state of it)
    constraints: Constraints | None = None  # the rows' output formats, when some row may have one
    prefixes: Prefixes | None = None  # the engine's prefix stores (specdec/exec/prefix.py), when prefix caching is on
    prefill_chunk: int | None = None  # most prompt tokens (rows x tokens) one prefill forward takes; None: all
    slack: int | None = None  # slots a row may hold past its prompt and max_new_tokens (the draft's); None: max_len
    joining: Joining | None = None  # rows whose prefill's tail waits for the next round's forward

    def __init__(self, target: ModelRunner | TPRunner, capacity: int, max_len: int, vocab_size: int):
        self.target = target
        self.device = target.device
        self.vocab_size = vocab_size  # the target's: logits past it are dropped, draft distributions padded to it
        self.capacity = capacity
        self.max_len = max_len
        self.slots = Slots(capacity, self.device)
        self.seq = self.slots.add("tokens", trailing=(max_len,))  # [capacity, max_len] prompt + emitted
        self.lens = self.slots.add_host("seq_len")  # tokens per row (prompt + emitted), known on the host
        self.cached = self.slots.add_host("target_len")  # of them in the target's cache: lens - 1 but after jump-forward
        self.slots.add_cache(target.cache, self.cached)
        self.sp = RowSettings(self.slots)  # each row's sampling settings (`sp.view(n)`)
        self.rows: list[Row | None] = self.slots.add_objects("row", lambda src, dst: dst)  # a copy keeps its own
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
            self.sp.set(slot, row.sp)
        self.seq[start:end, :t] = self.to_device(tokens)
        self.lens[start:end] = [len(r.tokens) for r in rows]
        self.n = end

    def row_slots(self, prompt: int, max_new: int) -> int:
        """Cache slots a row of a `prompt`-token prompt and `max_new` new tokens may come to hold."""
        return self.max_len if self.slack is None else min(self.max_len, prompt + max_new + self.slack)

    def room(self, rows: list[tuple[list[int], int]]) -> int:
        """How many of these rows ((prompt, max_new_tokens), in order) the caches have room for now, within the
        batch's free rows."""
        rows = rows[: self.capacity - self.n]
        return self.slots.room([self.row_slots(len(p), m) for p, m in rows], [p for p, _ in rows])

    def prefill(self, runner: ModelRunner, start: int, end: int, model: str = "draft",
                done: np.ndarray | None = None) -> np.ndarray:
        """Cache all but the pending token of rows [start, end) after the `done` slots each holds already (None:
        none), taking what `model`'s prefix store holds of them (specdec/exec/prefix.py); returns their cached lengths."""
        self._prefill(runner, start, end, model, done=done)
        return self.lens[start:end] - 1

    def prefill_target(self, start: int, end: int, top_ids: int = 0,
                       join: bool = False) -> tuple[np.ndarray | None, np.ndarray]:
        """The target's prefill of rows [start, end): with `top_ids` > 0, its most likely ids at every cached
        position [rows, t, top_ids] on the host (read back once per admission, not per round; a stored prefix
        gives its own); and each row's prompt tokens taken from the prefix store [rows]. `join` (rows at the end
        of the batch, no `top_ids`): the last `prefill_chunk` tokens of their prompts wait for the next round's
        forward (`joining`)."""
        reused, ids = self._prefill(self.target, start, end, "target", top_ids, join=join and not top_ids)
        self.cached[start:end] = self.lens[start:end] - 1
        return ids, reused

    def _prefill(self, runner, start: int, end: int, model: str, top_ids: int = 0,
                 done: np.ndarray | None = None, join: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
        """Prefill rows [start, end) after the `done` slots they hold or the longer run of blocks the prefix store
        of `model` gives them, then store their prompts' blocks; returns the tokens each took from the store, and
        with `top_ids` (and no `done`) the model's most likely ids at every cached position [rows, t, top_ids] on
        the host, the stored blocks' and the computed ones. `join`: the tail (at most `prefill_chunk` tokens of
        all the rows) is left to the next round's forward, which stores the blocks then."""
        cached = self.lens[start:end] - 1
        have = np.zeros(end - start, dtype=np.int64) if done is None else np.array(done, dtype=np.int64)
        store = None if self.prefixes is None else self.prefixes[model]
        reused = np.zeros(end - start, dtype=np.int64)
        ids = np.zeros((end - start, int(cached.max(initial=0)), top_ids), dtype=np.int64) if top_ids else None
        if store is not None:
            for i, slot in enumerate(range(start, end)):
                keys = store.match(self.rows[slot].tokens, int(cached[i]), top_ids)
                if len(keys) * store.block > have[i]:
                    reused[i] = store.load(runner.cache, slot, keys)
                    if top_ids:
                        ids[i, : reused[i]] = store.top_ids(keys, top_ids)
        held = [runner.cache.held_slots(slot) for slot in range(start, end)]  # shared since they joined: not written
        done = np.maximum(np.maximum(have, reused), held)
        if join:  # all but the tail now; the next round's forward reads the tail with the rows' drafts
            tail = None if self.prefill_chunk is None else self.prefill_chunk // (end - start)  # tokens per row
            upto = done if tail is None else np.maximum(done, cached - tail)
            self.forwards(runner, start, done, upto)
            self.joining = Joining(start, end, upto)
            return reused, None
        computed = self.forwards(runner, start, done, cached, top_ids)
        if computed is not None:  # row i's computed ids begin at its position done[i]
            computed = computed.cpu().numpy()
            for i in range(end - start):
                ids[i, done[i]: cached[i]] = computed[i, : cached[i] - done[i]]
        self._store(runner, start, end, model, ids)
        return reused, ids

    def _store(self, runner, start: int, end: int, model: str, ids: np.ndarray | None = None) -> None:
        """`model`'s prefix store takes the blocks of the prompts of rows [start, end), cached now (a row that
        catches up holds its output too)."""
        store = None if self.prefixes is None else self.prefixes[model]
        if store is not None:
            for i, slot in enumerate(range(start, end)):
                row = self.rows[slot]
                store.store(runner.cache, slot, row.tokens,
                            min(int(self.lens[slot]) - 1, row.result.prompt_tokens - 1),
                            None if ids is None else ids[i])

    def forwards(self, runner, start: int, done: np.ndarray, upto: np.ndarray,
                 top_ids: int = 0) -> torch.Tensor | None:
        """Cache positions done[i]..upto[i]-1 of rows start + i, in forwards of at most `prefill_chunk` tokens
        (rows x columns, the columns of a forward being the same for its rows: a whole prompt's tokens when the
        chunk allows); returns the top ids at those positions [rows, max(upto - done), top_ids] (with `top_ids`;
        row i's from position done[i])."""
        n, t = len(done), int((upto - done).max(initial=0))
        if t <= 0:
            return None
        chunk = self.prefill_chunk or n * t
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
                lengths = self.to_device(np.clip(left - c, 0, w)) if top_ids else None
                if offsets.any():
                    at = np.minimum(offsets[:, None] + np.arange(w), self.max_len - 1)
                    cols.append(runner.prefill(self.seq[lo:hi].gather(1, self.to_device(at)), lo, hi, top_ids,
                                               lengths, offsets=offsets))
                else:  # fresh rows from position 0
                    cols.append(runner.prefill(self.seq[lo:hi, :w], lo, hi, top_ids, lengths))
            if top_ids:
                ids = torch.cat(cols, dim=1)
                parts.append(torch.nn.functional.pad(ids, (0, 0, 0, t - ids.shape[1])))
        return torch.cat(parts) if top_ids else None

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

    def target_inputs(self, n: int, draft: Draft, width: int) -> TargetInputs:
        """The target's inputs for verifying `draft` over rows [0, n): a chain padded to `width` >= k + 1 tokens
        per row, or a token tree (node j at slot base + j, position base + its depth, seeing its ancestors). Rows
        joining the batch (`joining`, chains) come as a `Join` beside the others' chains, for the same forward."""
        if self.joining is not None and draft.tree is not None:
            self.settle()  # a tree's forward reads the joining rows as others
        lens = self.lens[:n].copy()
        base = self.to_device(lens) - 1
        if self.joining is not None:  # the rows before the joining ones verify as a chain; those, beside them
            j = self.joining.start
            inputs = self._chain(lens[:j], base[:j], self.cached[:j], draft.tokens[:j], width)
            return replace(inputs, lens=lens, base=base, join=self._join(lens, draft.tokens[j:], width))
        if draft.tree is None:
            return self._chain(lens, base, self.cached[:n], draft.tokens, width)
        lag, tokens = self._unread(lens, base, self.cached[:n], draft.tokens)
        kv_len = int(lens.max()) - 1 + width
        t = draft.tree
        positions, slots, mask = trees.tree_inputs(t.parent, t.depth, base, kv_len, t.max_depth, lag - 1)
        return TargetInputs(tokens, positions, kv_len, lag, lens, base, slots, mask)

    def _chain(self, lens: np.ndarray, base: torch.Tensor, cached: np.ndarray, draft: torch.Tensor,
               width: int) -> TargetInputs:
        """Rows [0, len(lens)) verifying chains `draft` [rows, k] at `width` tokens, after the `lag` tokens the
        rows with the most not cached yet lack."""
        lag, tokens = self._unread(lens, base, cached, draft)
        positions = (base[:, None] + torch.arange(1 - lag, width, device=self.device)[None, :]).clamp(min=0)
        kv_len = int(lens.max(initial=1)) - 1 + width
        return TargetInputs(torch.nn.functional.pad(tokens, (0, width - draft.shape[1] - 1)), positions, kv_len, lag,
                            lens, base)

    def _unread(self, lens: np.ndarray, base: torch.Tensor, cached: np.ndarray,
                draft: torch.Tensor) -> tuple[int, torch.Tensor]:
        """(lag, tokens [rows, lag + k]): each of rows [0, len(lens)) reads the `lag` tokens up to its pending one
        (the most any of them lacks in its cache), then its draft [rows, k]."""
        lag = int((lens - cached).max(initial=1))
        behind = (base[:, None] + torch.arange(1 - lag, 1, device=self.device)[None, :]).clamp(min=0)  # [n, lag]
        return lag, torch.cat([self.seq[: len(lens)].gather(1, behind), draft], dim=1)

    def _join(self, lens: np.ndarray, draft: torch.Tensor, width: int) -> Join:
        """The joining rows' part of a round's forward: each row's prompt after the `done` slots its cache holds,
        its pending token and its draft [m, k], padded to the longest; the logits wanted at the pending token and
        the draft."""
        j, dev, k = self.joining, self.device, draft.shape[1]
        lens = lens[j.start: j.end]
        first = lens - j.done  # columns before the draft: the prompt's rest and the pending token
        t = int(first.max()) + width - 1
        cols = j.done[:, None] + np.arange(t)
        tokens = self.seq[j.start: j.end].gather(1, self.to_device(np.minimum(cols, self.max_len - 1)))
        at = self.to_device(first - 1)[:, None] + torch.arange(k + 1, device=dev)[None, :]  # [m, k + 1]
        tokens.scatter_(1, at[:, 1:], draft)
        return Join(tokens, self.to_device(cols), int(lens.max()) - 1 + width, j.start, at)

    def joined(self) -> None:
        """The joining rows' round forward ran: their caches hold their prompts, which the prefix store takes."""
        j, self.joining = self.joining, None
        self._store(self.target, j.start, j.end, "target")

    def settle(self) -> None:
        """The joining rows' prefills end now, in a forward of their own."""
        j = self.joining
        self.forwards(self.target, j.start, j.done, self.cached[j.start: j.end])
        self.joined()

    def accept(self, n: int, inputs: TargetInputs, verdict: Verdict, draft: Draft) -> torch.Tensor:
        """Rows [0, n) take their accepted tokens and the rule's next token into `seq` (a tree's accepted path's
        keys and values moved into place first); returns them, [n, w]: x_1..x_a, y (stale past a + 1)."""
        dev, base = self.device, inputs.base
        new = draft.tokens
        if verdict.path is not None:
            ar = torch.arange(1, verdict.path.shape[1] + 1, device=dev)[None, :]
            self.target.cache.move_slots(base[:, None] + verdict.path, base[:, None] + ar)
            new = draft.tokens.gather(1, (verdict.path - 1).clamp(min=0))
        new = torch.cat([new, torch.zeros((n, 1), dtype=torch.int64, device=dev)], dim=1)
        new.scatter_(1, verdict.accepted[:, None], verdict.next_token[:, None])
        write = (base[:, None] + 1 + torch.arange(new.shape[1], device=dev)[None, :]).clamp(max=self.max_len - 1)
        self.seq[:n].scatter_(1, write, new)
        return new

    def grow(self, n: int, lens: np.ndarray, accepted: np.ndarray) -> None:
        """Rows [0, n), `lens` long before the round, accepted `accepted` drafted tokens and one more (host)."""
        self.lens[:n] = lens + accepted + 1
        self.cached[:n] = self.lens[:n] - 1

    def rewind(self, n: int, length: int) -> None:
        """Rows [0, n) cut back to `length` tokens (synthetic rows, start-up profile): their caches forget what
        lies past it."""
        self.lens[:n] = length
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
