"""Constrained decoding on the real pair: JSON-schema extraction, speculative against autoregressive.

    python bench/synthesis.py [--batches 1,8] [--repeats 2] [--max-new 96] [--prompts 16]

16 short texts about people, products and events (written for this benchmark; the draft saw only Python
instructions), each to be extracted into its kind's JSON schema, greedy. Runs, all under the schema's grammar:
autoregressive (method none: one target call per token the grammar leaves a choice, forced tokens free), the same
with jump-forward switched off (a target call for every token), the defaults of `draft_model` and `prompt_lookup`,
and `draft_model` with jump-forward switched off. Prints tokens/s, the paired
ratio to constrained autoregressive (bench/policies.py's interpolation; median and range over the repeats),
tokens per target call, the share of jump-forward (forced) tokens, how many outputs equal constrained
autoregressive's token for token, and how many completed and validate against their schema (jsonschema).
Engines are built once per batch size and warmed, as a job's worker keeps its engine across shards.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jsonschema

sys.path.insert(0, os.path.dirname(__file__))
from engine_speed import add_model_args, describe, load_bench_pair, sync  # noqa: E402
from policies import interpolate  # noqa: E402

from specdec.spec import grammar  # noqa: E402
from specdec.config import SamplingParams, SpecConfig  # noqa: E402
from specdec.engine import SpecEngine  # noqa: E402

TEXT = {"type": "string", "maxLength": 48}
SCHEMAS = {
    "person": {"type": "object", "additionalProperties": False, "required": ["name", "age", "city", "occupation"],
               "properties": {"name": TEXT, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                              "city": TEXT, "occupation": TEXT}},
    "product": {"type": "object", "additionalProperties": False, "required": ["name", "price", "currency", "in_stock"],
                "properties": {"name": TEXT, "price": {"type": "number", "minimum": 0},
                               "currency": {"enum": ["USD", "EUR", "GBP"]}, "in_stock": {"type": "boolean"}}},
    "event": {"type": "object", "additionalProperties": False, "required": ["title", "date", "city", "attendees"],
              "properties": {"title": TEXT, "date": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"},
                             "city": TEXT, "attendees": {"type": "integer", "minimum": 0}}},
}
TEXTS = [
    ("person", "Marta Okafor, 34, moved to Lisbon last spring and now works there as a marine biologist."),
    ("person", "At 71, retired train driver Henrik Sand still lives in the small town of Kiruna."),
    ("person", "Our new neighbour is Priya Raman, a 28-year-old dentist from Leeds."),
    ("person", "The violin maker Tomas Heller is 52 and keeps his workshop in Cremona."),
    ("person", "Nineteen-year-old Lea Brandt studies to be a pilot in Hamburg."),
    ("person", "Carlos Mendes, a baker aged 45, opened his second shop in Porto this week."),
    ("product", "The TrailLite 2 tent weighs 1.4 kg, costs 189 US dollars and is in stock now."),
    ("product", "Sold out again: the Aurora desk lamp, 59.90 euros, back in March."),
    ("product", "A pack of twelve beeswax candles is 14 pounds and ships today."),
    ("product", "The Nimbus e-reader costs 129 dollars; the shop has plenty left."),
    ("product", "Orbit, a cast iron skillet, sells for 45 euros but is out of stock until June."),
    ("event", "The Harbour Jazz Night takes place in Bergen on 2026-08-14, with 1200 guests expected."),
    ("event", "On 2027-03-02 about 300 people will meet in Ghent for the annual cheese fair."),
    ("event", "The city marathon in Valencia, set for 2026-12-06, has 18000 runners registered."),
    ("event", "A chess open with 240 players starts in Reykjavik on 2026-11-28."),
    ("event", "The robotics meetup on 2027-01-19 in Tampere expects 85 attendees."),
]
SYSTEM = "Extract the facts in the user's text as a JSON object with the fields of its schema."


def requests(tokenizer, count: int):
    """(prompt ids, SamplingParams with the text's schema, schema) for `count` texts (cycled)."""
    out = []
    for kind, text in (TEXTS * 4)[:count]:
        ids = tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}],
                                            add_generation_prompt=True, tokenize=True, return_dict=False)
        fmt = {"type": "json_schema", "json_schema": {"name": kind, "schema": SCHEMAS[kind], "strict": True}}
        out.append((ids, fmt, SCHEMAS[kind]))
    return out


def timed(eng, reqs, max_new: int, jump_forward: bool = True) -> dict:
    """One generate() over `reqs`: tokens/s and the figures the table prints."""
    params = [SamplingParams(max_new_tokens=max_new, response_format=fmt) for _, fmt, _ in reqs]
    forced = grammar.Constraints.forced
    if not jump_forward:  # an ablation: forced tokens are drafted and verified like any other
        grammar.Constraints.forced = lambda self, slot, limit: []
    try:
        sync(eng.device)
        t = time.perf_counter()
        res = eng.generate([ids for ids, _, _ in reqs], params=params)
        sync(eng.device)
        wall = time.perf_counter() - t
    finally:
        grammar.Constraints.forced = forced
    gen = sum(r.generated_tokens for r in res)
    print(f"  ({eng.spec.method}, batch {eng.batch_size}: {gen} tokens in {wall:.1f} s)", file=sys.stderr, flush=True)
    valid = 0
    for r, (_, _, schema) in zip(res, reqs):
        if r.error is None and r.finish_reason == "stop":
            jsonschema.validate(json.loads(eng.pair.tokenizer.decode(r.token_ids, skip_special_tokens=True)), schema)
            valid += 1
    return {"tok_s": gen / wall, "at": t + wall / 2, "per_call": gen / max(1, sum(r.rounds for r in res)),
            "forced": sum(r.forced_tokens for r in res) / gen, "valid": valid, "tokens": [r.token_ids for r in res]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--prompts", type=int, default=16)
    add_model_args(ap)
    args = ap.parse_args()
    pair = load_bench_pair(args)
    reqs = requests(pair.tokenizer, args.prompts)
    print(f"# {len(reqs)} JSON-schema extraction prompts, max_new_tokens={args.max_new}, greedy, "
          f"{args.repeats} interleaved repeats, {describe(pair)}")
    print(f"{'run (all constrained)':34s} {'batch':>5s} {'tok/s':>7s} {'paired':>6s} {'range':>10s} {'tok/call':>8s} "
          f"{'forced':>6s} {'=AR':>5s} {'valid':>5s}")
    runs = [("autoregressive", "none", True), ("autoregressive, no jump-forward", "none", False),
            ("draft_model (defaults)", "draft_model", True),
            ("draft_model, no jump-forward", "draft_model", False), ("prompt_lookup (defaults)", "prompt_lookup", True)]
    for bs in (int(b) for b in args.batches.split(",")):
        engines = {}
        for name, method, _ in runs:
            engines[name] = SpecEngine(pair, SamplingParams(max_new_tokens=args.max_new), SpecConfig(method=method),
                                       batch_size=bs)
            engines[name].measure_costs()  # goodput's cost profile, as a worker measures it at start
            timed(engines[name], reqs[-2:], 16)  # warm-up, untimed
        base_name = runs[0][0]
        baseline = [timed(engines[base_name], reqs, args.max_new)]
        results: dict[str, list[dict]] = {}  # per run: one result per repeat
        ratios: dict[str, list[float]] = {}
        others = runs[1:]
        for rep in range(args.repeats):
            shift = rep % len(others)
            for name, _, jump in others[shift:] + others[:shift]:
                r = timed(engines[name], reqs, args.max_new, jump)
                results.setdefault(name, []).append(r)
            baseline.append(timed(engines[base_name], reqs, args.max_new))
        for name in results:  # each run over autoregressive's speed interpolated between the runs around it
            ratios[name] = [r["tok_s"] / interpolate(baseline[i], baseline[i + 1], r["at"])
                            for i, r in enumerate(results[name])]
        ratios[base_name] = [mid["tok_s"] / interpolate(a, b, mid["at"])  # the baseline against itself: drift
                             for a, mid, b in zip(baseline, baseline[1:], baseline[2:])]
        results[base_name] = baseline
        base_tokens = baseline[0]["tokens"]
        for name, _, _ in runs:
            best = max(results[name], key=lambda r: r["tok_s"])
            rs = ratios[name] or [float("nan")]  # the baseline's drift needs two repeats
            same = min(sum(a == b for a, b in zip(r["tokens"], base_tokens)) for r in results[name])
            print(f"{name:34s} {bs:5d} {best['tok_s']:7.1f} {statistics.median(rs):6.2f} "
                  f"{min(rs):5.2f}-{max(rs):4.2f} {best['per_call']:8.2f} {best['forced']:6.2f} "
                  f"{same:2d}/{len(reqs):<2d} {min(r['valid'] for r in results[name]):2d}/{len(reqs):<2d}", flush=True)


if __name__ == "__main__":
    main()
