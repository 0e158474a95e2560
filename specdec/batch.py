"""The state of a batch's active rows, and moving host arrays to the device without waiting.

Rows [0, n) are active: their tokens live in one device buffer (`seq`), their lengths on the host
(`lens`: the host knows them, so no forward reads them back), their per-row records in `rows`. A
finished row leaves by swap-remove (`move_row`): the last active row moves into its slot, with its
cache rows, proposer state and policy state (`Slots`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .config import SampleResult, SamplingParams
from .sampling import RowSettings
from .policy import Slots, make_policy
from .runner import ModelRunner


@dataclass
class _Row:
    index: int  # position in the caller's prompt list
    result: SampleResult
    tokens: list[int]  # prompt + emitted so far (host copy, for prompt lookup and stop checks)
    generator: torch.Generator | None
    t0: float
    sp: SamplingParams  # this row's settings (the engine's, or the row's own)


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
    """The state of the active rows [0, n): token buffer, lengths (on the host), per-row records."""

    def __init__(self, engine, capacity: int, max_len: int, policy: str | None = None):
        self.engine = engine
        self.device = engine.device
        self.target = engine.runner("target", capacity, max_len)
        self.capacity = capacity
        self.max_len = max_len
        self.vocab_size = engine.vocab_size
        self.sampling = engine.sampling
        self.spec = engine.spec
        self.seq = torch.zeros((capacity, max_len), dtype=torch.int64, device=self.device)
        self.slots = Slots(capacity, self.device)
        self.lens = self.slots.add_host("seq_len")  # tokens per row (prompt + emitted), known on the host
        self.sp = RowSettings(self.slots, engine.sampling)  # each row's sampling settings (`sp.view(n)`)
        self.rows: list[_Row | None] = [None] * capacity
        self.n = 0
        self.u_draft = torch.empty((capacity, 0), device=self.device)
        if engine.spec.method == "none":
            policy = "fixed"  # never drafts: no policy to consult (limits are 0)
        spec = self.spec if policy is None else self.spec.model_copy(update={"draft_length": policy})
        self.policy = make_policy(spec, self.slots, engine.policy_memory)
        self.proposer = engine._make_proposer(self)

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        return to_device(array, self.device)

    def write_rows(self, start: int, prompts: list[list[int]]) -> None:
        """Rows [start, start + len(prompts)) hold these prompts (one copy to the device)."""
        end, t = start + len(prompts), max(len(p) for p in prompts)
        tokens = np.zeros((len(prompts), t), dtype=np.int64)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = p
        self.seq[start:end, :t] = self.to_device(tokens)
        self.lens[start:end] = [len(p) for p in prompts]

    def prefill(self, runner: ModelRunner, start: int, end: int) -> np.ndarray:
        """Cache all but the pending token of rows [start, end); returns their cached lengths."""
        lengths = self.lens[start:end] - 1
        t = int(lengths.max())
        if t > 0:
            runner.prefill(self.seq[start:end, :t], start, end)
        return lengths

    def prefill_target(self, start: int, end: int, top: int = 0) -> np.ndarray | None:
        """The target's prefill of rows [start, end); with `top` > 0, its top ids at every cached position
        [rows, t, top] on the host (read back once per admission, not per round)."""
        t = int(self.lens[start:end].max()) - 1
        if t <= 0:
            return np.zeros((end - start, 0, top), dtype=np.int64) if top else None
        ids = self.target.prefill(self.seq[start:end, :t], start, end, top)
        return None if ids is None else ids.cpu().numpy()

    def move_row(self, src: int, dst: int) -> None:
        if src == dst:
            return
        length = int(self.lens[src])
        self.target.cache.move_row(src, dst, length)
        self.proposer.move_row(src, dst)
        self.seq[dst, :length] = self.seq[src, :length]
        self.slots.move(src, dst)
        self.rows[dst] = self.rows[src]


