"""Planning a worker's GPU memory: how many rows of how many tokens the KV caches can hold.

The plan is made from what is left under `gpu_memory_fraction` of the device once both models' weights
are loaded, less a reserve for a step's activations (logits of the widest verification, in float32,
a few times over) and the CUDA-graph pool. A row costs, per token, the KV bytes of every layer of the
target and of the draft. A config that cannot fit one row of the longest prompt plus `max_new_tokens`
is refused with the figures; a batch that does not fit whole runs with fewer rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cache import model_kv_shape

GiB = 1 << 30


def kv_bytes_per_token(models) -> int:
    """KV-cache bytes one token of one row takes in all layers of these models."""
    total = 0
    for m in models:
        layers, kv_heads, head_dim = model_kv_shape(m)
        total += 2 * layers * kv_heads * head_dim * next(m.parameters()).element_size()
    return total


class OutOfMemoryPlan(ValueError):
    """Even one row does not fit the memory planned for the KV caches."""


@dataclass
class MemoryPlan:
    budget: int  # bytes the KV caches may take
    per_token: int  # bytes per row-token, both models
    fraction: float
    total: int  # the device's memory
    used: int  # in use when the plan was made (weights, the process's other tensors, other processes)
    reserve: int

    def max_row_tokens(self) -> int:
        """The most tokens one row can hold."""
        return max(self.budget, 0) // self.per_token

    def rows(self, max_len: int, want: int) -> int:
        """Rows of max_len tokens to allocate: `want`, or as many as fit; refuses if none fits."""
        fit = self.budget // (max_len * self.per_token)
        if fit < 1:
            raise OutOfMemoryPlan(
                f"one row of {max_len} tokens needs {max_len * self.per_token / GiB:.2f} GiB of KV cache, but "
                f"resources.gpu_memory_fraction {self.fraction} of {self.total / GiB:.1f} GiB leaves "
                f"{max(self.budget, 0) / GiB:.2f} GiB after {self.used / GiB:.1f} GiB in use (weights) and "
                f"{self.reserve / GiB:.2f} GiB for activations: raise the fraction, or lower "
                "generation.max_new_tokens or the prompts' length")
        return min(want, fit)


def plan(device: torch.device, models, fraction: float, rows: int, width: int, vocab: int,
         freed: int = 0) -> MemoryPlan | None:
    """The plan for a CUDA device (None elsewhere: CPU memory is not planned). `freed`: bytes of caches
    about to be released (the engine's current ones, replaced by the new allocation)."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    used = total - free - freed
    reserve = 3 * rows * width * vocab * 4 + GiB // 2
    budget = int(fraction * total) - used - reserve
    return MemoryPlan(budget, kv_bytes_per_token(models), fraction, total, used, reserve)


def out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` (or the failure it reports, e.g. another process's) is running out of memory."""
    text = str(exc).lower()
    return type(exc).__name__ == "OutOfMemoryError" or "out of memory" in text or "can't allocate memory" in text
