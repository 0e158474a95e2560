"""A batch's rows as slots: every row's state, kept aligned with its row.

A batch's rows live in slots [0, capacity); the active ones are [0, n). What every part of the engine reads of a
row lives here from the start: its tokens on the device (`seq`), its length (`lens`, host: the host knows it, so no
forward reads it back; `lens_dev`: the device's, ahead by a round in flight), its tokens as a host list (`history`:
prompt lookup and stop checks read it) and its prompt's length (`prompt_lens`). Whatever else belongs to a row (its
sampling settings, its rows of each model's KV cache, a proposer's n-gram pool, a policy's estimate of it, its
output format's matcher) a part registers once (`add`, `add_host`, `add_objects`, `add_cache`). A finished row
leaves by swap-remove (the last active row moves into its slot: `move`), a sample of a prompt already admitted
starts as a copy of the row holding it (`copy`), and new rows start at each entry's fill value (`admit`).
Proposers, policies and output formats see a batch as its `Slots`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ..config import SamplingParams
from ..spec.sampling import Rows


class Slots:
    """Per-row state of a batch of `capacity` rows of up to `max_len` tokens on `device`: device tensors (`add`),
    host arrays (`add_host`: what the host learns from each round's one read-back), Python objects (`add_objects`)
    and the rows of KV caches (`add_cache`)."""

    def __init__(self, capacity: int, max_len: int, device: torch.device):
        self.capacity = capacity
        self.max_len = max_len
        self.device = torch.device(device)
        self._values: dict[str, tuple[torch.Tensor | np.ndarray, object]] = {}  # name -> (per-row values, fill)
        self._objects: dict[str, tuple[list, Callable[[object, object], object]]] = {}  # name -> (objects, copy)
        self._caches: list[tuple[object, np.ndarray]] = []  # (a KV cache, each row's length in it)
        self.seq = self.add("tokens", trailing=(max_len,))  # [capacity, max_len] prompt + emitted
        self.lens = self.add_host("seq_len")  # tokens per row (prompt + emitted), as the host has counted them
        # the same on the device, where each round's acceptance advances them at once: the host's lens plus what the
        # round in flight added (`in_flight`: at most that many tokens a row; `in_flight_drafted`: it drafted)
        self.lens_dev = self.add("seq_len_dev")
        self.in_flight, self.in_flight_drafted = 0, False
        self.ends_dev = self.add("seq_end_dev")  # the length at which a row has its max_new_tokens (device)
        self.prompt_lens = self.add_host("prompt_len")  # of them, the prompt's
        # prompt + emitted on the host (a copy keeps its own list: samples of one prompt grow apart)
        self.history: list[list[int] | None] = self.add_objects("history", lambda src, dst: dst)
        self._reach, self._range = 0, None  # `span`'s kept range: [-reach, reach)

    def span(self, lo: int, hi: int) -> torch.Tensor:
        """torch.arange(lo, hi) on the device as a view of one range kept from round to round (read it, never write
        it): a round's index arithmetic launches no arange."""
        if max(-lo, hi) > self._reach:
            self._reach = 1 << max(6, max(-lo, hi) - 1).bit_length()
            self._range = torch.arange(-self._reach, self._reach, device=self.device)
        return self._range[lo + self._reach: hi + self._reach]

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
            if copy is None:
                cache.copy_row(src, dst, int(length[src]))
            else:  # a round in flight may have written a few slots past the host's count (junk past it is masked)
                cache.move_row(src, dst, int(length[src]) + (self.in_flight + 2 if self.in_flight else 0))
        for values, _ in self._values.values():
            values[dst] = values[src]
        for objects, copy_object in self._objects.values():
            objects[dst] = (copy or copy_object)(objects[src], objects[dst])


class RowSettings:
    """Each row's sampling settings, in the batch's slots; `view(n)` gives those of rows [0, n) as `Rows`."""

    def __init__(self, slots: Slots):
        self.temperature = slots.add("sp_temperature", torch.float32, 1.0)
        self.top_k = slots.add("sp_top_k")
        self.top_p = slots.add("sp_top_p", torch.float32, 1.0)
        self.greedy_rows = slots.add("sp_greedy", torch.bool, True)
        self.host = {name: slots.add_host(f"sp_{name}_host", dtype, fill) for name, dtype, fill in
                     (("greedy", bool, True), ("top_k", np.int64, 0), ("top_p", np.float64, 1.0),
                      ("max_new", np.int64, 0))}

    def set(self, slot: int, sp: SamplingParams) -> None:
        self.temperature[slot] = 1.0 if sp.greedy else sp.temperature
        self.top_k[slot] = 0 if sp.greedy else sp.top_k
        self.top_p[slot] = 1.0 if sp.greedy else sp.top_p
        self.greedy_rows[slot] = sp.greedy
        self.host["greedy"][slot] = sp.greedy
        self.host["top_k"][slot] = 0 if sp.greedy else sp.top_k
        self.host["top_p"][slot] = 1.0 if sp.greedy else sp.top_p
        self.host["max_new"][slot] = sp.max_new_tokens

    def view(self, n: int) -> Rows:
        g = self.host["greedy"][:n]
        return Rows(self.temperature[:n], self.top_k[:n], self.top_p[:n], self.greedy_rows[:n], bool(g.all()),
                    bool(g.any()), bool((self.host["top_k"][:n] > 0).any()), bool((self.host["top_p"][:n] < 1).any()))
