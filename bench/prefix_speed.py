"""Prefix caching on a synthesis-shaped job: one long shared instruction, a short input per row.

    python bench/prefix_speed.py [--rows 48] [--batches 16] [--max-new 32] [--repeats 2]
        [--methods none,draft_model,aasd] [--prompts synthesis|chat] [--budget-gib G] [--kv-cache dense,paged]
        [--capture-budget S] [--draft none]

Every row is the chat template over a ~1,000-token system prompt (a data-synthesis brief with worked examples,
written for this benchmark) and a one-line user input; `--prompts chat`: held-out chat prompts instead
(bench/prompts.py; they share only the chat template's system header), to check that caching costs nothing where
little is shared. For each method and batch size, the same engine settings run with
`prefix_caching` off and on, alternating over the repeats (the store emptied before each timed run, so the first
rows pay their prefill), in one process: prints tokens/s, the ratio on/off (median and range over the repeats),
prompt tokens computed and reused, and whether the outputs are the same tokens.

`--budget-gib G`: the engines get device figures whose memory plan has G GiB for caches and activations (as
tests/test_memory.py drives the plan on a CPU), so batches are sized as on a GPU; a third run, `on, no hold`, is
prefix caching as it was before 2026-11-27, when the plan held no room for the prefixes rows share (the store took
only what the rows left). The `rows` column is the most rows that ran at once.

`--kv-cache dense,paged`: the runs above for each cache layout (`resources.kv_cache`), ratios to the first layout's
run without caching; over a paged pool the store's blocks are the rows' own, shared by reference, so under a budget
rows of one instruction reserve only what they write.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from engine_speed import add_model_args, describe, load_bench_pair, sync  # noqa: E402
from prompts import HELD_OUT, chat_ids  # noqa: E402

from specdec.exec import memory  # noqa: E402
from specdec.config import SamplingParams, SpecConfig  # noqa: E402
from specdec.engine import SpecEngine  # noqa: E402
from specdec.sched.rounds import Rounds  # noqa: E402

RULES = [
    "Write one product review per request, in plain English, between forty and eighty words.",
    "Start with the reviewer's overall impression, then give one concrete detail about using the product.",
    "Mention one weakness honestly, even in a positive review, and say whether it matters for daily use.",
    "Never invent prices, brand names, model numbers or statistics that the request does not give.",
    "Keep the tone of a real customer: no marketing language, no exclamation marks, no emojis.",
    "End with a star rating from one to five written as a digit followed by the word stars.",
    "If the request names a kind of reviewer (a student, a parent, a cook), write from that point of view.",
    "If the request is not about a product, answer with a single sentence saying that you only write reviews.",
]
EXAMPLES = [
    ("a steel water bottle, reviewed by a cyclist",
     "I have carried this bottle on every ride for two months and it still keeps water cold through a long "
     "afternoon. The lid seals well, so nothing leaks in my frame bag. It is heavier than a plastic bottle, which I "
     "notice on climbs, but I accept that for the insulation. 4 stars"),
    ("a paper notebook, reviewed by a student",
     "The pages are thick enough that my pen does not bleed through, and the dotted grid helps me keep notes in "
     "order during lectures. The cover bends after a few weeks in a backpack, so it looks worn quickly. For the "
     "price of a coffee it does its job well. 4 stars"),
    ("a rice cooker, reviewed by a parent",
     "We cook rice almost every evening and this cooker gets it right without anyone watching it. The keep-warm "
     "setting means the children can eat at different times. The inner pot scratches easily, so we only use the "
     "wooden spoon that came with it. 5 stars"),
    ("a pair of running shoes, reviewed by a beginner",
     "These were my first proper running shoes and my knees hurt less than in my old trainers. The laces come "
     "undone unless I double knot them, which is annoying at the start of a run. After three hundred kilometres the "
     "soles show little wear. 4 stars"),
    ("a desk lamp, reviewed by an architect",
     "The light is even across my drawing board and the arm stays where I put it. I would like a warmer colour "
     "setting for evenings, since the only option feels cold after sunset. The base is heavy enough that the lamp "
     "never tips when I move the arm. 3 stars"),
    ("a winter jacket, reviewed by a dog walker",
     "I walk three dogs before sunrise in all weather and this jacket has kept me dry through two months of rain. "
     "The hood is deep enough to stay on in the wind. The zip sticks when my hands are cold, which is exactly when I "
     "need it to work, so I keep it waxed now. 4 stars"),
    ("a set of bed sheets, reviewed by a night nurse",
     "I sleep during the day, so I notice every scratchy seam, and these sheets are soft from the first wash. They "
     "stay cool on warm afternoons. The fitted sheet is a little shallow for our thick mattress and slips off one "
     "corner by the end of the week. 3 stars"),
    ("a board game, reviewed by a grandparent",
     "My grandchildren are six and nine and both understood the rules after one round, which is rare. A game lasts "
     "about forty minutes, short enough that nobody gets bored. The cards are thin and one already has a crease, so "
     "I would not trust them with younger children. 4 stars"),
    ("a kitchen knife, reviewed by a cook",
     "The blade arrived sharp and has stayed sharp through a month of daily vegetables. The handle is a little "
     "short for my hand, so long sessions tire my fingers. It cleans easily and I dry it straight away to keep the "
     "edge. 4 stars"),
]
INPUTS = ["a wool scarf, reviewed by a teacher", "a electric kettle, reviewed by a student",
          "a camping tent, reviewed by a parent", "a pair of headphones, reviewed by a commuter",
          "a garden hose, reviewed by a retired engineer", "a bread knife, reviewed by a baker",
          "a travel backpack, reviewed by a nurse", "a laptop stand, reviewed by a programmer",
          "a coffee grinder, reviewed by a barista", "a bicycle helmet, reviewed by a child's parent",
          "an umbrella, reviewed by a postman", "a yoga mat, reviewed by a beginner"]


def instruction() -> str:
    parts = ["You write short product reviews for a dataset of customer opinions. Follow these rules exactly."]
    parts += [f"Rule {i}. {r}" for i, r in enumerate(RULES, 1)]
    parts.append("Here are worked examples of requests and the reviews that follow the rules.")
    for i, (req, review) in enumerate(EXAMPLES, 1):
        parts.append(f"Example {i}. Request: {req}. Review: {review}")
    parts.append("Check every rule again before you answer. Answer with the review only.")
    return "\n".join(parts)


def prompts(tokenizer, rows: int) -> list[list[int]]:
    system = instruction()
    return [tokenizer.apply_chat_template([{"role": "system", "content": system},
                                           {"role": "user", "content": f"Request {i}: {INPUTS[i % len(INPUTS)]}."}],
                                          add_generation_prompt=True, tokenize=True, return_dict=False)
            for i in range(rows)]


def timed(eng: SpecEngine, ids: list[list[int]], params: list[SamplingParams] | None = None) -> dict:
    if eng.prefix is not None:
        eng.prefix.clear()
    most = []
    real = Rounds.launch
    Rounds.launch = lambda self, *a: (most.append(self.batch.n), real(self, *a))[1]  # the rows each round runs
    try:
        sync(eng.device)
        t = time.perf_counter()
        res = eng.generate(ids, params=params)
        sync(eng.device)
        wall = time.perf_counter() - t
    finally:
        Rounds.launch = real
    return {"tok_s": sum(r.generated_tokens for r in res) / wall, "prompt": sum(r.prompt_tokens for r in res),
            "rows": max(most), "reused": sum(r.cached_prompt_tokens for r in res),
            "tokens": [r.token_ids for r in res]}


ALIASES = {"aasd": {"method": "prompt_lookup", "prompt_lookup": {"alignment_sampling": 2}}}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=48)
    ap.add_argument("--batches", "--batch", default="16", help="batch sizes, comma-separated")
    ap.add_argument("--prompts", choices=("synthesis", "chat"), default="synthesis")
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--methods", default="none,draft_model", help="methods, or aasd: prompt_lookup with "
                    "alignment_sampling 2 (its prefills keep the target's top ids with the stored blocks)")
    ap.add_argument("--budget-gib", type=float, default=None, help="size batches by a memory plan of this budget")
    ap.add_argument("--kv-cache", default="dense", help="cache layouts, comma-separated (dense, paged)")
    ap.add_argument("--capture-budget", type=float, default=None,
                    help="seconds each engine captures steps before its first rows join (default: the engine's)")
    add_model_args(ap)
    args = ap.parse_args()
    torch.manual_seed(0)
    pair = load_bench_pair(args)
    if args.prompts == "chat":
        ids = chat_ids(pair.tokenizer, [HELD_OUT[i % len(HELD_OUT)] for i in range(args.rows)])
    else:
        ids = prompts(pair.tokenizer, args.rows)
    lens = [len(p) for p in ids]
    print(f"# {args.rows} rows of {min(lens)}-{max(lens)} prompt tokens ({args.prompts} prompts), {args.max_new} new "
          f"tokens, greedy, {describe(pair)}")
    layouts = args.kv_cache.split(",")
    print(f"{'method':12s} {'batch':>5s} {'caching':>17s} {'rows':>4s} {'tok/s':>8s} {'/ first off':>18s} "
          f"{'prompt tok':>10s} {'computed':>9s} {'reused':>7s} {'same':>5s}")
    variants = [f"{layout} {c}" for layout in layouts
                for c in ["off", "on"] + (["on, no hold"] if args.budget_gib and layout == "dense" else [])]
    for method, batch in [(m, int(b)) for m in args.methods.split(",") for b in args.batches.split(",")]:
        spec = SpecConfig(**ALIASES.get(method, {"method": method}))
        engines = {v: SpecEngine(pair, SamplingParams(max_new_tokens=args.max_new), spec, batch_size=batch,
                                 prefix_caching=not v.endswith("off"), kv_cache=v.split()[0],
                                 capture_budget=args.capture_budget) for v in variants}
        for v, eng in engines.items():
            if args.budget_gib:  # a device whose free memory the engine's caches and kept prefixes take from
                total, budget = 80 * memory.GiB, int(args.budget_gib * memory.GiB)
                free = int((1 - eng.gpu_memory_fraction) * total) + budget + memory.GiB // 2
                eng.device_memory = lambda e=eng, free=free: (free - e.resident_bytes(), total)
            if v.endswith("no hold"):
                eng.prefix_room = lambda *a: 0
            eng.measure_costs()
            eng.generate(ids[:2])  # warm: kernels, allocator, cache sizes
        runs = {v: [] for v in variants}
        for _ in range(args.repeats):
            for v in variants:
                runs[v].append(timed(engines[v], ids))
        first = runs[variants[0]]
        for v in variants:
            r = runs[v][-1]
            same = sum(a == b for a, b in zip(r["tokens"], first[-1]["tokens"]))
            ratios = [a["tok_s"] / b["tok_s"] for a, b in zip(runs[v], first)]
            ratio = f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})" if v != variants[0] else ""
            speed = statistics.median(x["tok_s"] for x in runs[v])
            print(f"{method:12s} {batch:5d} {v:>17s} {r['rows']:4d} {speed:8.1f} "
                  f"{ratio:>18s} {r['prompt']:10d} {r['prompt'] - r['reused']:9d} {r['reused']:7d} "
                  f"{same:>2d}/{len(ids)}")


if __name__ == "__main__":
    main()
