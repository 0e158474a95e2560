"""How many tensor ops a round dispatches outside the models' forwards, and where: each is a kernel launch on a GPU
(a few microseconds of host and device time) that a captured step does not absorb. Counted, not timed: the same
on any machine. A tiny random pair (64 wide, 2,048-token vocabulary, `--layers` layers: what grows with a model's
depth shows there), greedy, 16-29-token prompts (`--trees`: a 9-token phrase repeated, so that prompt lookup
finds it), 32 new tokens, the static padded steps a GPU captures (`step_graphs=True`, each forward one replay there);
the count is over one warm generate() per case, divided by its rounds (a row's admission and its leaving are in
it too: per job, not per round). `eager fwd`: a round's ops inside forwards no captured step holds (a GPU launches
each, or fewer where the compiled pieces fuse those between the attentions). Cases: k=0 autoregressive, k=K a draft
model's fixed chains of K; `--trees`: prompt lookup's chains and AASD token trees (2 siblings; K=3); each on dense
rows and, with `--paged`, a paged cache. `--ahead-pays`: rounds drafted ahead as on a GPU (prompt lookup's from the
device's tokens).
`--job J`: J times as many prompts as the batch has rows, each row its own max_new_tokens (8-32), so that rows
end at different rounds and queued ones join, their prefill's tail in a round's forward (an eager forward on a
GPU too: `joins` counts those rounds, `ops a join` what each dispatches).

`--pieces`: first, one joining forward (6 rows stepping one token, 2 rows joining with 25) eagerly, and with the
pieces between its attentions as one call each, as compiled pieces run: the ops left between the calls.

    python bench/round_ops.py [--batches 2,8,16] [--ks 0,2] [--trees] [--paged] [--layers 2] [--job 1] [--pieces]
                              [--ahead-pays] [--top 12] [--out FILE]
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
from specdec.exec.graphs import StepGraphs  # noqa: E402
from specdec.exec.runner import ModelRunner  # noqa: E402


class Ops(TorchDispatchMode):
    """Counts the ops dispatched outside `ModelRunner._step` (a forward), by the innermost specdec function; and inside
    the forwards no graph holds (`eager`: not under `StepGraphs.run`; a GPU runs those eagerly)."""

    def __init__(self):
        super().__init__()
        self.where: collections.Counter = collections.Counter()
        self.inside = 0
        self.graphed = 0  # inside `StepGraphs.run`
        self.eager = 0  # ops of forwards outside it
        self.top = 12  # functions a case lists
        self.joins = 0  # forwards that took joining rows (`ModelRunner.step_joined`), and their ops
        self.join_ops = 0

    def uncounted(self, f):
        """f with the ops it dispatches not counted (a forward's; a compiled half's, one call), its calls counted in
        `calls`."""
        def call(*a, **kw):
            self.inside += 1
            call.calls += 1
            try:
                return f(*a, **kw)
            finally:
                self.inside -= 1
        call.calls = 0
        return call

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.inside and not self.graphed and not func.is_view:
            self.eager += 1
        if not self.inside and not func.is_view:  # views launch nothing
            frames = [f for f in traceback.extract_stack() if f"{os.sep}specdec{os.sep}" in f.filename]
            at = frames[-1] if frames else None
            name = "?" if at is None else f"{at.filename.split(os.sep + 'specdec' + os.sep)[1]}:{at.name}"
            self.where[name] += 1
        return func(*args, **(kwargs or {}))


def case(name: str, layers: int, bs: int, kv_cache: str, target, draft, counter: Ops, job: int = 1) -> str:
    """One case's line: rounds, ops a round, joining forwards and their ops, and the functions that dispatch the
    most."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(16, 30, (bs * job,), generator=g).tolist()
    if name in ("chains", "trees"):
        phrases = [torch.randint(0, 2048, (9,), generator=g).tolist() for _ in lengths]
        prompts = [(p * 4)[:n] for p, n in zip(phrases, lengths)]
        spec = SpecConfig(method="prompt_lookup", draft_length="fixed", num_draft_tokens=3,
                          prompt_lookup={"alignment_sampling": 2 if name == "trees" else 0})
    else:
        prompts = [torch.randint(0, 2048, (n,), generator=g).tolist() for n in lengths]
        k = int(name)
        spec = SpecConfig(method="none") if k == 0 else \
            SpecConfig(method="draft_model", draft_length="fixed", num_draft_tokens=k)
    uses_draft = spec.method == "draft_model"
    eng = SpecEngine(pair(target, draft if uses_draft else None), SamplingParams(max_new_tokens=32), spec,
                     batch_size=bs, step_graphs=True, kv_cache=kv_cache)
    params = None if job == 1 else [SamplingParams(max_new_tokens=int(m))
                                     for m in torch.randint(8, 33, (len(prompts),), generator=g)]
    eng.generate(prompts, params=params)  # warm
    counter.where.clear()
    counter.joins = counter.join_ops = counter.eager = 0
    before = eng.context.staging.rounds
    with counter:
        eng.generate(prompts, params=params)
    rounds = eng.context.staging.rounds - before
    top = ", ".join(f"{n / rounds:.1f} {where}" for where, n in counter.where.most_common(counter.top))
    ops = sum(counter.where.values()) / rounds
    per_join = counter.join_ops / max(1, counter.joins)
    return (f"{name:>5s} {kv_cache:>5s} {layers:6d} {bs:5d} {rounds:6d} {ops:11.1f} {counter.eager / rounds:9.1f} "
            f"{counter.joins:5d} {per_join:10.0f}  {top}")


def pieces(target, counter: Ops) -> str:
    """A joining forward's ops, eager and with the pieces between its attentions as opaque calls (`--pieces`)."""
    from specdec.exec import llama
    from specdec.exec.cache import RaggedKVCache

    layers = target.config.num_hidden_layers
    cache = RaggedKVCache(target, rows=8, max_len=128)
    parts = [(torch.zeros(6, 1, dtype=torch.long), torch.full((6, 1), 20), 64, 0),
             (torch.zeros(2, 25, dtype=torch.long), torch.arange(25).expand(2, 25), 25, 6)]
    opaque = [counter.uncounted(f) for f in (llama._first, llama._between, llama._last)]
    weights, counts = llama.load_weights(target), []
    for run in (llama.EAGER, llama.Pieces(*opaque)):
        counter.where.clear()
        with counter:
            llama.forward_parts(weights, cache, parts, run)
        counts.append(sum(counter.where.values()))
    return (f"# a joining forward, {layers} layers (6 rows x 1 token, 2 rows x 25): eager {counts[0]} ops "
            f"({counts[0] / layers:.1f} a layer); with each piece one call ({sum(f.calls for f in opaque)} calls) "
            f"{counts[1]} ops between them ({counts[1] / layers:.1f} a layer)")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="2,8,16")
    ap.add_argument("--ks", default="0,2", help="fixed draft lengths (0: autoregressive)")
    ap.add_argument("--trees", action="store_true", help="also prompt lookup's chains and AASD token trees")
    ap.add_argument("--paged", action="store_true", help="each case also over a paged KV cache")
    ap.add_argument("--layers", type=int, default=2, help="the pair's decoder layers")
    ap.add_argument("--job", type=int, default=1, help="prompts per row of the batch (> 1: rows join as others end)")
    ap.add_argument("--pieces", action="store_true", help="first, a joining forward's ops between its pieces")
    ap.add_argument("--ahead-pays", action="store_true", help="draft ahead at a cost, as on a GPU (prompt lookup's "
                    "chains and trees built on the device while a round is in flight)")
    ap.add_argument("--top", type=int, default=12, help="functions listed per case")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.ahead_pays:
        from specdec.spec.proposers.base import Proposer
        Proposer.ahead_pays = property(lambda self: True)
    torch.manual_seed(0)
    target = tiny_llama(vocab=2048, layers=args.layers, seed=3)
    draft = noisy_copy(target, 0.02)
    counter = Ops()
    counter.top = args.top
    step = ModelRunner._step
    joined = ModelRunner.step_joined

    def counted_join(self, *a, **kw):
        before = sum(counter.where.values())
        try:
            return joined(self, *a, **kw)
        finally:
            counter.joins += 1
            counter.join_ops += sum(counter.where.values()) - before

    run = StepGraphs.run

    def graphed(self, *a, **kw):
        counter.graphed += 1
        try:
            return run(self, *a, **kw)
        finally:
            counter.graphed -= 1

    ModelRunner._step, ModelRunner.step_joined, StepGraphs.run = counter.uncounted(step), counted_join, graphed
    lines = ["# ops a round dispatches outside the models' forwards (tiny pair, greedy, 32 new tokens, static steps)",
             f"{'case':>5s} {'cache':>5s} {'layers':>6s} {'batch':>5s} {'rounds':>6s} {'ops a round':>11s} "
             f"{'eager fwd':>9s} {'joins':>5s} {'ops a join':>10s}  most, a round: function"]
    if args.pieces:
        lines.insert(0, pieces(target, counter))
    print("\n".join(lines), flush=True)
    names = [str(int(k)) for k in args.ks.split(",")] + (["chains", "trees"] if args.trees else [])
    try:
        for name in names:
            for kv_cache in ("dense", "paged") if args.paged else ("dense",):
                for bs in [int(x) for x in args.batches.split(",")]:
                    lines.append(case(name, args.layers, bs, kv_cache, target, draft, counter, args.job))
                    print(lines[-1], flush=True)
    finally:
        ModelRunner._step, ModelRunner.step_joined, StepGraphs.run = step, joined, run
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
