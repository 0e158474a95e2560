"""Logit processing shared by draft (q) and target (p), and sampling from given uniforms.

Both models' logits go through the same `probs()` in float32, so that p and q are the distributions
the lossless rule assumes. Sampling takes its uniforms from the caller (drawn from per-row
generators), which keeps a row's randomness independent of the batch it runs in.
"""

from __future__ import annotations

import torch

from .config import SamplingParams


def probs(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """Processed next-token distribution, float32. logits: [..., vocab]."""
    x = logits.float()
    if sp.greedy:
        return torch.softmax(x, dim=-1)  # only used by confidence-style policies under greedy
    x = x / sp.temperature
    vocab = x.shape[-1]
    if 0 < sp.top_k < vocab:
        kth = torch.topk(x, sp.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if sp.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        sorted_p = torch.softmax(sorted_x, dim=-1)
        # drop a token when the mass strictly before it already reaches top_p (the first always stays)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= sp.top_p
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.empty_like(x).scatter_(-1, order, sorted_x)
    return torch.softmax(x, dim=-1)


def sample(dist: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sample from unnormalised non-negative weights. dist: [n, vocab], u: [n] in [0, 1)."""
    cdf = dist.cumsum(-1)  # [n, vocab]
    x = u * cdf[:, -1]
    idx = torch.searchsorted(cdf, x[:, None], right=True).squeeze(-1)  # first slot whose cdf exceeds x
    return idx.clamp_(max=dist.shape[-1] - 1)


def uniforms(generators: list[torch.Generator], count: int, device) -> torch.Tensor:
    """[rows, count] uniforms, each row from its own generator (fixed count per row and round)."""
    if count == 0 or not generators:
        return torch.empty((len(generators), count), device=device)
    u = torch.stack([torch.rand(count, generator=g) for g in generators])
    if torch.device(device).type == "cuda":  # a pinned copy: the host does not wait for the device
        return u.pin_memory().to(device, non_blocking=True)
    return u
