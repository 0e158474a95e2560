"""How many tensor ops a round dispatches outside the models' forwards, and where: each is a kernel launch on a GPU
(a few microseconds of host and device time) that a captured step does not absorb. Counted, not timed: the same
on any machine. A tiny random pair (2 layers, 64 wide, 2,048-token vocabulary), greedy, 16-29-token prompts, 32
new tokens, the static padded steps a GPU captures (`step_graphs=True`, each forward one replay there); the count
is over one warm generate() per case, divided by its rounds (a row's admission and its leaving are in it too:
per job, not per round).

    python bench/round_ops.py [--batches 2,8,16] [--ks 0,2] [--top 12] [--out FILE]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from engine_models import noisy_copy, pair, tiny_llama  # noqa: E402

from specdec.config import SamplingParams, SpecConfig  # noqa: E402
from specdec.engine import SpecEngine  # noqa: E402
from specdec.exec.runner import ModelRunner  # noqa: E402


class Ops(TorchDispatchMode):
    """Counts the ops dispatched outside `ModelRunner._step` (a forward), by the innermost specdec function."""

    def __init__(self):
        super().__init__()
        self.where: collections.Counter = collections.Counter()
        self.inside = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside and not func.is_view:  # views launch nothing
            frames = [f for f in traceback.extract_stack() if f"{os.sep}specdec{os.sep}" in f.filename]
            at = frames[-1] if frames else None
            name = "?" if at is None else f"{at.filename.split(os.sep + 'specdec' + os.sep)[1]}:{at.name}"
            self.where[name] += 1
        return func(*args, **(kwargs or {}))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="2,8,16")
    ap.add_argument("--ks", default="0,2", help="fixed draft lengths (0: autoregressive)")
    ap.add_argument("--top", type=int, default=12, help="functions listed per case")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    target = tiny_llama(vocab=2048, layers=2, seed=3)
    draft = noisy_copy(target, 0.02)
    counter = Ops()
    step = ModelRunner._step

    def counted_step(self, *a, **kw):
        counter.inside += 1
        try:
            return step(self, *a, **kw)
        finally:
            counter.inside -= 1

    ModelRunner._step = counted_step
    lines = ["# ops a round dispatches outside the models' forwards (tiny pair, greedy, 32 new tokens, static steps)",
             f"{'k':>2s} {'batch':>5s} {'rounds':>6s} {'ops a round':>11s}  most, a round: function"]
    print("\n".join(lines), flush=True)
    for k in [int(x) for x in args.ks.split(",")]:
        for bs in [int(x) for x in args.batches.split(",")]:
            g = torch.Generator().manual_seed(0)
            prompts = [torch.randint(0, 2048, (int(n),), generator=g).tolist()
                       for n in torch.randint(16, 30, (bs,), generator=g)]
            spec = SpecConfig(method="none") if k == 0 else \
                SpecConfig(method="draft_model", draft_length="fixed", num_draft_tokens=k)
            eng = SpecEngine(pair(target, draft if k else None), SamplingParams(max_new_tokens=32), spec,
                             batch_size=bs, step_graphs=True)
            eng.generate(prompts)  # warm
            counter.where.clear()
            with counter:
                out = eng.generate(prompts)
            rounds = max(r.rounds for r in out)
            top = ", ".join(f"{n / rounds:.1f} {name}" for name, n in counter.where.most_common(args.top))
            lines.append(f"{k:2d} {bs:5d} {rounds:6d} {sum(counter.where.values()) / rounds:11.1f}  {top}")
            print(lines[-1], flush=True)
    ModelRunner._step = step
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
