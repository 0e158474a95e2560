"""What a target forward reads in a round: each row's tokens, positions and the slots it attends over
(`TargetInputs`), and the rows that end their prefill in the same forward (`Join`); how host arrays reach the
device (`to_device`) without the host waiting for them, and how a round's results come back without the host
waiting for them either (`Staging`: a persistent host buffer per round in flight, and device events)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch


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


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on the device without waiting for it: a pinned staging copy, sent asynchronously."""
    t = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.clone()


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA; nothing elsewhere)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Flight:
    """One round in flight: its results' host buffer (pinned on CUDA, kept from round to round and grown only when
    a round needs more) and the device events that mark its start, its verification's start and its end."""

    def __init__(self, device: torch.device, staging: Staging):
        self.device, self.cuda, self.staging = device, device.type == "cuda", staging
        self.marked: set[str] = set()  # the moments this round recorded
        self.buffer: torch.Tensor | None = None
        self.events = {m: torch.cuda.Event(enable_timing=True) for m in ("start", "verify", "end")} if self.cuda \
            else {}
        self.host: np.ndarray | None = None  # the last results sent (CPU: the tensor's own memory)
        self.number = 0  # which round of the process this is (the trace's)
        self.trace: Callable[[str, int], None] | None = None

    def mark(self, moment: str) -> None:
        """Record `moment` ("start", "verify") on the device's queue."""
        if self.cuda:
            self.events[moment].record(torch.cuda.current_stream(self.device))
            self.marked.add(moment)

    def send(self, packed: torch.Tensor) -> None:
        """Queue the copy of `packed` [n, c] (int64) to the host behind the round's device work, and its end event;
        the host goes on at once."""
        if self.trace is not None:
            self.trace("launch", self.number)
        if not self.cuda:
            self.host = packed.cpu().numpy()
            return
        size = packed.numel()
        if self.buffer is None or self.buffer.numel() < size:
            self.buffer = torch.empty(max(size, 2 * (0 if self.buffer is None else self.buffer.numel())),
                                      dtype=torch.int64, pin_memory=True)
        self.buffer[:size].view(packed.shape).copy_(packed, non_blocking=True)
        self.events["end"].record(torch.cuda.current_stream(self.device))
        self.host = self.buffer[:size].view(packed.shape).numpy()

    def wait(self) -> np.ndarray:
        """The results sent, on the host, once the device has written them (a copy: the buffer serves later
        rounds)."""
        if self.trace is not None:
            self.trace("wait", self.number)
        if self.cuda:
            self.events["end"].synchronize()
            self.staging.device_s += self.seconds()
        return self.host.copy()

    def seconds(self, since: str = "start") -> float | None:
        """Device seconds from `since` (or the first moment this round recorded) to its end, after `wait`; None
        off CUDA."""
        if not self.cuda:
            return None
        since = since if since in self.marked else min(self.marked, key=("start", "verify").index)
        return self.events[since].elapsed_time(self.events["end"]) / 1e3


class Staging:
    """The host's buffers for the rounds in flight: two, used in turn (a round's results are read while the next
    round's are being written), and the device's time on them (`device_s`: over a wall time, how busy the device
    was). `trace(event, round)`: a test's hook, told when a round's device work is queued
    ("launch") and when the host blocks on its results ("wait")."""

    def __init__(self, device: torch.device, trace: Callable[[str, int], None] | None = None):
        self.flights = (Flight(device, self), Flight(device, self))
        self.rounds = 0
        self.trace = trace
        self.device_s = 0.0  # device seconds of the rounds read back so far, start to end (CUDA; 0 elsewhere)

    def next(self) -> Flight:
        flight = self.flights[self.rounds % 2]
        self.rounds += 1
        flight.number, flight.trace = self.rounds, self.trace
        flight.marked.clear()
        return flight
