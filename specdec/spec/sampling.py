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
    from ..config import SamplingParams


@dataclass
class Rows:
    """The sampling settings of a batch's rows [0, n), as tensors (`batch.RowSettings.view`), or of any number of
    rows that share one setting (`Rows.of`: one-element tensors, which broadcast)."""

    temperature: torch.Tensor  # [n] float32; 1 for greedy rows (their processed p is the plain softmax)
    top_k: torch.Tensor  # [n] int64, 0 = off
    top_p: torch.Tensor  # [n] float32, 1 = off
    greedy_rows: torch.Tensor  # [n] bool
    greedy: bool  # host: every row greedy
    any_greedy: bool  # host: some row greedy
    any_top_k: bool
    any_top_p: bool

    @classmethod
    def of(cls, sp: SamplingParams, device="cpu") -> Rows:
        """Rows that all sample by `sp`."""
        g = sp.greedy
        one = lambda value, dtype: torch.tensor([value], dtype=dtype, device=device)  # noqa: E731
        return cls(one(1.0 if g else sp.temperature, torch.float32), one(0 if g else sp.top_k, torch.int64),
                   one(1.0 if g else sp.top_p, torch.float32), one(g, torch.bool), g, g, not g and sp.top_k > 0,
                   not g and sp.top_p < 1.0)


@dataclass
class Draws:
    """A round's randomness for rows [0, n): none where every row is greedy; otherwise uniforms (speculative
    sampling: per row, the draft's `max_draft`, then the rule's `max_draft` + 1) or Gumbel noise by output
    position (coupled sampling)."""

    max_draft: int
    uniforms: torch.Tensor | None = None  # [n, 2 max_draft + 1]
    noise: torch.Tensor | None = None  # [n, width, vocab] of each row's next `width` output positions

    @property
    def draft(self) -> torch.Tensor | None:
        """[n, max_draft] the draft's uniforms, one per draft step."""
        return None if self.uniforms is None else self.uniforms[:, : self.max_draft]

    @property
    def rule(self) -> torch.Tensor | None:
        """[n, max_draft + 1] the rule's: column i < max_draft tests position i, the last draws the recovered or
        bonus token."""
        return None if self.uniforms is None else self.uniforms[:, self.max_draft :]


def per_row(rows: Rows, greedy: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
    """Greedy rows' values from `greedy`, the others' from `sampled` ([n, ...] each): a batch mixing them."""
    return torch.where(rows.greedy_rows.view(-1, *(1,) * (greedy.dim() - 1)), greedy, sampled)


def processed(logits: torch.Tensor, rows: Rows) -> torch.Tensor:
    """The logits each row samples from, float32: divided by its temperature, -inf outside its top-k and top-p
    (greedy rows: as they are). logits: [n, ..., vocab] (any shape for `Rows.of`)."""
    x = logits.float()
    shape = (rows.temperature.shape[0],) + (1,) * (x.dim() - 1)
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
            # drop a token when the mass strictly before it already reaches top_p (the first always stays)
            sorted_p = torch.softmax(sorted_x, dim=-1)
            drop = (sorted_p.cumsum(-1) - sorted_p) >= rows.top_p.view(shape)
            x = torch.empty_like(x).scatter_(-1, order, sorted_x.masked_fill(drop, float("-inf")))
    return x


def probs(logits: torch.Tensor, rows: Rows) -> torch.Tensor:
    """Processed next-token distribution, float32 (greedy: the plain softmax, which confidence-style policies
    and logprobs read)."""
    return torch.softmax(processed(logits, rows), dim=-1)


def logprobs(logits: torch.Tensor, rows: Rows) -> torch.Tensor:
    """log `probs`, computed stably."""
    return torch.log_softmax(processed(logits, rows), dim=-1)


def choose(logits: torch.Tensor, dist: torch.Tensor | None, u: torch.Tensor | None, rows: Rows) -> torch.Tensor:
    """Each row's token from logits [n, vocab]: its argmax for greedy rows, a draw from `dist` with `u` [n]
    for the others."""
    if rows.greedy:
        return logits.argmax(-1)
    drawn = sample(dist, u)
    return per_row(rows, logits.argmax(-1), drawn) if rows.any_greedy else drawn


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


# Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11; Random123's reference,
# the generator of cuRAND, torch's CUDA generator and TensorFlow): ten rounds of two 32x32->64-bit products, the key
# bumped by Weyl increments between rounds.
PHILOX_M = (0xD2511F53, 0xCD9E8D57)  # round multipliers
PHILOX_W = (0x9E3779B9, 0xBB67AE85)  # key increments
_U32 = 0xFFFFFFFF


def _pass_blocks(device: torch.device) -> int:
    """Philox blocks `gumbel` draws per pass: on a CPU 2^15 a thread (cache-sized), elsewhere 2^22 (it bounds a
    pass's memory); bench/results/README.md has the timings that chose them."""
    return (1 << 15) * torch.get_num_threads() if device.type == "cpu" else 1 << 22


def _mulhilo(m: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The high and low 32-bit words of m * x, m a constant < 2^32, x int64 holding values in [0, 2^32). torch has
    no unsigned multiply-high and m * x may pass 2^63: the product is taken in m's 16-bit halves (each < 2^48)."""
    low = x * (m & 0xFFFF)
    high = x * (m >> 16)  # m * x = high * 2^16 + low
    hi = (low >> 16).add_(high).bitwise_right_shift_(16)
    lo = (high & 0xFFFF).bitwise_left_shift_(16).add_(low).bitwise_and_(_U32)
    return hi, lo


def philox4x32(counter, key, rounds: int = 10) -> tuple[torch.Tensor, ...]:
    """Philox4x32-`rounds` of the 128-bit counters (c0, c1, c2, c3) under the 64-bit keys (k0, k1): int64 tensors
    holding uint32 words, broadcast together (any device, the same words on each). Returns the four output words."""
    (c0, c1, c2, c3), (k0, k1) = counter, key
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + PHILOX_W[0]) & _U32, (k1 + PHILOX_W[1]) & _U32
        hi0, lo0 = _mulhilo(PHILOX_M[0], c0)
        hi1, lo1 = _mulhilo(PHILOX_M[1], c2)
        c0, c1, c2, c3 = (hi1 ^ c1).bitwise_xor_(k0), lo1, (hi0 ^ c3).bitwise_xor_(k1), lo0
    return c0, c1, c2, c3


def uniform53(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """Uniforms in [0, 1) from two uint32 words (held in int64): their top 27 and 26 bits as a 53-bit fraction,
    float64, so that 1 - u reaches 2^-53 and the Gumbel tail is not cut at float32's 2^-24."""
    return (hi >> 5).mul_(1 << 26).add_(lo >> 6).double().mul_(2.0 ** -53)


def noise_key(key: int) -> list[int]:
    """The four uint32 words of a row key's 128-bit blake2b hash: its Philox key (words 0, 1) and counter words
    2, 3 (words 0, 1 of the counter are the vocabulary block and the output position)."""
    digest = hashlib.blake2b(str(key).encode(), digest_size=16, person=b"specdec-gumbel").digest()
    return [int.from_bytes(digest[i : i + 4], "little") for i in range(0, 16, 4)]


def gumbel(keys: list[int | None], start: np.ndarray | torch.Tensor, width: int, vocab: int, device,
           blocks: int | None = None) -> torch.Tensor:
    """[n, width, vocab] float32 Gumbel noise for output positions start[i] .. start[i] + width - 1 of each row,
    drawn on `device`: token t at position p of a row with key k is -log(-log u), u the 53-bit uniform of words
    (2 (t % 2), 2 (t % 2) + 1) of Philox4x32-10 at counter (t // 2, p, h2, h3) under key (h0, h1), h = `noise_key`
    (k). A value depends on (k, p, t) alone, not on the batch, width, vocab, device or `blocks` (Philox blocks per
    pass). A row without a key (greedy) gets zeros. `start` may be on the device (rows' lengths a round in flight
    advanced there). The host builds one [rows, 6] table (hash words, start, row) and copies it once; the rest is a
    fixed sequence of tensor ops per pass on the device (which needs float64), none per (row, position)."""
    n, device = len(keys), torch.device(device)
    keyed = [i for i, key in enumerate(keys) if key is not None]
    if not keyed or width == 0 or vocab == 0:
        return torch.zeros((n, width, vocab), device=device)
    on_device = isinstance(start, torch.Tensor)
    table = torch.tensor([noise_key(keys[i]) + [0 if on_device else int(start[i]), i] for i in keyed],
                         dtype=torch.int64)  # [m, 6]
    if device.type == "cuda":  # a pinned copy: the host does not wait for the device
        table = table.pin_memory()
    table = table.to(device, non_blocking=True)
    at = start.to(device, torch.int64).index_select(0, table[:, 5])[:, None] if on_device else table[:, 4:5]
    # one stream per (row, position): its hash words and position, [streams, 1] against blocks [1, cols]
    words = [table[:, i].repeat_interleave(width)[:, None] for i in range(4)]
    positions = (at + torch.arange(width, device=device)).view(-1, 1)
    streams, per_stream = len(keyed) * width, (vocab + 1) // 2  # a Philox block is two 53-bit uniforms
    blocks = blocks or _pass_blocks(device)
    cols = min(per_stream, blocks)
    rows = max(1, blocks // cols)
    out = torch.empty((streams, per_stream, 2), dtype=torch.float32, device=device)
    for s0 in range(0, streams, rows):  # passes of about `blocks` blocks each
        s = slice(s0, s0 + rows)
        for b0 in range(0, per_stream, cols):
            counter = (torch.arange(b0, min(b0 + cols, per_stream), device=device)[None, :], positions[s],
                       words[2][s], words[3][s])
            x0, x1, x2, x3 = philox4x32(counter, (words[0][s], words[1][s]))
            u = torch.stack((uniform53(x0, x1), uniform53(x2, x3)), dim=-1)  # [rows, cols, 2]: tokens 2b, 2b + 1
            out[s, b0 : b0 + cols] = u.clamp_min_(torch.finfo(torch.float64).tiny).log_().neg_().log_().neg_()
    noise = out.view(len(keyed), width, 2 * per_stream)[..., :vocab]
    if len(keyed) == n:
        return noise.contiguous()
    return torch.zeros((n, width, vocab), device=device).index_copy_(0, table[:, 5], noise)


def uniforms(generators: list[torch.Generator | None], count: int, device) -> torch.Tensor:
    """[rows, count] uniforms, each row from its own generator (fixed count per row and round)."""
    if count == 0 or not generators:
        return torch.empty((len(generators), count), device=device)
    # a greedy row (no generator) gets zeros: it draws nothing
    u = torch.stack([torch.zeros(count) if g is None else torch.rand(count, generator=g) for g in generators])
    if torch.device(device).type == "cuda":  # a pinned copy: the host does not wait for the device
        return u.pin_memory().to(device, non_blocking=True)
    return u
