"""A decode step's layers as five Triton kernels, where the compiled pieces of specdec/exec/llama.py and SDPA launch
about ten: where a step has at most MAX_TOKENS tokens, each matrix product streams its weight once, and the same
kernel does what came before it (the RMSNorm of its input, or SwiGLU's silu(gate) * up) and after it (the bias, the
residual add: `product`); the layer's first also applies RoPE and writes k and v into the cache (`qkv_rope`); the
attention reads each slot once for a kv head's query heads, masks by the tokens' positions (no mask tensor) and
splits long windows over programs (`attend`). The arithmetic is the pieces': sums in float32, the norm's, the
activation's and the products' outputs rounded to the model's dtype where transformers rounds them (RoPE, as
compiled, rounds once).

CUDA; on a CPU, Triton's interpreter (TRITON_INTERPRET=1 in the environment before triton is imported): a check of
the arithmetic, not a speed. Off unless asked for (`ModelRunner.fuse_products`): bench/step_speed.py's
`fast-fused` measures it against `fast`.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch

from . import llama

try:
    import triton
    import triton.language as tl
except ImportError:  # no triton (a CPU install): `available` says why
    triton = None

MAX_TOKENS = 8  # steps of at most this many tokens (rows x width) take the fused products
CONFIGS = {1: (16, 256, 4), MAX_TOKENS: (16, 128, 8)}  # BLOCK_M -> (widest BLOCK_N, BLOCK_K, warps)
WAVES = 3  # programs per streaming multiprocessor a product's grid is narrowed to reach (`tile`), an attention's split
SPLIT_SLOTS = 256  # the fewest slots an attention's program takes where the slots are split (`attend`)
PLAIN, NORM, SWIGLU = 0, 1, 2  # what a product does to its input first


def available(device: torch.device) -> str | None:
    """Why the fused products cannot run on `device` (None if they can)."""
    if triton is None:
        return "no triton"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "Triton runs on CUDA (elsewhere only under TRITON_INTERPRET=1)"
    return None


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; elsewhere (the interpreter) an H100's."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def tile(m: int, n: int, device: torch.device, itemsize: int = 2) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps) of a product of m rows against n weight rows: CONFIGS' for the rows, with
    BLOCK_N halved (and the warps with it, down to 4) until the grid has WAVES programs per multiprocessor, as long
    as each thread still loads 16 bytes of the weight at a time (a grid of fewer leaves multiprocessors idle while
    the weight streams: SmolLM2's o_proj in blocks of 16 rows is 36 programs for 132)."""
    block_m = 1 if m == 1 else MAX_TOKENS
    block_n, block_k, warps = CONFIGS[block_m]
    vector = 16 // itemsize  # elements a thread loads at once

    def fills(rows: int, warps: int) -> bool:  # a [rows, block_k] tile gives each thread a whole vector
        return rows * block_k >= vector * 32 * warps

    while -(-n // block_n) < WAVES * multiprocessors(device):
        if fills(block_n // 2, warps):
            block_n //= 2
        elif warps > 4 and fills(block_n // 2, warps // 2):
            block_n, warps = block_n // 2, warps // 2
        else:
            break
    return block_m, block_n, block_k, warps


if triton is not None:
    @triton.jit
    def _rstd(x_ptr, M, K, eps, stride_x, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        """1 / RMS of each of x's first M rows [BLOCK_M] (float32), over K columns."""
        rm = tl.arange(0, BLOCK_M)
        squares = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rm[:, None] * stride_x + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K),
                        other=0.0).to(tl.float32)
            squares += x * x
        return tl.rsqrt(tl.sum(squares, axis=1) / K + eps)

    @triton.jit
    def _input(x_ptr, ln_ptr, rstd, k0, M, K, stride_x, BEFORE: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_K: tl.constexpr):
        """Columns [k0, k0 + BLOCK_K) of a product's input [BLOCK_M, BLOCK_K] (float32): x (PLAIN), transformers'
        RMSNorm of x, float32 rounded to the dtype, times the weight in the dtype (NORM), or silu(gate) rounded
        times up, rounded, with x = [gate, up] (SWIGLU)."""
        dtype = x_ptr.dtype.element_ty
        rm = tl.arange(0, BLOCK_M)
        rk = k0 + tl.arange(0, BLOCK_K)
        at, held = x_ptr + rm[:, None] * stride_x + rk[None, :], (rm[:, None] < M) & (rk[None, :] < K)
        a = tl.load(at, mask=held, other=0.0).to(tl.float32)
        if BEFORE == 1:
            ln = tl.load(ln_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
            a = (ln[None, :] * (a * rstd[:, None]).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        if BEFORE == 2:
            up = tl.load(at + K, mask=held, other=0.0).to(tl.float32)
            a = ((a * tl.sigmoid(a)).to(dtype).to(tl.float32) * up).to(dtype).to(tl.float32)
        return a

    @triton.jit
    def _products(a, w_ptr, rn, k0, N, K, stride_w, BLOCK_K: tl.constexpr):
        """a [BLOCK_M, BLOCK_K] times weight rows `rn` at columns [k0, k0 + BLOCK_K), elementwise: [BLOCK_M, len(rn),
        BLOCK_K] float32, which the caller adds up over the K loop and sums once after it (a sum at every step
        would have the warps exchange partial sums through shuffles and shared memory between the weight's
        loads); the weight streamed once (evicted first: no other program reads it)."""
        rk = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rn[:, None] * stride_w + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K),
                    other=0.0, eviction_policy="evict_first").to(tl.float32)
        return tl.expand_dims(a, 1) * tl.expand_dims(w, 0)

    @triton.jit
    def _product(x_ptr, w_ptr, out_ptr, ln_ptr, bias_ptr, res_ptr, M, N, K, eps, stride_x, stride_w, stride_o,
                 stride_r, BEFORE: tl.constexpr, BIAS: tl.constexpr, RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """out[m, n] = residual[m, n] + (bias[n] + sum_k a[m, k] w[n, k]) for BLOCK_N output columns a program, a as
        `_input` makes it; x's rows re-read from L2 by each program."""
        dtype = out_ptr.dtype.element_ty
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
        if BEFORE == 1:
            rstd = _rstd(x_ptr, M, K, eps, stride_x, BLOCK_M, BLOCK_K)
        terms = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = _input(x_ptr, ln_ptr, rstd, k0, M, K, stride_x, BEFORE, BLOCK_M, BLOCK_K)
            terms += _products(a, w_ptr, rn, k0, N, K, stride_w, BLOCK_K)
        acc = tl.sum(terms, axis=2)
        if BIAS:
            acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        out = acc.to(dtype)
        kept = (rm[:, None] < M) & (rn[None, :] < N)
        if RESIDUAL:  # the product rounded, then the add rounded: as `x + F.linear(...)`
            res = tl.load(res_ptr + rm[:, None] * stride_r + rn[None, :], mask=kept, other=0.0)
            out = (res.to(tl.float32) + out.to(tl.float32)).to(dtype)
        tl.store(out_ptr + rm[:, None] * stride_o + rn[None, :], out, mask=kept)

    @triton.jit
    def _qkv_rope(x_ptr, w_ptr, ln_ptr, bias_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, off_ptr, M, K, T, eps,
                  stride_x, stride_w, stride_rope, head_stride, HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                  HD: tl.constexpr, BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr,
                  BLOCK_K: tl.constexpr):
        """A layer's start for M = rows x T tokens: RMSNorm(x) * ln times the fused q/k/v weight (and its bias), RoPE
        (rotate-half) on the q and k heads, q stored [rows, HEADS, T, HD], k and v into the layer's cache at each
        token's element offset (off_ptr) plus the head's. A program takes BLOCK_P of a head's HD / 2 column pairs
        (j, j + HD / 2), the two columns RoPE mixes."""
        dtype = q_ptr.dtype.element_ty
        chunks = HD // 2 // BLOCK_P
        head = tl.program_id(0) // chunks
        rp = (tl.program_id(0) % chunks) * BLOCK_P + tl.arange(0, BLOCK_P)  # pair j: columns j and j + HD / 2
        lo, hi = head * HD + rp, head * HD + HD // 2 + rp  # the weight's rows
        rm = tl.arange(0, BLOCK_M)
        rstd = _rstd(x_ptr, M, K, eps, stride_x, BLOCK_M, BLOCK_K)
        terms_lo = tl.zeros((BLOCK_M, BLOCK_P, BLOCK_K), dtype=tl.float32)
        terms_hi = tl.zeros((BLOCK_M, BLOCK_P, BLOCK_K), dtype=tl.float32)
        n = (HEADS + 2 * KV_HEADS) * HD
        for k0 in range(0, K, BLOCK_K):
            a = _input(x_ptr, ln_ptr, rstd, k0, M, K, stride_x, 1, BLOCK_M, BLOCK_K)
            terms_lo += _products(a, w_ptr, lo, k0, n, K, stride_w, BLOCK_K)
            terms_hi += _products(a, w_ptr, hi, k0, n, K, stride_w, BLOCK_K)
        acc_lo, acc_hi = tl.sum(terms_lo, axis=2), tl.sum(terms_hi, axis=2)
        if BIAS:
            acc_lo += tl.load(bias_ptr + lo).to(tl.float32)[None, :]
            acc_hi += tl.load(bias_ptr + hi).to(tl.float32)[None, :]
        x_lo, x_hi = acc_lo.to(dtype).to(tl.float32), acc_hi.to(dtype).to(tl.float32)  # the product, rounded
        tokens = (rm[:, None] < M) & (rp[None, :] < HD // 2)
        if head < HEADS + KV_HEADS:  # q and k: RoPE
            rope = rm[:, None] * stride_rope + rp[None, :]
            cos_lo = tl.load(cos_ptr + rope, mask=tokens, other=0.0).to(tl.float32)
            sin_lo = tl.load(sin_ptr + rope, mask=tokens, other=0.0).to(tl.float32)
            cos_hi = tl.load(cos_ptr + rope + HD // 2, mask=tokens, other=0.0).to(tl.float32)
            sin_hi = tl.load(sin_ptr + rope + HD // 2, mask=tokens, other=0.0).to(tl.float32)
            x_lo, x_hi = x_lo * cos_lo - x_hi * sin_lo, x_hi * cos_hi + x_lo * sin_hi
        if head < HEADS:  # q [rows, HEADS, T, HD]: token m is row m // T, its (m % T)th
            q_at = q_ptr + ((rm // T) * HEADS + head) * T * HD + (rm % T) * HD
            tl.store(q_at[:, None] + rp[None, :], x_lo.to(dtype), mask=tokens)
            tl.store(q_at[:, None] + HD // 2 + rp[None, :], x_hi.to(dtype), mask=tokens)
        else:  # k or v: into the cache
            off = tl.load(off_ptr + rm, mask=rm < M, other=0) + ((head - HEADS) % KV_HEADS) * head_stride
            is_k, is_v = head < HEADS + KV_HEADS, head >= HEADS + KV_HEADS  # (a program writes one of the two)
            k_at, v_at = k_ptr + off, v_ptr + off
            tl.store(k_at[:, None] + rp[None, :], x_lo.to(dtype), mask=tokens & is_k)
            tl.store(k_at[:, None] + HD // 2 + rp[None, :], x_hi.to(dtype), mask=tokens & is_k)
            tl.store(v_at[:, None] + rp[None, :], x_lo.to(dtype), mask=tokens & is_v)
            tl.store(v_at[:, None] + HD // 2 + rp[None, :], x_hi.to(dtype), mask=tokens & is_v)

    @triton.jit
    def _attention(q_ptr, k_ptr, v_ptr, pos_ptr, out_ptr, m_ptr, l_ptr, acc_ptr, T, S, chunk, scale, sq_n, sq_h,
                   sq_t, sk_n, sk_h, sk_s, sv_n, sv_h, sv_s, s_pos, so_n, so_t, GROUP: tl.constexpr,
                   KV_HEADS: tl.constexpr, HD: tl.constexpr, IEEE: tl.constexpr, PARTIAL: tl.constexpr,
                   BLOCK_Q: tl.constexpr, BLOCK_S: tl.constexpr):
        """Attention of one row's kv head: its GROUP query heads' T tokens (query r = g * T + j, BLOCK_Q of them) over
        slots [split * chunk, + chunk) of S, query j of the row seeing slots 0..pos[j]; online softmax in float32.
        The output [rows, T, heads * HD], or (PARTIAL) the split's running max, sum and unnormalised output for
        `_combine`."""
        pid, split = tl.program_id(0), tl.program_id(1)
        row, kvh = pid // KV_HEADS, pid % KV_HEADS
        rq, rd = tl.arange(0, BLOCK_Q), tl.arange(0, HD)
        g, j = rq // T, rq % T
        live = rq < GROUP * T
        head = kvh * GROUP + g
        q = tl.load(q_ptr + row * sq_n + head[:, None] * sq_h + j[:, None] * sq_t + rd[None, :], mask=live[:, None],
                    other=0.0)
        pos = tl.load(pos_ptr + row * s_pos + j, mask=live, other=0)
        k_at, v_at = k_ptr + row * sk_n + kvh * sk_h, v_ptr + row * sv_n + kvh * sv_h
        top = tl.full((BLOCK_Q,), float("-inf"), dtype=tl.float32)
        total = tl.zeros((BLOCK_Q,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_Q, HD), dtype=tl.float32)
        lo = split * chunk
        hi = tl.minimum(lo + chunk, S)
        for s0 in range(lo, hi, BLOCK_S):
            rs = s0 + tl.arange(0, BLOCK_S)
            inside = rs < hi
            k = tl.load(k_at + rs[:, None] * sk_s + rd[None, :], mask=inside[:, None], other=0.0)
            if IEEE:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            seen = (rs[None, :] <= pos[:, None]) & inside[None, :]
            scores = tl.where(seen, scores * scale, float("-inf"))
            new_top = tl.maximum(top, tl.max(scores, axis=1))
            shift = tl.where(new_top == float("-inf"), 0.0, new_top)  # a query that saw nothing yet: no NaN
            weights = tl.exp(scores - shift[:, None])
            kept = tl.exp(top - shift)
            total = total * kept + tl.sum(weights, axis=1)
            v = tl.load(v_at + rs[:, None] * sv_s + rd[None, :], mask=inside[:, None], other=0.0)
            if IEEE:
                acc = acc * kept[:, None] + tl.dot(weights, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * kept[:, None] + tl.dot(weights.to(v.dtype), v)
            top = new_top
        if PARTIAL:  # [rows * KV_HEADS, splits, BLOCK_Q(, HD)]
            at = (pid * tl.num_programs(1) + split) * BLOCK_Q + rq
            tl.store(m_ptr + at, top)
            tl.store(l_ptr + at, total)
            tl.store(acc_ptr + at[:, None] * HD + rd[None, :], acc)
        else:
            out = acc / total[:, None]
            tl.store(out_ptr + row * so_n + j[:, None] * so_t + head[:, None] * HD + rd[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=live[:, None])

    @triton.jit
    def _combine(m_ptr, l_ptr, acc_ptr, out_ptr, T, splits, so_n, so_t, GROUP: tl.constexpr, KV_HEADS: tl.constexpr,
                 HD: tl.constexpr, BLOCK_Q: tl.constexpr):
        """The splits' partial attentions of one row's kv head (`_attention`'s PARTIAL) made one, into the output."""
        pid = tl.program_id(0)
        row, kvh = pid // KV_HEADS, pid % KV_HEADS
        rq, rd = tl.arange(0, BLOCK_Q), tl.arange(0, HD)
        g, j = rq // T, rq % T
        live = rq < GROUP * T
        top = tl.full((BLOCK_Q,), float("-inf"), dtype=tl.float32)
        total = tl.zeros((BLOCK_Q,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_Q, HD), dtype=tl.float32)
        for split in range(0, splits):
            at = (pid * splits + split) * BLOCK_Q + rq
            its_top = tl.load(m_ptr + at)
            new_top = tl.maximum(top, its_top)
            shift = tl.where(new_top == float("-inf"), 0.0, new_top)
            kept, its = tl.exp(top - shift), tl.exp(its_top - shift)
            total = total * kept + tl.load(l_ptr + at) * its
            acc = acc * kept[:, None] + tl.load(acc_ptr + at[:, None] * HD + rd[None, :]) * its[:, None]
            top = new_top
        head = kvh * GROUP + g
        tl.store(out_ptr + row * so_n + j[:, None] * so_t + head[:, None] * HD + rd[None, :],
                 (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=live[:, None])


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
    block_m, block_n, block_k, warps = tile(m, n, x.device, x.element_size())
    _product[(triton.cdiv(n, block_n),)](
        x, w, out, w if ln is None else ln, w if bias is None else bias, res, m, n, k, eps, x.stride(0), w.stride(0),
        out.stride(0), res.stride(0), BEFORE=before, BIAS=bias is not None, RESIDUAL=residual is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
    return out.view(*lead, n)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
           splits: int | None = None) -> torch.Tensor:
    """llama's `_attend` under its causal mask in one kernel (two where the slots are split): q [n, heads, t, hd]
    over a window's keys and values [n, kv_heads, s, hd] (any strides but the last), query j of row i seeing
    slots 0..positions[i, j]; -> [n, t, heads * hd]. A program takes a row's kv head, its query heads' tokens
    stacked (each slot read once), and `splits` chunks of the slots (default: enough for WAVES programs per
    multiprocessor, each over at least SPLIT_SLOTS slots), whose partial results a second kernel combines."""
    n, heads, t, hd = q.shape
    kv_heads, s = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    assert heads == group * kv_heads and hd & (hd - 1) == 0 and hd >= 16 and positions.shape == (n, t)
    assert q.stride(-1) == keys.stride(-1) == values.stride(-1) == 1 and keys.dtype == values.dtype == q.dtype
    block_q = max(16, 1 << (group * t - 1).bit_length())
    block_s = 64 if hd <= 64 else 32
    programs = n * kv_heads
    if splits is None:
        splits = max(1, min(triton.cdiv(s, SPLIT_SLOTS), triton.cdiv(WAVES * multiprocessors(q.device), programs)))
    chunk = triton.cdiv(triton.cdiv(s, splits), block_s) * block_s
    splits = triton.cdiv(s, chunk)
    out = torch.empty((n, t, heads * hd), dtype=q.dtype, device=q.device)
    positions = positions.to(torch.int64)
    partial = splits > 1
    parts = [torch.empty(programs * splits * block_q * size, dtype=torch.float32, device=q.device)
             for size in (1, 1, hd)] if partial else [out] * 3  # (no partial results: never written)
    args = (q.stride(0), q.stride(1), q.stride(2), *keys.stride()[:3], *values.stride()[:3], positions.stride(0),
            out.stride(0), out.stride(1))
    _attention[(programs, splits)](
        q, keys, values, positions, out, *parts, t, s, chunk, hd ** -0.5, *args, GROUP=group, KV_HEADS=kv_heads, HD=hd,
        IEEE=q.dtype == torch.float32, PARTIAL=partial, BLOCK_Q=block_q, BLOCK_S=block_s, num_warps=4)
    if partial:
        _combine[(programs,)](*parts, out, t, splits, out.stride(0), out.stride(1), GROUP=group, KV_HEADS=kv_heads,
                              HD=hd, BLOCK_Q=block_q, num_warps=4)
    return out


def token_offsets(at: tuple, keys: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Where `put` writes a forward's tokens at index `at` of a layer's keys (values): each token's element offset
    [n * t] (int64), and the stride between kv heads (the dim `at` slices, or the one after it)."""
    offsets, head = 0, len(at)
    for dim, index in enumerate(at):
        if isinstance(index, torch.Tensor):
            offsets = offsets + index * keys.stride(dim)
        elif head == len(at):
            head = dim
    return offsets.reshape(-1).contiguous(), keys.stride(head)


def qkv_rope(x: torch.Tensor, layer: llama.Layer, eps: float, cos: torch.Tensor, sin: torch.Tensor, heads: int,
             kv_heads: int, head_dim: int, keys: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor,
             head_stride: int) -> torch.Tensor:
    """llama's `_first` in one kernel: over x [n, t, d] (n * t <= MAX_TOKENS) and RoPE's cos, sin [n, 1, t, hd] at
    the tokens' positions, k and v written into the layer's `keys` and `values` at `offsets` (`token_offsets`);
    returns q [n, heads, t, hd]."""
    n, t, d = x.shape
    m = n * t
    x2, (cos2, sin2) = x.reshape(m, d), (c.reshape(m, head_dim) for c in (cos, sin))
    assert m <= MAX_TOKENS and x2.stride(1) == 1 and cos2.stride() == sin2.stride() and cos2.stride(1) == 1
    assert keys.dtype == values.dtype == x.dtype and keys.stride(-1) == values.stride(-1) == 1 and head_dim % 2 == 0
    q = torch.empty((n, heads, t, head_dim), dtype=x.dtype, device=x.device)
    block_m, block_n, block_k, warps = tile(m, layer.qkv.shape[0], x.device, x.element_size())
    pairs = head_dim // 2
    block_p = min(block_n // 2, pairs & -pairs)  # as many weight rows as `product`'s, dividing a head's pairs
    bias = layer.qkv_bias
    _qkv_rope[((heads + 2 * kv_heads) * (pairs // block_p),)](
        x2, layer.qkv, layer.ln1, layer.qkv if bias is None else bias, cos2, sin2, q, keys, values, offsets, m, d, t,
        eps, x2.stride(0), layer.qkv.stride(0), cos2.stride(0), head_stride, HEADS=heads, KV_HEADS=kv_heads,
        HD=head_dim, BIAS=bias is not None, BLOCK_M=block_m, BLOCK_P=block_p, BLOCK_K=block_k, num_warps=warps)
    return q


def pieces(norm: Callable = llama.rms_norm) -> llama.Pieces:
    """What a step of at most MAX_TOKENS tokens runs with the fused kernels (`llama.Pieces`): a layer's start in one
    (`qkv_rope`), its attention in one (`attend`, where the cache's view has none of its own), its o_proj with the
    residual, gate/up with the norm before it and down with SwiGLU before it and the residual after it (`product`),
    and the final `norm` (compiled where the caller compiles). Not for a layer whose partial products are summed
    over ranks (`Layer.reduce`)."""
    kept: dict = {}  # the forward's `at` and where its tokens lie in a layer's cache (every layer writes there)

    def first(x, layer, cos, sin, heads, kv_heads, head_dim, eps, keys, values, at):
        if kept.get("at") is not at:
            kept["at"], kept["offsets"] = at, token_offsets(at, keys)
        return qkv_rope(x, layer, eps, cos, sin, heads, kv_heads, head_dim, keys, values, *kept["offsets"])

    def layer_out(x, layer, o, eps):
        x = product(o, layer.o, residual=x)
        return product(product(x, layer.gate_up, NORM, layer.ln2, eps), layer.down, SWIGLU, residual=x)

    def between(x, o, layer, following, cos, sin, heads, kv_heads, head_dim, eps, keys, values, at):
        x = layer_out(x, layer, o, eps)
        return x, first(x, following, cos, sin, heads, kv_heads, head_dim, eps, keys, values, at)

    def last(x, o, layer, final, eps):
        return norm(layer_out(x, layer, o, eps), final, eps)

    def attention(q, keys, values, positions):
        return attend(q, keys, values, positions)

    return llama.Pieces(first, between, last, attention)
