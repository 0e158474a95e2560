"""Measuring a cost profile (specdec/costmodel.py) through the engine's own code, on synthetic rows.

For every batch-size bucket up to the engine's batch size: the draft's work for a round of one and of
two drafts (`proposer.propose`) and one target forward with verification per width (`Rounds.verify`,
which also seeds verify padding's width timings), each the minimum of `samples` runs taken back to
back; widths are timed upwards while a length could still win at an optimistic 0.8 acceptance, given
that drafting more never makes a round cheaper; for token trees, also the widest tree of the longest
such length (narrower trees' costs lie on the line between). Every width is then timed once more after
all of them, so a slowdown of the machine lasting a few timings cannot bias neighbouring widths together.
Then a 1-row and a 2-row prefill (their difference is a prefill call's fixed cost) and one row's draft
prefill. Times are read from the engine's clock. Rows repeat a 16-token pattern (prompt
lookup finds full drafts in it; a model's cost does not depend on the tokens) and are cut back to
`context` tokens after every round, so every round runs at the same length and leaves nothing behind.
"""

from __future__ import annotations

import numpy as np
import torch

from typing import TYPE_CHECKING

from .batch import sync
from .costmodel import Profile, best_length, bucket, expected_tokens
from .policies.simple import FixedLength
from .proposers.base import Draft, Tree
from .rounds import Request, Rounds

if TYPE_CHECKING:
    from .engine import SpecEngine

OPTIMISTIC = 0.8  # per-token acceptance the profile allows a pair it has not seen yet


def measure(engine: SpecEngine, context: int = 64, samples: int = 2, every_width: bool = False) -> Profile:
    """The engine's cost profile; `every_width` times every verification width up to max_draft_tokens + 1
    (for estimates of other policies), not only those that could win."""

    m, cap, dev = engine.spec.max_draft_tokens, engine.batch_size, engine.device
    g = torch.Generator().manual_seed(0)
    pattern = torch.randint(0, engine.vocab_size, (cap, 16), generator=g)
    prompts = pattern.repeat(1, context // 16 + 1)[:, :context].tolist()
    policy = FixedLength(engine.spec)  # drafts on demand, prefills the draft
    batch = engine.new_batch(cap, context + engine.spec.max_nodes + 2, policy)
    loop = Rounds(engine, batch, policy, [Request(p, i, 0, engine.sampling, i) for i, p in enumerate(prompts)],
                  [None] * cap)
    loop.admit(list(range(cap)))
    drafting = engine.method.draft_model
    trees = engine.method.siblings(engine.spec)
    hardware = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"CPU x{torch.get_num_threads()}"
    profile = Profile(hardware=f"{hardware}, {next(engine.target.parameters()).dtype}")

    def best(fn, runs: int = samples) -> float:
        times = []
        for _ in range(runs):
            sync(dev)
            t0 = engine.clock()
            fn()
            sync(dev)
            times.append(engine.clock() - t0)
        return min(times)

    def reset(n: int) -> None:
        batch.lens[:n] = context
        batch.cached[:n] = context - 1
        batch.proposer.rewind(n)

    def draft_seconds(n: int, k: int) -> float:
        def run():
            u = loop.randomness(n, k + 1)  # the draft's share of the round's uniforms (or noise), when sampling
            batch.proposer.propose(n, np.full(n, k), None if u is None else u[:, :m])
        t = best(run)  # the draft cache's length stays as it was
        reset(n)
        return t

    def verify_seconds(n: int, width: int, depth: int | None = None, runs: int = samples) -> float:
        """A chain of width - 1 drafts; with `depth`, a tree of width - 1 nodes: a chain that deep, the rest
        leaves under the root."""
        k = width - 1
        tokens = torch.randint(0, engine.vocab_size, (n, k), generator=g).to(dev)
        q = None if engine.sampling.greedy or not drafting else \
            torch.full((n, k, engine.vocab_size), 1.0 / engine.vocab_size, device=dev)
        draft = Draft(tokens, torch.full((n,), k, device=dev), q)
        if depth is not None:
            ar = torch.arange(k, device=dev)
            parent, depths = torch.where(ar < depth, ar, 0), torch.where(ar < depth, ar + 1, 1)
            draft.tree = Tree(parent[None].expand(n, k), depths[None].expand(n, k), depth)

        def run():
            loop.verify(n, draft, width, loop.randomness(n, (k if depth is None else depth) + 1))
            reset(n)
        return best(run, runs)

    for b in sorted({bucket(min(1 << i, cap)) for i in range(cap.bit_length() + 1)}):
        n = min(b, cap)
        if m and drafting:
            profile.draft_one[b] = draft_seconds(n, 1)
            profile.draft_two[b] = draft_seconds(n, 2) if m > 1 else profile.draft_one[b]
        elif m:  # prompt lookup: drafting costs the host's lookup only, inside the round
            profile.draft_one[b] = profile.draft_two[b] = 0.0
        target = profile.target[b] = {}
        shapes: dict[int, int | None] = {}  # width -> a tree's depth (None: a chain)
        for w in range(1, m + 2):
            k = w - 1
            if k and not every_width and not worth_timing(profile, b, k):
                break
            target[w], shapes[w] = verify_seconds(n, w), None
        deep = max(target) - 1  # the longest chain that could win
        if trees and deep:  # the widest tree of that depth: trees' widths lie between (specdec/costmodel.py)
            w = 1 + deep * (1 + trees)
            target[w], shapes[w] = verify_seconds(n, w, deep), deep
        for w, depth in shapes.items():  # once more each, after all the others
            target[w] = min(target[w], verify_seconds(n, w, depth, runs=1))

    def prefill(runner, rows: int) -> float:
        return best(lambda: batch.prefill(runner, 0, rows))

    if cap > 1:
        profile.prefill_fixed = max(0.0, 2 * prefill(batch.target, 1) - prefill(batch.target, 2))
    if drafting:
        profile.draft_prefill = prefill(batch.proposer.runner, 1)
    return profile


def worth_timing(profile: Profile, b: int, k: int) -> bool:
    """Could k drafts win at an optimistic acceptance, at no less than the longest timed width's cost?"""
    tokens = expected_tokens(np.array([OPTIMISTIC]), k)[0]  # [k + 1]
    seconds = profile.rounds(b, k)  # the widest timed width stands in for the untimed one: a lower bound
    return best_length(tokens, seconds) == k
