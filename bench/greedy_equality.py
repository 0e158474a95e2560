"""Greedy rows of the real pair against transformers' `generate` on the same device: the scenario in which an H200
once gave 0 of 8 rows equal at batch 8 (float32, 8 held-out chat prompts, an engine budget of 128 new tokens, 48
asked per row), at each batch size and method. A check for the GPU kit's second call (where the real target arrives),
not a timing: it prints, per method and batch size, how many rows equal transformers' tokens, the step path with the
largest relative error a fast step's first run had against eager's (a fault the check's tolerance lets through shows
there) and, for each other row, the first token where it parts with transformers' logit margin there (its token's
logit minus ours, and its top-2 gap, float32: a near-tie parts rows by rounding, a clear margin by a fault), and for
the first case with parted rows, how many are equal with the captured steps off, with the compiled layer off (where
those are on: CUDA) and with SDPA's math backend in place of its fused kernels. First it checks the reference
itself: transformers' rows with the prompts batched (left-padded, as a user would) against its one-at-a-time rows.

    python bench/greedy_equality.py [--device cuda] [--dtype float32] [--batches 1,4,8] [--methods none,fixed]
                                    [--prompts 8] [--max-new 48] [--budget 128] [--capture-budget 5] [--out FILE]
                                    [--draft none]   (the target alone: --methods none,generator)
                                    [--cuda-path]    (a CPU down a GPU's code: static steps, compiled layer,
                                                      additive masks, drafting ahead, an H200's memory plan)
                                    [--fused]        (steps of up to 8 tokens through specdec/exec/fused.py's
                                                      kernels; a CPU needs triton and TRITON_INTERPRET=1)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partialmethod

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from engine_models import parting  # noqa: E402
from engine_speed import add_model_args, describe, hf_run, load_bench_pair  # noqa: E402
from prompts import HELD_OUT, chat_ids  # noqa: E402
from step_speed import log  # noqa: E402

from specdec.config import SamplingParams, SpecConfig  # noqa: E402
from specdec.engine import SpecEngine  # noqa: E402
from specdec.exec import llama, memory  # noqa: E402
from specdec.exec.runner import ModelRunner  # noqa: E402
from specdec.spec.proposers.base import Proposer  # noqa: E402
from specbatch import Generator  # noqa: E402

H200 = 143771 * (1 << 20)  # bytes of memory an H200 reports
METHODS = {"none": SpecConfig(method="none"),
           "fixed": SpecConfig(method="draft_model", draft_length="fixed", num_draft_tokens=3),
           "default": SpecConfig()}  # the engine's defaults


def margin(pair, prompt: list[int], want: list[int], got: list[int]) -> str | None:
    """Where `got` parts with transformers' `want` (`engine_models.parting`), as "at:its token's logit minus
    ours/its top-2 gap" (None: equal)."""
    where = parting(pair.target, prompt, want, got)
    if where is None:
        return None
    at, ours, gap = where
    return f"{at}:{'end' if ours is None else f'{ours:.1e}'}/{gap:.1e}"


def hf_batched(pair, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """transformers' greedy `generate` over every prompt at once, left-padded as a user batches it: each row's new
    tokens up to its first EOS."""
    width = max(map(len, prompts))
    ids = torch.tensor([[2] * (width - len(p)) + p for p in prompts], device=pair.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=pair.device)
    out = pair.target.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False, pad_token_id=2)
    eos = pair.target.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    rows = []
    for row in out[:, width:].tolist():
        end = next((i + 1 for i, x in enumerate(row) if x in eos), len(row))
        rows.append(row[:end])
    return rows


def generated(pair, prompts, method: str, bs: int, args, **engine) -> tuple[list[list[int]], SpecEngine]:
    """Each prompt's new tokens, and the engine that made them: a `SpecEngine` over the loaded pair, or for
    `generator` the Python API's `Generator` (the user's door, where the defect was seen: it loads the target
    itself and runs a job worker's row pipeline over chat messages; `none`, the engine's settings as it sets them)."""
    if method == "generator":
        gen = Generator(models={"target": {"path": args.target, "gguf_file": args.target_gguf or None,
                                           "dtype": args.dtype}},
                        generation={"max_new_tokens": args.budget}, speculation={"method": "none"},
                        resources={"batch_size": bs, "gpus_per_worker": 1 if args.device.startswith("cuda") else 0})
        rows = gen.generate([[{"role": "user", "content": t}] for t in args.texts], max_new_tokens=args.max_new)
        assert [r["prompt_tokens"] for r in rows] == [len(p) for p in prompts], "the chat template parts the prompts"
        return [r["token_ids"] for r in rows], gen.engine
    eng = SpecEngine(pair, SamplingParams(max_new_tokens=args.budget), METHODS[method], batch_size=bs,
                     capture_budget=args.capture_budget, **engine)
    out = eng.generate(prompts, params=[SamplingParams(max_new_tokens=args.max_new)] * len(prompts))
    return [r.token_ids for r in out], eng


def run(pair, prompts, want, method: str, bs: int, args, **engine) -> tuple[int, list[str], str]:
    """Rows equal to `want`, each other row's `margin`, and the engine's step path with the worst first-step check
    against eager (`SpecEngine.step_errors`: its relative error and the step's key)."""
    out, eng = generated(pair, prompts, method, bs, args, **engine)
    cells = []
    for p, w, r in zip(prompts, want, out):
        cell = margin(pair, p, w, r)
        if cell is not None:
            cells.append(cell)
    worst = eng.step_errors
    checked = "" if worst is None else f" {worst[0]:.1e}@{','.join(map(str, worst[1]))}"
    return len(prompts) - len(cells), cells, eng.step_path + checked


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.set_defaults(dtype="float32")
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--methods", default="none,fixed", help=",".join([*METHODS, "generator"]))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=48, help="tokens asked per row")
    ap.add_argument("--budget", type=int, default=128, help="the engine's max_new_tokens (caches and steps sized)")
    ap.add_argument("--capture-budget", type=float, default=5.0,
                    help="seconds each engine captures steps before its rows join (the rest: when first met)")
    ap.add_argument("--cuda-path", action="store_true",
                    help="run the engines (the Generator's too) down the CUDA path's code where no GPU is: the "
                         "static steps (as graphs are replayed), the compiled layer, additive attention masks, "
                         "drafting ahead at a cost, the memory plan of a device with an H200's memory")
    ap.add_argument("--fused", action="store_true",
                    help="the static steps (graphs on a GPU) of up to 8 tokens through the fused kernels "
                         "(`ModelRunner.fuse_products`; on a CPU under TRITON_INTERPRET=1, slow)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    ModelRunner.fuse_products = args.fused
    if args.cuda_path or args.fused:  # static steps (a caller's own value wins)
        SpecEngine.__init__ = partialmethod(SpecEngine.__init__, step_graphs=True)
    if args.cuda_path:  # what a GPU's engine does differently, on this device
        ModelRunner.compile_layers = True
        llama.ADDITIVE_MASKS = {torch.device(args.device).type}
        Proposer.ahead_pays = property(lambda self: True)
        memory.device_memory = lambda device: (H200 - memory.GiB, H200)  # the caches a GPU's plan sizes
    if args.draft == "none" and not set(args.methods.split(",")) <= {"none", "generator"}:
        ap.error("--draft none: only --methods none and generator run without a draft")
    t0 = time.perf_counter()
    pair = load_bench_pair(args)
    args.texts = (HELD_OUT * 4)[: args.prompts]
    prompts = chat_ids(pair.tokenizer, args.texts)
    n = len(prompts)
    with torch.inference_mode():
        want = hf_run(pair, prompts, args.max_new)["tokens"]
    if args.out:  # each line is appended as it comes: a deadline keeps what came before it
        open(args.out, "w").close()
    log(args.out, f"# {describe(pair)}; {n} held-out chat prompts, {args.max_new} new tokens under a budget of "
                  f"{args.budget}; rows equal transformers' generate (one prompt at a time); parted: each other row's "
                  f"first differing token, at:(transformers' logit of its token - of ours)/(its top-2 gap); the step "
                  f"path with the worst first-step check against eager (relative error@the step's key)")
    with torch.inference_mode():  # the reference itself: batched (padded) rows against one prompt at a time
        batched = sum(w == b for w, b in zip(want, hf_batched(pair, prompts, args.max_new)))
    log(args.out, f"# transformers' generate with the prompts batched, left-padded, equals its one-at-a-time rows: "
                  f"{batched}/{n} (a reference a user batches is only as good as this)")
    log(args.out, f"{'method':8s} {'batch':>5s} {'equal':>6s} {'step path':12s} parted")
    cuda, diagnosed = str(pair.device).startswith("cuda"), False
    for name in args.methods.split(","):
        for bs in [int(b) for b in args.batches.split(",")]:
            with torch.inference_mode():
                same, cells, path = run(pair, prompts, want, name, bs, args)
            log(args.out, f"{name:8s} {bs:5d} {same:3d}/{n:<2d} {path:12s} {' '.join(cells)}")
            if same < n and (cuda or args.cuda_path) and not diagnosed:  # which part of that path parts them
                diagnosed = True  # (once: the budget; the generator's case split as the engine's `none`)
                split = "none" if name == "generator" else name
                with torch.inference_mode():
                    graphs_off = run(pair, prompts, want, split, bs, args, step_graphs=False)[0]
                    compiled, ModelRunner.compile_layers = ModelRunner.compile_layers, False
                    try:
                        layer_off = run(pair, prompts, want, split, bs, args)[0]
                    finally:
                        ModelRunner.compile_layers = compiled
                log(args.out, f"#   equal with the captured steps off: {graphs_off}/{n}; with the compiled layer off: "
                              f"{layer_off}/{n}")
                with torch.inference_mode(), sdpa_kernel(SDPBackend.MATH):
                    math = run(pair, prompts, want, split, bs, args)[0]
                log(args.out, f"#   equal with SDPA's math backend for the engine's attention: {math}/{n}")
    log(args.out, f"# {time.perf_counter() - t0:.0f} s")

if __name__ == "__main__":
    main()
