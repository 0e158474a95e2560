"""What a target forward reads in a round: each row's tokens, positions and the slots it attends over
(`TargetInputs`), and the rows that end their prefill in the same forward (`Join`); and how host arrays reach
the device (`to_device`) without the host waiting for them."""

from __future__ import annotations

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
