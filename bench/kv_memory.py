"""KV memory for mixed prompt lengths: what the engine allocates against what its rows hold, and the rows a GPU
budget admits: dense rows with the allocation rule of today and the power-of-two rule before it (2026-11-26), and
the paged cache (`resources.kv_cache: paged`, 2026-11-27).

    python bench/kv_memory.py [--rows 256] [--min-len 50] [--max-len 2000] [--max-new 64] [--budget-gib 4]
        [--shapes llama-8b] [--shared 1000]

Prompt lengths are drawn uniformly from [min-len, max-len] (seeded). The real pair's engine (`method:
draft_model`, both caches) is given device figures whose budget is `--budget-gib` (as the tests drive the plan on
a CPU), and sizes its batch for the job as `generate()` does (`SpecEngine.sizes`). Prints, per rule: the slots a
row gets, the rows admitted, and KV bytes allocated over KV bytes held, for a batch of the longest rows (the first
admission, longest first) and for a batch of rows of the mean length (later admissions mix lengths); the paged
cache's rows are those its pool holds at once (each row reserves its prompt, `max_new` and the draft's slack, in
16-slot blocks), within the rows its memory plan gives steps and activations for. Nothing
runs on the models: these are the engine's own sizing decisions, which tests/test_memory.py holds to the measured
allocation. `--shapes llama-8b`: the pair is Llama-3.1-8B's shape with Llama-3.2-1B's as the draft, bfloat16, built on
torch's meta device (shapes, no weights): the sizing a GPU job of that pair would get (on a GPU the captured steps
also keep their outputs, which this does not count). `--shared N`: a synthesis job: every prompt is one N-token
instruction and then its drawn length of its own; adds `paged, shared`, prefix caching over the paged pool (the
instruction's blocks held once, by reference; each row reserves what it writes).
"""

from __future__ import annotations

import argparse
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from engine_speed import add_model_args, describe, load_bench_pair  # noqa: E402

from specdec.exec import memory  # noqa: E402
from specdec.exec.cache import BLOCK, blocks_for  # noqa: E402
from specdec.config import SamplingParams, SpecConfig  # noqa: E402
from specdec.exec.graphs import pow2_at_least  # noqa: E402
from specdec.engine import SpecEngine  # noqa: E402
from specdec.exec.models import ModelPair  # noqa: E402


def meta_llama(layers: int, d: int, heads: int, kv_heads: int, intermediate: int):
    """A Llama of these sizes and Llama 3's vocabulary on the meta device, bfloat16: its shapes, no weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128256, hidden_size=d, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, intermediate_size=intermediate, max_position_embeddings=131072,
                      tie_word_embeddings=False)
    with torch.device("meta"):
        return LlamaForCausalLM(cfg).to(torch.bfloat16).eval().requires_grad_(False)


def pow2_rule(eng: SpecEngine):
    """The allocation rule before 2026-11-26: a power of two and one."""
    return lambda slots: max(slots, min(pow2_at_least(slots) + 1, eng.max_positions))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=50)
    ap.add_argument("--max-len", type=int, default=2000)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--budget-gib", type=float, default=4.0)
    ap.add_argument("--shared", type=int, default=0, help="tokens of an instruction every prompt begins with")
    ap.add_argument("--shapes", choices=("real", "llama-8b"), default="real",
                    help="llama-8b: Llama-3.1-8B with Llama-3.2-1B's shape as the draft, bf16, no weights")
    add_model_args(ap)
    args = ap.parse_args()
    if args.shapes == "llama-8b":
        pair = ModelPair(meta_llama(32, 4096, 32, 8, 14336), meta_llama(16, 2048, 32, 8, 8192), None, (), 128256)
    else:
        pair = load_bench_pair(args)
    rng = random.Random(0)
    lengths = [args.shared + rng.randint(args.min_len, args.max_len) for _ in range(args.rows)]
    engines = {layout: SpecEngine(pair, SamplingParams(max_new_tokens=args.max_new), SpecConfig(method="draft_model"),
                                  batch_size=args.rows, prefix_caching=False, kv_cache=layout)
               for layout in ("dense", "paged")}
    if args.shared:
        engines["shared"] = SpecEngine(pair, SamplingParams(max_new_tokens=args.max_new),
                                       SpecConfig(method="draft_model"), batch_size=args.rows, kv_cache="paged")
    total = 80 * memory.GiB
    budget = int(args.budget_gib * memory.GiB)
    for e in engines.values():
        e.device_memory = lambda e=e: (int((1 - e.gpu_memory_fraction) * total) + budget + memory.GiB // 2, total)
    eng = engines["dense"]
    plan = eng.memory_plan()
    per_token = memory.kv_bytes_per_token(m for m in (pair.target, pair.draft))
    row_len = eng.row_tokens(max(lengths))
    longest = sorted(lengths, reverse=True)
    mean = sum(lengths) / len(lengths)
    print(f"# {args.rows} prompts of " + (f"a {args.shared}-token instruction and " if args.shared else "")
          + f"{args.min_len}-{args.max_len} tokens (mean {mean:.0f} in all), {args.max_new} new, "
          f"KV budget {args.budget_gib} GiB, {per_token} KV bytes per token (both models), "
          + ("Llama-3.1-8B / Llama-3.2-1B shapes, meta device, bfloat16" if args.shapes == "llama-8b" else describe(pair)))
    print(f"{'rule':12s} {'slots/row':>9s} {'rows':>5s} {'KV GiB':>7s} {'alloc/held, longest':>20s} "
          f"{'alloc/held, mean':>17s} {'rows, mean':>10s}")
    rules = {"power of 2": pow2_rule(eng), "today": eng.alloc_len}
    rows = {}
    for name, rule in rules.items():
        eng.alloc_len = rule
        need = eng.sizes(args.rows, row_len, max(lengths), plan)
        rows[name] = need.batch
        held_longest = sum(n + args.max_new for n in longest[: need.batch]) * per_token
        held_mean = need.batch * (mean + args.max_new) * per_token
        alloc = need.rows * need.max_len * per_token
        print(f"{name:12s} {need.max_len:9d} {need.batch:5d} {alloc / memory.GiB:7.2f} {alloc / held_longest:20.2f} "
              f"{alloc / held_mean:17.2f} {need.batch:10d}")
    paged = engines["paged"]
    slots = sorted((paged.row_tokens(n) for n in lengths), reverse=True)
    need = paged.sizes(args.rows, row_len, max(lengths), paged.memory_plan(), slots)
    first, at_mean = rows_at_once(need.pool - BLOCK, slots, paged.row_tokens(round(mean)), need.rows)
    alloc = need.pool * per_token
    held_longest = sum(n + args.max_new for n in longest[:first]) * per_token
    held_mean = at_mean * (mean + args.max_new) * per_token
    print(f"{'paged':12s} {'own':>9s} {first:5d} {alloc / memory.GiB:7.2f} {alloc / held_longest:20.2f} "
          f"{alloc / held_mean:17.2f} {at_mean:10d}")
    print(f"rows admitted, today / power of 2: {rows['today'] / rows['power of 2']:.2f}; paged / today: "
          f"{first / rows['today']:.2f} for the longest rows, {at_mean / rows['today']:.2f} at the mean length "
          f"(the plan gives steps and activations for {need.rows} rows)")
    if args.shared:
        shared_rows(engines["shared"], args, lengths, row_len, per_token, rows["today"])


def rows_at_once(pool: int, slots: list[int], mean_slots: float, most: int) -> tuple[int, int]:
    """Rows a pool of `pool` slots holds at once, at most `most` (the rows the plan gives steps and activations for):
    the first of rows reserving `slots` each (longest first), and rows of `mean_slots`."""
    taken = [blocks_for(s) * BLOCK for s in slots]
    first = next((i for i in range(most + 1) if i == most or sum(taken[: i + 1]) > pool), most)
    return first, min(most, int(pool // (blocks_for(round(mean_slots)) * BLOCK)))


def shared_rows(eng: SpecEngine, args, lengths: list[int], row_len: int, per_token: int, today: int) -> None:
    """The synthesis job's rows over a paged pool with prefix caching: the instruction's blocks once, each row's own
    blocks (its input, its output and the draft's slack), as `generate()` sizes them (`memory.pool_sharing`)."""
    rng = random.Random(1)
    instruction = [rng.randrange(1000) for _ in range(args.shared)]
    prompts = [instruction + [rng.randrange(1000) for _ in range(n - args.shared)] for n in lengths]
    prompts.sort(key=len, reverse=True)
    slots = [eng.row_tokens(len(p)) for p in prompts]
    own_tokens, held_room = memory.pool_sharing(prompts, slots, args.rows, eng.prefix.block)
    need = eng.sizes(args.rows, row_len, max(lengths), eng.memory_plan(), slots, own_tokens, held_room)
    # less the scratch block and the instruction's blocks; own_tokens is in the prompts' order, longest first
    first, at_mean = rows_at_once(need.pool - BLOCK - held_room * BLOCK, own_tokens,
                                  sum(own_tokens) / len(own_tokens), need.rows)
    alloc = need.pool * per_token
    held_longest = (held_room * BLOCK + sum(len(p) - held_room * BLOCK + args.max_new for p in prompts[:first])) \
        * per_token
    mean = sum(lengths) / len(lengths)
    held_mean = (held_room * BLOCK + at_mean * (mean - held_room * BLOCK + args.max_new)) * per_token
    print(f"{'paged,shared':12s} {'own':>9s} {first:5d} {alloc / memory.GiB:7.2f} {alloc / held_longest:20.2f} "
          f"{alloc / held_mean:17.2f} {at_mean:10d}")
    print(f"paged with the instruction shared / today: {first / today:.2f} for the longest rows, "
          f"{at_mean / today:.2f} at the mean length (the plan gives steps and activations for {need.rows} rows)")


if __name__ == "__main__":
    main()
