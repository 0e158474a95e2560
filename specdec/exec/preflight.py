"""The engine's side of a node's preflight (`specbatch check`): the target's one step on each path it can
run (eager, compiled layer, CUDA graph), compared with eager's logits; the GPU memory plan's fit; for a
tensor-parallel target, one lock-step call of the group and its all-reduce bandwidth.

Each check is a dict: `check` (its name), `result` (what it found, in words) and `ok` (True, False, or
None where it does not apply here, e.g. a GPU-only path on CPU: "n/a (no GPU)").
"""

from __future__ import annotations

import time

import torch

from . import llama, memory
from .cache import RaggedKVCache
from .graphs import compiled_pieces
from .runner import ModelRunner, mismatch

NO_GPU = "n/a (no GPU)"


def row(check: str, result: str, ok: bool | None) -> dict:
    return {"check": check, "result": result, "ok": ok}


def engine_checks(engine) -> list[dict]:
    """Device, dtype, memory fit, and the steps' checks of `engine`'s target."""
    target = engine.target
    dtype = next(target.parameters()).dtype
    out = [row("dtype", f"{dtype}".removeprefix("torch."), True), memory_fit(engine)]
    if engine.pair.tp is not None:
        return out + group_checks(engine)
    return out + step_paths(engine)


def memory_fit(engine) -> dict:
    """Whether the weights leave room for a batch, by the job's memory plan (specdec/exec/memory.py)."""
    plan = engine.memory_plan()
    if plan is None:
        return row("memory plan", NO_GPU, None)
    slots = engine.row_tokens(1)
    fit = memory.largest(lambda r: plan.fits(plan.need(r, engine.alloc_len(slots), r, slots, 1)), 1 << 16)
    text = (f"{plan.used / memory.GiB:.1f} GiB in use (weights) of {plan.total / memory.GiB:.1f} GiB; budget "
            f"{max(plan.budget, 0) / memory.GiB:.2f} GiB (KV caches, captured steps, activations): {fit} rows of a "
            f"1-token prompt + max_new_tokens fit (batch_size {engine.batch_size})")
    return row("memory plan", text, fit >= 1)


def _inputs(vocab: int, device, rows: int = 2, prefix: int = 12, width: int = 4):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (rows, prefix + width), generator=g).to(device)
    positions = torch.arange(prefix, prefix + width, device=device)[None].expand(rows, width)
    return tokens[:, :prefix], tokens[:, prefix:], positions


def _timed(fn, device) -> tuple[object, float]:
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - t0


def step_paths(engine) -> list[dict]:
    """One prefill and one 4-token step of 2 rows on each path, each on its own cache; a fast path's step
    (the second of its shape, after its own first-step check) is compared with eager's logits."""
    target, device = engine.target, engine.device
    if not engine.fast_path or llama.unsupported(target) is not None:
        why = "fast path off" if not engine.fast_path else llama.unsupported(target)
        return [row("step: eager (generic)", "runs", True),
                row("step: compiled", f"n/a ({why})", None), row("step: graph", f"n/a ({why})", None)]
    head = engine.output_head("target")
    prefix, step, positions = _inputs(engine.vocab_size, device)
    cuda = device.type == "cuda"

    def run(graphs: bool, compiled: bool):
        runner = ModelRunner(target, RaggedKVCache(target, 2, 130), *head, graphs=graphs)
        runner.pieces = compiled_pieces() if compiled else llama.EAGER
        runner.prefill(prefix, 0, 2)
        for _ in range(2):  # the first call of a shape is checked (and may fall back), the second is the path's own
            (logits, _), seconds = _timed(lambda: runner.step(step, positions, 16), device)
        return runner, logits.float().clone(), seconds

    out = []
    with torch.inference_mode():
        try:
            _, ref, seconds = run(False, False)
        except Exception as exc:  # noqa: BLE001 - the check reports whatever failed
            return [row("step: eager", f"failed: {type(exc).__name__}: {exc}", False)]
        finite = bool(torch.isfinite(ref).all())
        out.append(row("step: eager", f"{seconds * 1e3:.1f} ms" + ("" if finite else "; non-finite logits"), finite))
        for name, graphs, compiled in (("compiled", False, True), ("graph", True, True)):
            if not cuda:
                out.append(row(f"step: {name}", NO_GPU, None))
                continue
            try:
                runner, logits, seconds = run(graphs, compiled)
            except Exception as exc:  # noqa: BLE001
                out.append(row(f"step: {name}", f"failed: {type(exc).__name__}: {exc}", False))
                continue
            why = next(iter(runner.eager.values()), None) or mismatch(logits, ref)
            out.append(row(f"step: {name}", f"falls back to eager: {why}" if why else
                           f"{seconds * 1e3:.1f} ms, matches eager", why is None))
    return out


def group_checks(engine, mib: int = 64) -> list[dict]:
    """A tensor-parallel target: one prefill and step of the whole group in lock-step (finite logits), and
    the all-reduce's bus bandwidth over `mib` MiB in the model's dtype."""
    tp = engine.pair.tp
    world, device = tp.group.world, engine.device
    prefix, step, positions = _inputs(engine.vocab_size, device)
    with torch.inference_mode():
        try:
            engine.hold(memory.Caches(2, 130))
            runner = engine.runner("target")
            runner.prefill(prefix, 0, 2)
            (logits, _), seconds = _timed(lambda: runner.step(step, positions, 16), device)
            finite = bool(torch.isfinite(logits).all())
            out = [row(f"lock-step call ({world} ranks)", f"{seconds * 1e3:.1f} ms"
                       + ("" if finite else "; non-finite logits"), finite)]
            dtype = next(engine.target.parameters()).dtype
            seconds, right = runner.call("all_reduce_probe", mib << 20, dtype)
        except Exception as exc:  # noqa: BLE001 - a broken group is the check's finding
            return [row(f"lock-step call ({world} ranks)", f"failed: {type(exc).__name__}: {exc}", False)]
    bus = 2 * (world - 1) / world * (mib << 20) / seconds / 1e9
    out.append(row("all-reduce", f"{mib} MiB of {str(dtype).removeprefix('torch.')}: {seconds * 1e3:.2f} ms, "
                   f"{bus:.2f} GB/s bus bandwidth" + ("" if right else "; WRONG SUM"), right))
    return out
