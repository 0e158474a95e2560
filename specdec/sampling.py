"""Logit processing shared by draft (q) and target (p), and sampling from given uniforms.

Both models' logits go through the same `probs()` in float32, so that p and q are the distributions
the lossless rule assumes. Sampling takes its uniforms from the caller (drawn from per-row
generators), which keeps a row's randomness independent of the batch it runs in. Rows of one batch
may each have their own settings (`Rows`): processing is then per row, the same for p and q.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from .config import SamplingParams



@dataclass
class Rows:
    """The sampling settings of a batch's rows [0, n), as tensors (`RowSettings.view`)."""

    temperature: torch.Tensor  # [n] float32; 1 for greedy rows (their processed p is the plain softmax)
    top_k: torch.Tensor  # [n] int64, 0 = off
    top_p: torch.Tensor  # [n] float32, 1 = off
    greedy_rows: torch.Tensor  # [n] bool
    greedy: bool  # host: every row greedy
    any_greedy: bool  # host: some row greedy
    any_top_k: bool
    any_top_p: bool


class RowSettings:
    """Per-row SamplingParams of a batch, kept in its `Slots` (they follow swap-removes)."""

    def __init__(self, slots, default: SamplingParams):
        self.default = default
        self.temperature = slots.add("sp_temperature", torch.float32, 1.0)
        self.top_k = slots.add("sp_top_k")
        self.top_p = slots.add("sp_top_p", torch.float32, 1.0)
        self.greedy_rows = slots.add("sp_greedy", torch.bool, True)
        self.host = {name: slots.add_host(f"sp_{name}", dtype) for name, dtype in
                     (("greedy", bool), ("top_k", np.int64), ("top_p", np.float64))}

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


def processed(logits: torch.Tensor, sp: SamplingParams | Rows) -> torch.Tensor:
    """The logits each row samples from, float32: divided by its temperature, -inf outside its top-k and top-p
    (greedy rows: as they are). logits: [..., vocab] ([n, ..., vocab] for `Rows`)."""
    if isinstance(sp, Rows):
        return _row_processed(logits, sp)
    x = logits.float()
    if sp.greedy:
        return x
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
    return x


def probs(logits: torch.Tensor, sp: SamplingParams | Rows) -> torch.Tensor:
    """Processed next-token distribution, float32 (greedy: the plain softmax, which confidence-style policies
    and logprobs read)."""
    return torch.softmax(processed(logits, sp), dim=-1)


def logprobs(logits: torch.Tensor, sp: SamplingParams | Rows) -> torch.Tensor:
    """log `probs`, computed stably."""
    return torch.log_softmax(processed(logits, sp), dim=-1)


def _row_processed(logits: torch.Tensor, rows: Rows) -> torch.Tensor:
    """`processed` with each row's own temperature, top-k and top-p (greedy rows: temperature 1, no cut)."""
    x = logits.float()
    shape = (x.shape[0],) + (1,) * (x.dim() - 1)
    x = x / rows.temperature.view(shape)
    if rows.any_top_k or rows.any_top_p:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        vocab = x.shape[-1]
        if rows.any_top_k:  # keep logits >= the k-th largest (k = vocab where off)
            k = torch.where(rows.top_k > 0, rows.top_k.clamp(max=vocab), vocab).view(shape)
            kth = sorted_x.gather(-1, (k - 1).expand(*x.shape[:-1], 1))
            x = x.masked_fill(x < kth, float("-inf"))
            sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
        if rows.any_top_p:
            sorted_p = torch.softmax(sorted_x, dim=-1)
            drop = (sorted_p.cumsum(-1) - sorted_p) >= rows.top_p.view(shape)
            x = torch.empty_like(x).scatter_(-1, order, sorted_x.masked_fill(drop, float("-inf")))
    return x


def choose(logits: torch.Tensor, dist: torch.Tensor | None, u: torch.Tensor | None, rows: SamplingParams | Rows):
    """Each row's token from logits [n, vocab]: its argmax for greedy rows, a draw from `dist` with `u` [n]
    for the others."""
    if rows.greedy:
        return logits.argmax(-1)
    drawn = sample(dist, u)
    if isinstance(rows, Rows) and rows.any_greedy:
        return torch.where(rows.greedy_rows, logits.argmax(-1), drawn)
    return drawn


def sample(dist: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sample from unnormalised non-negative weights. dist: [n, vocab], u: [n] in [0, 1)."""
    cdf = dist.cumsum(-1)  # [n, vocab]
    x = u * cdf[:, -1]
    idx = torch.searchsorted(cdf, x[:, None], right=True).squeeze(-1)  # first slot whose cdf exceeds x
    return idx.clamp_(max=dist.shape[-1] - 1)


def as_greedy(rows: Rows) -> Rows:
    """`rows` read as greedy: for logits already perturbed by `coupled` (their argmax is each row's token)."""
    ones = torch.ones_like(rows.temperature)
    return replace(rows, temperature=ones, top_k=torch.zeros_like(rows.top_k), top_p=ones,
                   greedy_rows=torch.ones_like(rows.greedy_rows), greedy=True, any_greedy=True, any_top_k=False,
                   any_top_p=False)


def coupled(logits: torch.Tensor, rows: Rows, noise: torch.Tensor) -> torch.Tensor:
    """Coupled sampling (Gumbel-max): each row's processed logits [n, w, vocab] plus its positions' Gumbel noise
    [n, w, vocab] (zeros for greedy rows). The argmax at a position is an exact draw from the row's processed
    distribution there, and depends only on the noise of that position, not on how the output was drafted."""
    return processed(logits, rows) + noise


def gumbel(keys: list[int | None], start: np.ndarray, width: int, vocab: int, device) -> torch.Tensor:
    """[n, width, vocab] Gumbel noise for output positions start[i] .. start[i] + width - 1 of each row, drawn
    from a Philox stream keyed by a 128-bit hash of (the row's key, the position) alone (torch's CPU generator
    keeps only 32 bits of a seed: positions would share noise). A row without a key (greedy) gets zeros."""
    noise = np.zeros((len(keys), width, vocab), dtype=np.float32)
    for i, key in enumerate(keys):
        if key is None:
            continue
        for j in range(width):
            digest = hashlib.blake2b(f"{key}:{int(start[i]) + j}".encode(), digest_size=16).digest()
            u = np.random.Generator(np.random.Philox(key=int.from_bytes(digest, "little"))).random(vocab)
            noise[i, j] = -np.log(-np.log(np.maximum(u, np.finfo(np.float64).tiny)))
    out = torch.from_numpy(noise)
    if torch.device(device).type == "cuda":  # drawn on the host: a device-side counter-based stream would not copy
        return out.pin_memory().to(device, non_blocking=True)
    return out


def uniforms(generators: list[torch.Generator | None], count: int, device) -> torch.Tensor:
    """[rows, count] uniforms, each row from its own generator (fixed count per row and round)."""
    if count == 0 or not generators:
        return torch.empty((len(generators), count), device=device)
    # a greedy row (no generator) gets zeros: it draws nothing
    u = torch.stack([torch.zeros(count) if g is None else torch.rand(count, generator=g) for g in generators])
    if torch.device(device).type == "cuda":  # a pinned copy: the host does not wait for the device
        return u.pin_memory().to(device, non_blocking=True)
    return u
