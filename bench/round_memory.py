"""A round's vocabulary-sized work, measured by feature: what the memory plan's `ROUND_FLOATS` must cover.

    python bench/round_memory.py [--vocab 32768] [--batch 8] [--max-draft 8]

A tiny Llama (hidden 64, 2 layers) with a large vocabulary, so that tensors of [rows, width, vocab] dominate what a
run allocates, and a noisy copy as its draft. For each setting, one warm generate(), then a second under
tests/test_memory.py's `Peak` (every tensor storage created, the most bytes alive at once: the caches and captured
steps are the first run's, so what it counts is a round's work and the batch's buffers). Prints that peak in units of
float32 [batch, widest step, vocab], against the plan's `ROUND_FLOATS` (the same unit). No timing.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from engine_models import noisy_copy, tiny_llama  # noqa: E402
from test_memory import KeptGraphs, Peak, make_engine, prompts_of  # noqa: E402

from specdec.exec import llama, memory  # noqa: E402
from specdec.exec import runner as runner_mod  # noqa: E402

FUZZY = {"verification": "fuzzy", "fuzzy": {"divergence": "js", "threshold": 0.3}}
AASD = {"prompt_lookup": {"alignment_sampling": 2}}
GRID = [  # name, method, sampling settings, speculation settings, repetitive prompts (prompt lookup finds drafts)
    ("greedy", "draft_model", {}, {}, False),
    ("greedy, logprobs 5", "draft_model", {"logprobs": True, "top_logprobs": 5}, {}, False),
    ("greedy, heuristic", "draft_model", {}, {"draft_length": "heuristic"}, False),
    ("greedy, goodput, logprobs 20", "draft_model", {"logprobs": True, "top_logprobs": 20},
     {"draft_length": "goodput"}, False),
    ("greedy, heuristic, n 2, logprobs 20", "draft_model", {"logprobs": True, "top_logprobs": 20, "n": 2},
     {"draft_length": "heuristic"}, False),
    ("greedy, draft_vocab 1000", "draft_model", {}, {"draft_vocab": 1000}, False),
    ("greedy, fuzzy", "draft_model", {}, FUZZY, False),
    ("temperature", "draft_model", {"temperature": 0.8}, {}, False),
    ("temperature, coupled", "draft_model", {"temperature": 0.8}, {"sampling": "coupled"}, False),
    ("temperature, fuzzy", "draft_model", {"temperature": 0.8}, FUZZY, False),
    ("temperature, draft_vocab 1000", "draft_model", {"temperature": 0.8}, {"draft_vocab": 1000}, False),
    ("temperature, top_p", "draft_model", {"temperature": 0.8, "top_p": 0.9}, {}, False),
    ("prompt lookup, greedy", "prompt_lookup", {}, {}, True),
    ("prompt lookup, temperature", "prompt_lookup", {"temperature": 0.8}, {}, True),
    ("AASD trees, greedy", "prompt_lookup", {}, AASD, True),
    ("AASD trees, temperature", "prompt_lookup", {"temperature": 0.8}, AASD, True),
    ("AASD trees, logprobs 20", "prompt_lookup", {"logprobs": True, "top_logprobs": 20},
     {"prompt_lookup": {"alignment_sampling": 3}}, True),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-draft", type=int, default=8)
    args = ap.parse_args()
    runner_mod.StepGraphs = KeptGraphs  # captured steps keep their outputs, as on a GPU
    target = tiny_llama(vocab=args.vocab, seed=0).cpu()
    models = {"target": target, "draft": noisy_copy(target, 0.02)}
    for m in models.values():
        llama.load_weights(m)
    random = prompts_of([20] * args.batch, vocab=args.vocab)
    repetitive = [list(range(i, i + 10)) * 4 for i in range(args.batch)]
    print(f"# vocab {args.vocab}, batch {args.batch}, max_draft {args.max_draft}: peak in float32 [batch, widest step, "
          f"vocab] units; the plan counts ROUND_FLOATS = {memory.ROUND_FLOATS} of them")
    print(f"{'setting':38s} {'peak units':>10s}")
    for name, method, sp, spec, repeat in GRID:
        eng = make_engine(models, method, bs=args.batch, max_new=24, m=args.max_draft, sp=sp, **spec)
        prompts = repetitive if repeat else random
        eng.generate(prompts)
        with Peak() as peak:
            eng.generate(prompts)
        unit = 4 * args.batch * eng.graph_width * args.vocab
        print(f"{name:38s} {peak.peak / unit:10.2f}", flush=True)


if __name__ == "__main__":
    main()
