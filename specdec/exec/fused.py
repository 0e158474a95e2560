"""A decode step's matrix products fused with the work around them, as Triton kernels (`product`): where a step has
at most MAX_TOKENS tokens, each product streams its weight once, and the same kernel does what came before it (the
RMSNorm of its input, or SwiGLU's silu(gate) * up) and after it (the bias, the residual add). A layer is then four
such kernels, RoPE with the cache writes (one compiled kernel) and the attention (`pieces`), where the compiled
pieces of specdec/exec/llama.py launch about ten. The arithmetic is the pieces': sums in float32, the norm's and
the activation's outputs rounded to the model's dtype where transformers rounds them.

CUDA; on a CPU, Triton's interpreter (TRITON_INTERPRET=1 in the environment before triton is imported): a check of
the arithmetic, not a speed. Off unless asked for (`ModelRunner.fuse_products`): bench/step_speed.py's
`fast-fused` measures it against `fast`.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from . import llama
from .cache import put

try:
    import triton
    import triton.language as tl
except ImportError:  # no triton (a CPU install): `available` says why
    triton = None

MAX_TOKENS = 8  # steps of at most this many tokens (rows x width) take the fused products
CONFIGS = {1: (16, 256, 4), MAX_TOKENS: (16, 128, 8)}  # BLOCK_M -> (BLOCK_N, BLOCK_K, warps)
PLAIN, NORM, SWIGLU = 0, 1, 2  # what a product does to its input first


def available(device: torch.device) -> str | None:
    """Why the fused products cannot run on `device` (None if they can)."""
    if triton is None:
        return "no triton"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "Triton runs on CUDA (elsewhere only under TRITON_INTERPRET=1)"
    return None


if triton is not None:
    @triton.jit
    def _product(x_ptr, w_ptr, out_ptr, ln_ptr, bias_ptr, res_ptr, M, N, K, eps, stride_x, stride_w, stride_o,
                 stride_r, BEFORE: tl.constexpr, BIAS: tl.constexpr, RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """out[m, n] = residual[m, n] + (bias[n] + sum_k a[m, k] w[n, k]) for BLOCK_N output columns a program, where
        a is x (PLAIN), RMSNorm(x) * ln (NORM) or silu(x[:, :K]) * x[:, K:] (SWIGLU); the weight's rows streamed once
        (evicted first: no other program reads them), x's re-read from L2 by each program."""
        dtype = out_ptr.dtype.element_ty
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        rows = rm[:, None] < M
        rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
        if BEFORE == 1:  # each row's mean square first
            squares = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                rk = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(x_ptr + rm[:, None] * stride_x + rk[None, :], mask=rows & (rk[None, :] < K), other=0.0)
                squares += x.to(tl.float32) * x.to(tl.float32)
            rstd = tl.rsqrt(tl.sum(squares, axis=1) / K + eps)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            at, held = x_ptr + rm[:, None] * stride_x + rk[None, :], rows & (rk[None, :] < K)
            a = tl.load(at, mask=held, other=0.0)
            if BEFORE == 1:  # transformers' RMSNorm: float32, rounded, then times the weight in the dtype
                ln = tl.load(ln_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
                a = (ln[None, :] * (a.to(tl.float32) * rstd[:, None]).to(dtype).to(tl.float32)).to(dtype)
            if BEFORE == 2:  # silu(gate), rounded, times up, rounded
                up = tl.load(at + K, mask=held, other=0.0).to(tl.float32)
                gate = a.to(tl.float32)
                a = ((gate * tl.sigmoid(gate)).to(dtype).to(tl.float32) * up).to(dtype)
            w = tl.load(w_ptr + rn[:, None] * stride_w + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K),
                        other=0.0, eviction_policy="evict_first")
            acc += tl.sum(tl.expand_dims(a.to(tl.float32), 1) * tl.expand_dims(w.to(tl.float32), 0), axis=2)
        if BIAS:
            acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        out = acc.to(dtype)
        kept = rows & (rn[None, :] < N)
        if RESIDUAL:  # the product rounded, then the add rounded: as `x + F.linear(...)`
            res = tl.load(res_ptr + rm[:, None] * stride_r + rn[None, :], mask=kept, other=0.0)
            out = (res.to(tl.float32) + out.to(tl.float32)).to(dtype)
        tl.store(out_ptr + rm[:, None] * stride_o + rn[None, :], out, mask=kept)


def product(x: torch.Tensor, w: torch.Tensor, before: int = PLAIN, ln: torch.Tensor | None = None, eps: float = 0.0,
            bias: torch.Tensor | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """residual + F.linear(a, w, bias) over x [..., K] (SWIGLU: [..., 2K], gate then up), a as `before` says: x,
    `rms_norm(x, ln, eps)` or `silu(gate) * up`; at most MAX_TOKENS rows of x, in one kernel."""
    n, k = w.shape
    lead = x.shape[:-1]
    x = x.reshape(-1, x.shape[-1])
    if x.stride(-1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    assert m <= MAX_TOKENS and x.shape[1] == (2 * k if before == SWIGLU else k) and w.stride(1) == 1
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    res = out if residual is None else residual.reshape(m, n)
    block_m = 1 if m == 1 else MAX_TOKENS
    block_n, block_k, warps = CONFIGS[block_m]
    _product[(triton.cdiv(n, block_n),)](
        x, w, out, w if ln is None else ln, w if bias is None else bias, res, m, n, k, eps, x.stride(0), w.stride(0),
        out.stride(0), res.stride(0), BEFORE=before, BIAS=bias is not None, RESIDUAL=residual is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
    return out.view(*lead, n)


def rope_put(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
             keys: torch.Tensor, values: torch.Tensor, at: tuple) -> torch.Tensor:
    """The fused projection's output split into heads and RoPE applied, k and v written into the layer's cache at
    `at`: q, as llama's `_first` returns it."""
    q, k, v = llama._heads(qkv, cos, sin, heads, kv_heads, head_dim)
    put(keys, values, at, k, v)
    return q


def pieces(rope: Callable = rope_put, norm: Callable = llama.rms_norm) -> llama.Pieces:
    """What a step of at most MAX_TOKENS tokens runs between its attentions (`llama.Pieces`) with the fused products:
    `rope` (`rope_put`, compiled where the caller compiles) and the final `norm` around them. Not for a layer whose
    partial products are summed over ranks (`Layer.reduce`)."""

    def first(x, layer, cos, sin, heads, kv_heads, head_dim, eps, keys, values, at):
        qkv = product(x, layer.qkv, NORM, layer.ln1, eps, bias=layer.qkv_bias)
        return rope(qkv, cos, sin, heads, kv_heads, head_dim, keys, values, at)

    def layer_out(x, layer, o, eps):
        x = product(o, layer.o, residual=x)
        return product(product(x, layer.gate_up, NORM, layer.ln2, eps), layer.down, SWIGLU, residual=x)

    def between(x, o, layer, following, cos, sin, heads, kv_heads, head_dim, eps, keys, values, at):
        x = layer_out(x, layer, o, eps)
        return x, first(x, following, cos, sin, heads, kv_heads, head_dim, eps, keys, values, at)

    def last(x, o, layer, final, eps):
        return norm(layer_out(x, layer, o, eps), final, eps)

    return llama.Pieces(first, between, last)
