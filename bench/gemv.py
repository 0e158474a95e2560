"""The decoder's matrix products at decode shapes (a few rows against a weight matrix): cuBLAS (F.linear, what every
step runs today) against a Triton kernel that streams the weight once with fp32 sums, at each linear of a model
shape. On an H200 a batch-1 step of the Llama-8B shape ran at 0.64 of the copy-bandwidth roofline with the device
busy 0.99 of the time (bench/results/gpu-2026-11-28/): what is left is inside the step's kernels, and these
products read almost all of its bytes. Peers report cuBLAS's M=1 kernels (split-K, tensor-core tiles padded to 16
rows) at 64-75% of HBM, and custom GEMV kernels 25-44% faster on small and medium matrices.

    python bench/gemv.py [--device cuda] [--shapes llama8b,smollm2] [--rows 1,8] [--dtype bfloat16]
                         [--configs 16x256x4,...,s16x256x4,d64x128x4] [--deadline 0] [--out FILE]

Per (shape, linear, rows): µs a call of cuBLAS, of specdec/exec/fused.py's product in the tile the engine takes for
it (`fused.tile`: `fused`) and of each Triton config (BLOCK_N x BLOCK_K x warps: float32 products added up over the
K loop and summed after it, as the engine's; `s`: summed at every K step instead; `d`: x's rows in a 16-row tile
through tensor cores, `tl.dot`), the best kernel's ratio to cuBLAS and each one's effective bandwidth (weight
bytes / time) as a share of the measured copy bandwidth. Timed on a GPU as one CUDA graph of calls over enough
copies of the weight that none is read from L2 (as in a step, where the other layers' weights come between); every
kernel's output is checked against float32 first (`err`: the kernels' largest relative error / cuBLAS's). Where no
GPU is, the same table comes from eager calls and Triton's interpreter (`TRITON_INTERPRET=1` is set before triton is
imported): a check of the script and the kernel's outputs, not a timing (`--shapes tiny`; its bfloat16 `tl.dot` is
wrong there: `--dtype float16` checks the `d` configs); without triton the kernels' columns say so.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import types

import torch
import torch.nn.functional as F

if not torch.cuda.is_available() and "triton" not in sys.modules:  # (before step_speed: specdec imports triton)
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernel runs on CPU tensors, interpreted
# (a triton imported before without it, by transformers say, cannot interpret: set it in the environment)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
sys.path.insert(0, os.path.dirname(__file__))
from step_speed import SHAPES, copy_bandwidth, environment, log  # noqa: E402

from specdec.exec import fused  # noqa: E402
try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU image of CI has no triton: the bench says so and times cuBLAS alone
    triton = None


if triton is not None:
    @triton.jit
    def _gemv(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr,
              LATE: tl.constexpr):
        """out[m, n] = sum_k x[m, k] w[n, k] for BLOCK_N output columns a program, the weight's rows streamed
        once (evicted first: no other program reads them), x's rows re-read from L2, sums in float32: of the
        products, added up elementwise over the K loop and summed once after it (LATE, as specdec/exec/fused.py's
        products) or summed at every K step (the warps exchange partial sums between loads), or with DOT one
        tensor-core tl.dot per K step (BLOCK_M at least 16: x's rows padded)."""
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if LATE and not DOT:
            terms = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            w = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K),
                        other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K),
                        other=0.0)
            if DOT:
                acc += tl.dot(x, tl.trans(w))
            elif LATE:
                terms += tl.expand_dims(x.to(tl.float32), 1) * tl.expand_dims(w.to(tl.float32), 0)
            else:
                acc += tl.sum(tl.expand_dims(x.to(tl.float32), 1) * tl.expand_dims(w.to(tl.float32), 0), axis=2)
        if LATE and not DOT:
            acc = tl.sum(terms, axis=2)
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))


def _launch(kernel, x: torch.Tensor, w: torch.Tensor, block_m: int, block_n: int, block_k: int, warps: int,
            dot: bool = False, late: bool = True) -> torch.Tensor:
    """x [M, K] @ w [N, K].T: `_gemv` (or its traceable wrapper) launched over N in blocks of `block_n`."""
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    kernel[(triton.cdiv(n, block_n),)](x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0), BLOCK_M=block_m,
                                       BLOCK_N=block_n, BLOCK_K=block_k, DOT=dot, LATE=late,
                                       num_warps=warps)
    return out


def gemv(x: torch.Tensor, w: torch.Tensor, config: str) -> torch.Tensor:
    """x [M, K] @ w [N, K].T through a Triton kernel: config "NxKxW" (`_gemv`: BLOCK_N, BLOCK_K, warps; sums
    after the K loop), "sNxKxW" (sums at every K step) or "dNxKxW" (through tensor cores, x's rows in a 16-row
    tile)."""
    form = config[0] if config[0] in "sd" else ""
    block_n, block_k, warps = map(int, config.removeprefix(form).split("x"))
    block_m = 16 if form == "d" else max(1, triton.next_power_of_2(x.shape[0]))
    return _launch(_gemv, x, w, block_m, block_n, block_k, warps, dot=form == "d", late=form != "s")


MAX_ROWS = fused.MAX_TOKENS  # steps of up to this many tokens (rows x width) take the kernel in `use_gemv`

if triton is not None:
    from torch.library import triton_op, wrap_triton

    @triton_op("specbatch_bench::gemv", mutates_args={})
    def gemv_op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [M, K] @ w [N, K].T for M <= MAX_ROWS, as a custom op that torch.compile keeps whole (the compiled
        pieces call it where they called cuBLAS)."""
        kernel = wrap_triton(_gemv) if x.device.type == "cuda" else _gemv  # (traced, or interpreted eagerly)
        return _launch(kernel, x, w, *fused.tile(x.shape[0], w.shape[0], x.device, x.element_size()))


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through the Triton kernel where a step's tokens are few (at most MAX_ROWS), the weight's rows
    contiguous and there is no bias; on a CPU only under Triton's interpreter (a check, not a speed)."""
    k = x.shape[-1]
    if (triton is None or bias is not None or x.dtype != w.dtype or w.dim() != 2 or w.stride(1) != 1
            or x.numel() > MAX_ROWS * k or (x.device.type != "cuda" and not INTERPRETED)):
        return F.linear(x, w, bias)
    return gemv_op(x.reshape(-1, k).contiguous(), w).view(*x.shape[:-1], w.shape[0])


@contextlib.contextmanager
def use_gemv():
    """The engine's matrix products (the lean layer's four and the output head: specdec/exec/llama.py and
    runner.py) through `linear` while inside: their modules see an `F` whose `linear` is it (compiled pieces guard
    on that global: they compile once more for it, and the code compiled without it serves again after)."""
    from specdec.exec import llama, runner

    shim = types.ModuleType("F_gemv")
    shim.__dict__.update(F.__dict__)
    shim.linear = linear
    saved = llama.F, runner.F
    llama.F = runner.F = shim
    try:
        yield
    finally:
        llama.F, runner.F = saved


def linears(shape: str) -> dict[str, tuple[int, int]]:
    """(out features, in features) of each weight matrix a step of the shape reads: the fused q/k/v, o, the fused
    gate/up, down (as the lean forward fuses them, specdec/exec/llama.py) and the output head."""
    c = SHAPES[shape]
    d, heads, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    hd = d // heads
    return {"qkv": ((heads + 2 * kv) * hd, d), "o": (d, d), "gate_up": (2 * c["intermediate_size"], d),
            "down": (d, c["intermediate_size"]), "head": (c["vocab_size"], d)}


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def timed_us(fn, copies: list[torch.Tensor], x: torch.Tensor, calls: int) -> float:
    """µs a call of fn(x, w), as one CUDA graph of `calls` calls cycling through the weight's copies (the best of
    three replays); on a CPU, eager calls."""
    if x.device.type != "cuda":
        fn(x, copies[0])
        t = time.perf_counter()
        for i in range(calls):
            fn(x, copies[i % len(copies)])
        return (time.perf_counter() - t) * 1e6 / calls
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w in copies[:2]:
            fn(x, w)  # compiles, cuBLAS workspaces
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(x, copies[i % len(copies)])
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / calls)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", default="llama8b,smollm2")
    ap.add_argument("--rows", default="1,8", help="rows of x (the batch's tokens in a step)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--configs", default="16x256x4,8x256x4,4x256x4,8x128x4,s16x256x4,d64x128x4",
                    help="BLOCK_N x BLOCK_K x warps, each (s: sums at every K step; d: the tensor-core kernel)")
    ap.add_argument("--calls", type=int, default=40, help="calls a timed graph holds")
    ap.add_argument("--l2-bytes", type=float, default=256e6, help="weight copies to cycle through: at least this")
    ap.add_argument("--deadline", type=float, default=0, help="seconds after which no new case starts (0: none)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.out:
        open(args.out, "w").close()
    t0 = time.perf_counter()
    dtype = getattr(torch, args.dtype)
    configs = args.configs.split(",")
    cuda = args.device.startswith("cuda")
    log(args.out, environment())
    if triton is None:
        log(args.out, "# no triton here: cuBLAS alone")
    bw = copy_bandwidth(torch.device(args.device))
    how = f"one CUDA graph of {args.calls} calls" if cuda else "eager calls, Triton interpreted: not a timing"
    log(args.out, f"# {args.dtype}; copy bandwidth {bw / 1e12:.2f} TB/s; each case {how} over >= "
                  f"{args.l2_bytes / 1e6:.0f} MB of weight copies; us a call (share of copy bandwidth)")
    kernels = {"fused": lambda a, b: fused.product(a, b)} | {c: lambda a, b, c=c: gemv(a, b, c) for c in configs}
    names = " ".join(f"{c:>17s}" for c in kernels)
    log(args.out, f"{'shape':8s} {'linear':8s} {'N x K':>13s} {'M':>3s} {'cublas':>17s} {names}  best/cublas  err")
    for shape in args.shapes.split(","):
        for name, (n, k) in linears(shape).items():
            nbytes = n * k * dtype.itemsize
            copies = [torch.randn(n, k, device=args.device, dtype=dtype) * 0.02
                      for _ in range(max(2, int(args.l2_bytes // nbytes) + 1) if cuda else 2)]
            for m in map(int, args.rows.split(",")):
                if args.deadline and time.perf_counter() - t0 > args.deadline:
                    log(args.out, f"# deadline: stopped before {shape} {name} M={m}")
                    return
                x = torch.randn(m, k, device=args.device, dtype=dtype)
                ref = x.float() @ copies[0].float().T
                errs = [rel_err(F.linear(x, copies[0]), ref)]
                cells, times = [], []
                for fn in [F.linear, *kernels.values()]:
                    if fn is not F.linear and triton is None:
                        cells.append("no triton")
                        times.append(float("inf"))
                        continue
                    try:
                        if fn is not F.linear:
                            errs.append(rel_err(fn(x, copies[0]), ref))
                        us = timed_us(fn, copies, x, args.calls)
                        cells.append(f"{us:8.1f} ({nbytes / (us * 1e-6) / bw:.2f})")
                        times.append(us)
                    except Exception as exc:  # a config the device cannot run: say so, go on
                        cells.append(f"{type(exc).__name__[:17]:>17s}")
                        log(args.out, f"# {shape} {name} M={m}: {exc!r}"[:300])
                        times.append(float("inf"))
                best = min(times[1:], default=float("inf"))
                ratio = f"{times[0] / best:.2f}x" if best < float("inf") else "-"
                log(args.out, f"{shape:8s} {name:8s} {f'{n}x{k}':>13s} {m:3d} {' '.join(f'{c:>17s}' for c in cells)}"
                              f"  {ratio:>11s}  {f'{max(errs[1:]):.1e}' if errs[1:] else '-'}/{errs[0]:.1e}")
            del copies
            if cuda:
                torch.cuda.empty_cache()
    log(args.out, f"# {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
