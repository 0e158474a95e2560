"""Per-row state of a batch, kept aligned with its rows.

Rows [0, n) of a batch are active; a finished row leaves by swap-remove (the last active row moves
into its slot). Whatever belongs to a row (its length, its sampling settings, a policy's estimate of
it) is registered here once, as a device tensor (`add`) or a host array (`add_host`: what the host
learns from each round's one read-back), and `move` keeps all of it aligned; `admit` resets new rows
to each entry's fill value.
"""

from __future__ import annotations

import numpy as np
import torch


class Slots:
    def __init__(self, capacity: int, device):
        self.capacity = capacity
        self.device = device
        self._tensors: dict[str, tuple[torch.Tensor, object]] = {}
        self._arrays: dict[str, tuple[np.ndarray, object]] = {}

    def add(self, name: str, dtype=torch.int64, fill=0, trailing: tuple[int, ...] = ()) -> torch.Tensor:
        t = torch.full((self.capacity, *trailing), fill, dtype=dtype, device=self.device)
        self._tensors[name] = (t, fill)
        return t

    def add_host(self, name: str, dtype=np.int64, fill=0) -> np.ndarray:
        a = np.full(self.capacity, fill, dtype=dtype)
        self._arrays[name] = (a, fill)
        return a

    def __getitem__(self, name: str):
        return self._tensors[name][0] if name in self._tensors else self._arrays[name][0]

    def _all(self):
        return (*self._tensors.values(), *self._arrays.values())

    def admit(self, start: int, end: int) -> None:
        """Rows [start, end) are new: every entry starts at its fill value."""
        for t, fill in self._all():
            t[start:end] = fill

    def move(self, src: int, dst: int) -> None:
        if src != dst:
            for t, _ in self._all():
                t[dst] = t[src]
