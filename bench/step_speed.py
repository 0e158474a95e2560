"""Step speed: autoregressive tok/s through specdec's step paths and transformers' references, for the
SmolLM2 target and random-weight Llama-1B and Llama-8B shapes, at several batch sizes (GPU by default); on a
CPU, `small32k` (2 layers, 64 wide, 32k vocabulary) shows what a round costs beyond its matrix products.

    python bench/step_speed.py [--shapes smollm2,llama1b,llama8b] [--batches 1,8,32,64] [--max-new 128]
                              [--paths generic,fast,fast-uncompiled] [--hf eager,compiled] [--deadline 540]
                              [--kernels TOP]

Every row: one generate() of `batch` random prompts of `--prompt-len` tokens, `--max-new` new tokens each
(no stop tokens: every row runs to the limit), timed after an identical untimed run (compilation and
graph capture happen there). tok/s = generated tokens / wall time, prefill included. Paths:
- fast: the lean Llama forward, decoder layer compiled, every step a replayed CUDA graph (the engine's default on a GPU; on a CPU: the lean forward, eager);
- fast-serial: the same with rounds that do not overlap (`overlap=False`: each round waits for the one before to
  be read back and handled on the host);
- fast-uncompiled: the same without compiling the layer (on a GPU: what compilation adds);
- fast-compiled: the layer compiled on any device (on a CPU: what compiling would give there);
- fast-joins: fast over a job as jobs run: four prompts per row of the batch (the batch's own, rotated), each row
  its own max_new_tokens (a quarter of `--max-new` to all of it), so that rows end at different rounds and queued
  ones join, their prefill's tail in a round's forward (not a captured step: on a GPU through the compiled
  pieces); tok/s against `fast` says what joining rows cost; fast-joins-eager: the same with those
  forwards eager (`ModelRunner.compile_prefills = False`);
- fast-gemv: fast with the matrix products of steps of up to 8 tokens through bench/gemv.py's Triton kernel
  instead of cuBLAS (a custom op inside the compiled pieces; on a CPU interpreted: a check, not a speed); batches
  of up to 8 rows only (beyond, it is fast);
- fast-fused: fast with the steps of up to 8 tokens through specdec/exec/fused.py's kernels (each matrix product
  with the norm or SwiGLU before it and the bias and residual after it, q/k/v's with RoPE and the cache writes,
  the attention masking by positions: 5 kernels a layer where the compiled pieces and SDPA launch ~10;
  `ModelRunner.fuse_products`);
  batches of up to 8 rows only;
- fast-paged / fast-paged-flex: fast over a paged KV cache (rows' blocks from a pool), its captured steps (a GPU's)
  attending over the blocks gathered / with FlexAttention over the pool in place (`paged_attention`), equal rows;
  a block size after either (fast-paged-flex128): blocks of that many slots (`kv_block`; default 16);
- generic: transformers' own modules over the same ragged cache, eager (the engine before the fast path);
- hf eager / hf compiled: transformers' generate, dynamic cache / static cache + torch.compile.
`--target` loads the real SmolLM2 weights for the smollm2 shape (default: random weights of its shape).
The HBM roofline column is weight bytes / measured copy bandwidth: what one step reading every weight
once allows at batch 1 (each shape's header line: that step's milliseconds). `busy` (our paths, on a GPU): the
device's time on the rounds (CUDA events from each round's start to its read-back) over the wall time: 1 - busy is
the share of a step the device waits for the host; `round ms`: that device time a round (a step, here), prefills
left out: against the header's step, how far the step's kernels are from reading every weight once.
`--kernels TOP`: after each shape's first row (its first path at its first batch size; and fast-gemv's and
fast-fused's), one more
generate() under torch.profiler lists what its steps run: kernels per step, device ms per step, and the TOP kernels
by device time (on a CPU: ops by CPU time). Prints as it goes; stops starting new rows after --deadline seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from specdec.config import SamplingParams, SpecConfig  # noqa: E402
from specdec.engine import SpecEngine  # noqa: E402
from specdec.exec.models import ModelPair  # noqa: E402
from specdec.exec import fused  # noqa: E402
from specdec.exec.runner import ModelRunner  # noqa: E402

SHAPES = {  # LlamaConfig fields of each shape
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0,
                    max_position_embeddings=8192),
    "llama1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                    num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
                    max_position_embeddings=8192),
    "small32k": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=32000, tie_word_embeddings=True, max_position_embeddings=1024),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=96, tie_word_embeddings=True, max_position_embeddings=1024),
    "llama8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0,
                    max_position_embeddings=8192),
}


def log(out, line: str) -> None:
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


def environment() -> str:
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
    except OSError:
        smi = "no nvidia-smi"
    import transformers
    return (f"# {smi}; torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}, "
            f"python {sys.version.split()[0]}")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def copy_bandwidth(device) -> float:
    """Device-to-device copy, bytes read + written per second (the HBM roofline's bandwidth); 1 GiB on a GPU,
    64 MiB on a CPU (a check of the script there)."""
    x = torch.empty(1 << 30 if device.type == "cuda" else 1 << 26, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    sync()
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    sync()
    bw = 2 * x.numel() * 10 / (time.perf_counter() - t)
    del x, y
    return bw


def random_model(shape: str, device, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(**SHAPES[shape], bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(cfg, dtype=dtype)
    return model.eval().requires_grad_(False)


def real_target(device, dtype_name: str):
    from engine_speed import TARGET

    from specdec.exec.models import load_model
    from workers.fetch import localize
    return load_model(localize(TARGET.model_copy(update={"dtype": dtype_name})), device)


def timed(fn) -> float:
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t


def engine_tok_s(model, path: str, batch: int, prompts, max_new: int, kernels: int = 0,
                 ) -> tuple[float, float, str, tuple[float, float] | None, list[str]]:
    """(tok/s, seconds of the untimed first run: compilation and capture, the engine's step path, the device's
    busy fraction and milliseconds a round: None off CUDA, and with `kernels` the top kernels of its steps:
    `kernel_table`) of `method: none` on a path."""
    ModelRunner.compile_layers = {"fast-uncompiled": False, "fast-compiled": True}.get(path)
    ModelRunner.compile_prefills = path != "fast-joins-eager"
    ModelRunner.fuse_products = path == "fast-fused"
    paged = re.fullmatch(r"fast-paged(-flex)?(\d*)", path)
    params = None
    if path.startswith("fast-joins"):  # rows that end at different rounds, and queued ones that join
        g = torch.Generator().manual_seed(2)
        prompts = [p[j:] + p[:j] for j in (0, 1, 2, 3) for p in prompts]
        params = [SamplingParams(max_new_tokens=int(m))
                  for m in torch.randint(max(1, max_new // 4), max_new + 1, (len(prompts),), generator=g)]
    if path == "fast-gemv":  # the matrix products of steps of up to 8 tokens through bench/gemv.py's kernel
        import gemv
        products = gemv.use_gemv()
    else:
        products = contextlib.nullcontext()
    with products:
        eng = SpecEngine(ModelPair(model, None, None, (), model.config.vocab_size),
                         SamplingParams(max_new_tokens=max_new), SpecConfig(method="none"), batch_size=batch,
                         fast_path=path != "generic", overlap=path != "fast-serial",
                         kv_cache="paged" if paged else "dense", paged_attention="flex" if paged and paged[1] else
                         "gather", kv_block=int(paged[2]) if paged and paged[2] else 16)
        first = timed(lambda: eng.generate(prompts, params=params))
        eng.context.staging.device_s, before = 0.0, eng.context.staging.rounds
        wall = timed(lambda: eng.generate(prompts, params=params))
        ModelRunner.compile_layers, ModelRunner.compile_prefills, ModelRunner.fuse_products = None, True, False
        device_s, rounds = eng.context.staging.device_s, max(1, eng.context.staging.rounds - before)
        busy = (device_s / wall, device_s / rounds * 1e3) if model.device.type == "cuda" else None
        table = kernel_table(eng, prompts, kernels) if kernels else []
    tokens = batch * max_new if params is None else sum(p.max_new_tokens for p in params)
    return tokens / wall, first, eng.step_path, busy, table


def kernel_table(eng: SpecEngine, prompts, top: int) -> list[str]:
    """What a warm engine's steps run on the device, from one generate() under torch.profiler: kernels per step
    and device ms per step, then the `top` kernels by device time, each with its share, calls per step and mean
    microseconds (on a CPU: its ops, by their own CPU time)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = eng.device.type == "cuda"
    before = eng.context.staging.rounds
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        eng.generate(prompts)
        sync()
    steps = max(1, eng.context.staging.rounds - before)
    ran = [e for e in prof.key_averages() if (e.device_type == DeviceType.CUDA) == cuda]
    us = {e.key: e.device_time_total if cuda else e.self_cpu_time_total for e in ran}
    ran = sorted((e for e in ran if us[e.key] > 0), key=lambda e: -us[e.key])
    total = sum(us.values()) or 1.0
    lines = [f"# {'kernels' if cuda else 'ops'} per step {sum(e.count for e in ran) / steps:.0f}, "
             f"{total / 1e3 / steps:.3f} ms per step ({steps} steps); the top {top}:",
             f"#   {'share':>5s} {'per step':>8s} {'mean us':>8s}  name"]
    lines += [f"#   {us[e.key] / total:5.2f} {e.count / steps:8.1f} {us[e.key] / e.count:8.1f}  {e.key[:100]}"
              for e in ran[:top]]
    return lines


def hf_tok_s(model, kind: str, batch: int, prompts, max_new: int) -> tuple[float, float]:
    ids = torch.tensor(prompts, device=model.device)
    kw = dict(max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, pad_token_id=0,
              attention_mask=torch.ones_like(ids))
    if kind == "compiled":
        kw["cache_implementation"] = "static"  # transformers compiles the step itself (reduce-overhead)
    first = timed(lambda: model.generate(ids, **kw))
    wall = timed(lambda: model.generate(ids, **kw))
    return batch * max_new / wall, first


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="smollm2,llama1b,llama8b")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--paths", default="generic,fast,fast-uncompiled")
    ap.add_argument("--hf", default="eager,compiled", help="transformers references (batch 1 and 8 only)")
    ap.add_argument("--hf-batches", default="1")
    ap.add_argument("--generic-batches", default="1,8", help="the generic path is slow: only these batches")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--target", action="store_true", help="real SmolLM2 weights for the smollm2 shape")
    ap.add_argument("--deadline", type=float, default=540.0, help="seconds after which no new row starts")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu (the real target, or small32k / tiny)")
    ap.add_argument("--out", default=None, help="also append every line to this file")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--kernels", type=int, default=0,
                    help="after each shape's first path at its first batch size, list its steps' top kernels")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    bw = copy_bandwidth(device)
    log(args.out, environment())
    log(args.out, f"# {args.prompt_len}-token random prompts, {args.max_new} new tokens per row, greedy, {args.dtype}; "
                  f"copy bandwidth {bw / 1e12:.2f} TB/s")
    log(args.out, f"{'shape':8s} {'path':17s} {'batch':>5s} {'tok/s':>9s} {'of roofline':>11s} "
                  f"{'first run s':>11s} {'busy':>5s} {'round ms':>8s}  step path")
    for shape in args.shapes.split(","):
        if time.perf_counter() - start > args.deadline:
            break
        model = real_target(device, args.dtype) if shape == "smollm2" and args.target else random_model(shape, device, dtype)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        roof = bw / weight_bytes  # steps per second reading every weight once (bw counts bytes read + written)
        log(args.out, f"# {shape}: {weight_bytes / 1e9:.2f} GB of weights, a step reading them once {1e3 / roof:.3f} ms")
        g = torch.Generator().manual_seed(1)
        batches = [int(b) for b in args.batches.split(",")]
        prompts = {b: torch.randint(0, model.config.vocab_size, (b, args.prompt_len), generator=g).tolist()
                   for b in batches}
        # each path over every batch size before the next path, transformers' references last: a deadline cuts
        # the references, not our own figures
        most = {"fast-fused": fused.MAX_TOKENS}  # only batches whose steps take the kernels (beyond, it is fast)
        if "fast-gemv" in args.paths.split(","):
            import gemv  # (here, not at the top: it imports this module)
            most["fast-gemv"] = gemv.MAX_ROWS
        rows = [(p, "engine", b) for p in args.paths.split(",") if p for b in batches
                if (p != "generic" or str(b) in args.generic_batches.split(",")) and b <= most.get(p, b)]
        rows += [(f"hf {k}", "hf", b) for k in args.hf.split(",") if k for b in batches
                 if str(b) in args.hf_batches.split(",")]
        got: dict[tuple[str, int], float] = {}
        for name, kind, batch in rows:
            if time.perf_counter() - start > args.deadline:
                log(args.out, f"# deadline: stopped before {shape} {name} batch {batch}")
                break
            try:
                if kind == "engine":
                    first_row = (name, batch) == rows[0][::2] or (name in most and batch == batches[0])
                    profiled = args.kernels if first_row else 0
                    tok_s, first, step_path, busy, table = engine_tok_s(model, name, batch, prompts[batch],
                                                                        args.max_new, profiled)
                else:
                    (tok_s, first), step_path, busy, table = hf_tok_s(model, name.split()[1], batch, prompts[batch],
                                                                      args.max_new), "", None, []
            except Exception as exc:  # a reference that fails here is reported, not fatal
                log(args.out, f"{shape:8s} {name:17s} {batch:5d} failed: {type(exc).__name__}: {exc}"[:400])
                continue
            got[name, batch] = tok_s
            rl = f"{tok_s / roof:.2f}" if batch == 1 else "-"
            bz, ms = ("-", "-") if busy is None else (f"{busy[0]:.2f}", f"{busy[1]:.3f}")
            log(args.out, f"{shape:8s} {name:17s} {batch:5d} {tok_s:9.1f} {rl:>11s} {first:11.1f} {bz:>5s} {ms:>8s}  "
                          f"{step_path}")
            for line in table:
                log(args.out, line)
        for (name, batch), tok_s in got.items():  # ratios, once every row of the shape has run
            refs = [(r, got[r, batch]) for r in ("fast", "fast-serial", "fast-joins", "fast-joins-eager", "generic",
                                                   "hf eager", "hf compiled")
                    if (r, batch) in got and r != name]
            if refs and not name.startswith("hf"):
                log(args.out, f"# {shape} {name} batch {batch}: " +
                    ", ".join(f"{tok_s / v:.2f}x {r}" for r, v in refs))
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    from torch._dynamo.utils import counters
    log(args.out, f"# {time.perf_counter() - start:.0f} s; compiled graphs in the process: "
                  f"{counters['stats'].get('unique_graphs', 0)}")


if __name__ == "__main__":
    main()
