"""What specdec/exec/fused.py's kernels compile to on a GPU, read on a machine without one: each kernel a decode step
launches at a model shape, compiled by Triton for a target (default Hopper, sm_90) exactly as a launch would
specialise it, and described from its PTX and cubin: programs, warps, registers a thread, spilled bytes (stack),
shared memory, and the K loop's work per iteration (global loads of the weight and their width, barriers, warp
shuffles, shared-memory accesses). A check of structure before a lease, not a speed: a loop whose every step
synchronises the warps or spills cannot stream the weight at the memory's rate, whatever the GPU says later.
    pip install triton==3.6.0   # the GPU image's version (bench/gpu/image.txt); CPU installs lack it
    python bench/kernel_asm.py [--shapes llama8b,smollm2] [--tokens 1,8] [--dtype bfloat16] [--window 256]
                               [--target cuda:90:32] [--out FILE]
The wrappers (fused.product, fused.qkv_rope, fused.attend over a window of WINDOW slots) are called on CPU tensors of
the shape with the launch recorded instead of run (the attention's loop is over slots, its `w bytes` 0); Triton's own
specialisation (`native_specialize_impl`: 16-byte alignment, ints divisible by 16, ones as constants) makes the
signature.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from unittest.mock import patch

import torch

os.environ.pop("TRITON_INTERPRET", None)  # compiled, not interpreted (before anything imports triton)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_speed import SHAPES, log  # noqa: E402

try:
    import triton
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.compiler import ASTSource
except ImportError:
    sys.exit("bench/kernel_asm.py compiles with Triton: pip install triton==3.6.0 (the GPU image's version)")

from specdec.exec import fused, llama  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
SMS = {90: 132, 80: 108}  # streaming multiprocessors of an H100 / H200 SXM and an A100
WINDOW = 256  # the attention's slots: the kit's steps' (128-token prompts, 128 new tokens)


class Recorded:
    """Stands in for a kernel: `kernel[grid](*args, **kwargs)` appends (kernel, grid, args, kwargs) to `launches`
    instead of running it."""

    def __init__(self, kernel, launches: list):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.kernel, grid, args, kwargs))


STEPS = ("qkv_rope", "attention", "o (residual)", "gate_up (norm)", "down (swiglu, residual)")  # a layer's, in order


def launches(shape: str, tokens: int, dtype: torch.dtype, window: int = WINDOW) -> list[tuple[str, object, tuple,
                                                                                          tuple, dict]]:
    """(name, kernel, grid, args, kwargs) of a decode step's fused launches for one layer of `shape` with `tokens`
    tokens (rows x width) attending over `window` slots, from the wrappers themselves (`STEPS`; a window split over
    programs adds the attention's combining kernel after it)."""
    c = SHAPES[shape]
    d, inter, heads, kv = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"]
    hd = d // heads
    e = lambda *size: torch.empty(size, dtype=dtype)  # noqa: E731
    layer = llama.Layer(e(d), e((heads + 2 * kv) * hd, d), None, e(d, d), e(d), e(2 * inter, d), e(d, inter))
    x, o, h, cos = e(1, tokens, d), e(1, tokens, d), e(1, tokens, 2 * inter), e(1, 1, tokens, hd)
    keys, values = e(1, kv, window, hd), e(1, kv, window, hd)  # a dense cache's layer: [rows, kv_heads, slots, hd]
    at = (torch.zeros(1, 1, dtype=torch.long), slice(None), torch.arange(tokens)[None])  # as its view indexes it
    q, positions = e(1, heads, tokens, hd), torch.arange(tokens)[None]
    recorded: list = []
    with patch.object(fused, "_qkv_rope", Recorded(fused._qkv_rope, recorded)), \
            patch.object(fused, "_product", Recorded(fused._product, recorded)), \
            patch.object(fused, "_attention", Recorded(fused._attention, recorded)), \
            patch.object(fused, "_combine", Recorded(fused._combine, recorded)):
        fused.qkv_rope(x, layer, 1e-5, cos, cos, heads, kv, hd, keys, values, *fused.token_offsets(at, keys))
        fused.attend(q, keys, values, positions)
        fused.product(o, layer.o, residual=x)
        fused.product(x, layer.gate_up, fused.NORM, layer.ln2, 1e-5)
        fused.product(h, layer.down, fused.SWIGLU, residual=x)
    names = list(STEPS)
    if len(recorded) > len(STEPS):
        names.insert(2, "attention's combine")
    assert len(recorded) == len(names), recorded
    return [(name, *launch) for name, launch in zip(names, recorded)]


def compiled(kernel, args: tuple, kwargs: dict, target: GPUTarget):
    """The kernel compiled for `target` as a launch with these arguments specialises it."""
    kwargs = dict(kwargs)
    options = {key: kwargs.pop(key) for key in ("num_warps", "num_stages") if key in kwargs}
    names = kernel.arg_names
    values = dict(zip(names, args)) | kwargs
    signature, constants, attrs = {}, {}, {}
    for i, name in enumerate(names):
        if i in kernel.constexprs:
            signature[name], constants[name] = "constexpr", values[name]
            continue
        kind, spec = native_specialize_impl(BaseBackend, values[name], False, True, True)
        signature[name] = kind
        if kind == "constexpr":
            constants[name] = values[name]
        elif spec == "D":
            attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(kernel, signature, constants, attrs), target=target, options=options)


def describe(k) -> dict:
    """Registers, stack, shared memory and the K loop's instruction mix of a compiled kernel."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        usage = subprocess.run([os.path.join(BIN, "cuobjdump"), "--dump-resource-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
    loops = re.findall(r"(\$L__BB\d+_\d+):[^\n]*\n(.*?)@%p\d+ bra\s+\1;", k.asm["ptx"], re.S)
    body = max((b for _, b in loops), key=lambda b: b.count("evict_first"), default="")  # the weight's loop
    width = {"b16": 2, "b32": 4, "v2.b32": 8, "v4.b32": 16}
    ops = Counter()
    for op in re.findall(r"\b(ld\.global\S*|bar\.sync|shfl\.sync|ld\.shared|st\.shared)", body):
        if "evict_first" in op:
            ops["weight bytes"] += width.get(op.split(".", 1)[1].rsplit("cache_hint.", 1)[-1], 0)
            ops["weight loads"] += 1
        else:
            ops[op.split(".")[0] + "." + op.split(".")[1]] += 1
    return dict(regs=int(re.search(r"REG:(\d+)", usage).group(1)), stack=int(re.search(r"STACK:(\d+)", usage).group(1)),
                smem=k.metadata.shared, warps=k.metadata.num_warps, **ops)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="llama8b,smollm2")
    ap.add_argument("--tokens", default="1,8", help="a step's tokens (rows x width), at most fused.MAX_TOKENS")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--window", type=int, default=WINDOW, help="the attention's slots (long ones split over programs)")
    ap.add_argument("--target", default="cuda:90:32", help="backend:arch:warp size")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    backend, arch, warp = args.target.split(":")
    target = GPUTarget(backend, int(arch), int(warp))
    dtype = getattr(torch, args.dtype)
    log(args.out, f"# triton {triton.__version__}, target {args.target}; {args.dtype}; per program a K-loop step: "
                  f"the weight's bytes a thread loads (in how many loads), barriers, shuffles, shared-memory ops")
    log(args.out, f"{'shape':8s} {'tokens':>6s} {'kernel':24s} {'programs':>8s} {'/SM':>5s} {'warps':>5s} {'regs':>4s} "
                  f"{'stack':>5s} {'smem':>6s} {'w bytes':>7s} {'loads':>5s} {'bar':>4s} {'shfl':>5s} {'lds':>4s} "
                  f"{'sts':>4s}")
    for shape in args.shapes.split(","):
        for tokens in map(int, args.tokens.split(",")):
            for name, kernel, grid, a, kw in launches(shape, tokens, dtype, args.window):
                s = describe(compiled(kernel, a, kw, target))
                programs, sms = grid[0] * (grid[1] if len(grid) > 1 else 1), SMS.get(int(arch), 132)
                log(args.out, f"{shape:8s} {tokens:6d} {name:24s} {programs:8d} {programs / sms:5.1f} "
                              f"{s['warps']:5d} {s['regs']:4d} {s['stack']:5d} {s['smem']:6d} "
                              f"{s.get('weight bytes', 0):7d} {s.get('weight loads', 0):5d} {s.get('bar.sync', 0):4d} "
                              f"{s.get('shfl.sync', 0):5d} {s.get('ld.shared', 0):4d} {s.get('st.shared', 0):4d}")


if __name__ == "__main__":
    main()
