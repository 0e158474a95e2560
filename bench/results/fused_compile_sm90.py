"""Compile specdec/exec/fused.py's kernels for an H100 / H200 (sm_90) where no GPU is: Triton's frontend, its passes
and its ptxas, as on the device; then each kernel's registers, stack (spills) and shared memory from cuobjdump, at
the Llama-8B and SmolLM2 shapes' q/k/v, bfloat16, for both tile configs. Needs triton (its wheel carries ptxas).

    python bench/results/fused_compile_sm90.py
"""

import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from specdec.exec import fused  # noqa: E402

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def usage(fn, signature: dict, constexprs: dict, warps: int) -> str:
    """The kernel compiled for sm_90: its cubin's REG / STACK / SHARED."""
    kernel = triton.compile(ASTSource(fn, signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": warps})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    return "registers {}, stack {}, shared {}".format(*re.search(r"REG:(\d+).*?STACK:(\d+).*?SHARED:(\d+)", out,
                                                                 re.S).groups())


def main():
    ptr, i32 = "*bf16", "i32"
    for before, bias, residual in ((fused.PLAIN, False, True), (fused.NORM, False, False), (fused.NORM, True, False),
                                   (fused.SWIGLU, False, True)):
        for block_m, (block_n, block_k, warps) in fused.CONFIGS.items():
            names = ("x_ptr", "w_ptr", "out_ptr", "ln_ptr", "bias_ptr", "res_ptr")
            sig = {**{n: ptr for n in names}, "M": i32, "N": i32, "K": i32, "eps": "fp32",
                   **{n: i32 for n in ("stride_x", "stride_w", "stride_o", "stride_r")}}
            consts = {"BEFORE": before, "BIAS": bias, "RESIDUAL": residual, "BLOCK_M": block_m, "BLOCK_N": block_n,
                      "BLOCK_K": block_k}
            print(f"product  before={before} bias={bias:d} residual={residual:d} BLOCK_M={block_m} warps={warps}: "
                  f"{usage(fused._product, {**sig, **{c: 'constexpr' for c in consts}}, consts, warps)}", flush=True)
    for shape, (heads, kv_heads, hd) in {"llama8b": (32, 8, 128), "smollm2": (9, 3, 64)}.items():
        for block_m, (block_n, block_k, warps) in fused.CONFIGS.items():
            names = ("x_ptr", "w_ptr", "ln_ptr", "bias_ptr", "cos_ptr", "sin_ptr", "q_ptr", "k_ptr", "v_ptr")
            sig = {**{n: ptr for n in names}, "off_ptr": "*i64", "M": i32, "K": i32, "T": i32, "eps": "fp32",
                   **{n: i32 for n in ("stride_x", "stride_w", "stride_rope", "head_stride")}}
            consts = {"HEADS": heads, "KV_HEADS": kv_heads, "HD": hd, "BIAS": False, "BLOCK_M": block_m,
                      "BLOCK_P": block_n // 2, "BLOCK_K": block_k}
            print(f"qkv_rope {shape} BLOCK_M={block_m} warps={warps}: "
                  f"{usage(fused._qkv_rope, {**sig, **{c: 'constexpr' for c in consts}}, consts, warps)}", flush=True)


if __name__ == "__main__":
    main()
