"""Steps captured before a job's rows join: none met first inside the job, tokens unchanged (issue 55, part 3).

On a CPU `step_graphs=True` runs the same padded static steps eagerly, keyed as a GPU's captured graphs are, so
the keys a job meets can be counted here."""

import itertools

import pytest
import torch

from engine_models import DEVICE, flat_profile, noisy_copy, pair, tiny_llama
from specdec.config import SamplingParams, SpecConfig
from specdec.engine import SpecEngine
from specdec.exec.graphs import width_buckets


def shapes(eng) -> set[tuple]:
    """The step shapes every runner of the engine has run on its fast path (on a GPU: captured)."""
    return {(name, key) for name, r in eng._runners.items() if r.graphs is not None
            for key in [*r.graphs.graphs, *r.eager]}


def job(method: str, draft_length: str, kv_cache: str, budget: float, graphs: bool = True, **spec):
    """A job of 11 prompts of 3-70 tokens through a batch of 5 (row buckets 1, 2, 4, 5), 40 new tokens each (a
    few rows stop at 17), greedy, through static steps (or eager ones: `graphs` off): the engine, its results, the
    shapes after its start-up capture and at its end."""
    target = tiny_llama(seed=4)
    draft = noisy_copy(target, 0.05) if method == "draft_model" else None
    ticks = itertools.count()
    eng = SpecEngine(pair(target, draft), SamplingParams(max_new_tokens=40),
                     SpecConfig(method=method, draft_length=draft_length,
                                **({"num_draft_tokens": 3, "max_draft_tokens": 5} | spec)),
                     batch_size=5, step_graphs=graphs, profile=flat_profile(), clock=lambda: float(next(ticks)),
                     kv_cache=kv_cache, capture_budget=budget)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 96, (int(n),), generator=g).tolist() for n in torch.randint(3, 71, (11,), generator=g)]
    params = [SamplingParams(max_new_tokens=17 if i % 4 == 0 else 40) for i in range(len(prompts))]
    at_start, capture = [], eng.capture_steps

    def counted(*args):
        capture(*args)
        at_start.append(shapes(eng))

    eng.capture_steps = counted
    out = eng.generate(prompts, params=params)
    return eng, out, at_start[0], shapes(eng)


AASD = {"prompt_lookup": {"alignment_sampling": 2}}  # prompt lookup's token trees


@pytest.mark.parametrize("method,draft_length,kv_cache,spec", [
    ("none", "fixed", "dense", {}), ("draft_model", "fixed", "dense", {}), ("draft_model", "goodput", "dense", {}),
    ("draft_model", "goodput", "paged", {}), ("prompt_lookup", "heuristic", "dense", {}),
    ("prompt_lookup", "fixed", "paged", AASD),
])
def test_a_job_meets_no_step_it_did_not_capture_before_its_rows_joined(method, draft_length, kv_cache, spec):
    eng, out, before, after = job(method, draft_length, kv_cache, budget=60.0, **spec)
    assert after == before, f"met inside the job: {sorted(after - before)}"
    _, plain, none_before, none_after = job(method, draft_length, kv_cache, budget=0.0, **spec)
    if spec:  # the job met token trees' steps, the capture plan held them, and eager steps give the same rows
        assert any(key[3] == "tree" for _, key in none_after), none_after
        eager = job(method, draft_length, kv_cache, budget=0.0, graphs=False, **spec)[1]
        assert [r.token_ids for r in out] == [r.token_ids for r in eager]
    assert not none_before and none_after, "without a budget nothing is captured first, and the job meets its steps"
    assert none_after <= before  # the capture plan holds every step the job meets
    assert [r.token_ids for r in out] == [r.token_ids for r in plain]  # capturing first changes no token
    widths = {key[1] for _, key in before if key[3] != "tree"}
    assert widths <= set(width_buckets(6)), "steps are padded to the width buckets"
    assert {key[1] for _, key in before if key[3] == "tree"} <= set(width_buckets(eng.tree_width))  # trees' too
    if method == "draft_model":
        assert sum(r.drafted_tokens for r in out) > 0
        assert {"target", "draft"} == {name for name, _ in before}


def test_a_fixed_length_captures_only_the_widths_it_drafts():
    """Fixed k=2 under max_draft_tokens 16 without verify padding: the target's steps 1, 2 and 4 wide (k + 1 = 3
    pads to 4), the draft's one-token steps and catch-ups up to 4 wide; not the 8-, 16- and 17-wide ones a policy
    drafting up to 16 could take. The job still meets no other."""
    _, _, before, after = job("draft_model", "fixed", "dense", 60.0, num_draft_tokens=2, max_draft_tokens=16,
                              verify_padding=False)
    assert after == before
    assert {key[1] for name, key in before if name == "target"} == {1, 2, 4}
    assert {(key[1], key[3]) for name, key in before if name == "draft"} == {(1, "all"), (1, "last"), (2, "last"),
                                                                           (4, "last")}


def test_steps_padded_to_a_width_bucket_give_the_unpadded_steps_tokens():
    """A fixed k=2 round verifies 3 tokens per row through a step 4 wide (junk past each row's draft): the same
    tokens, rounds and acceptance as the eager steps, which pad nothing."""
    target = tiny_llama(seed=4)
    draft = noisy_copy(target, 0.05)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 96, (int(n),), generator=g).tolist() for n in torch.randint(3, 40, (6,), generator=g)]
    runs = []
    for graphs in (True, False):
        eng = SpecEngine(pair(target, draft), SamplingParams(max_new_tokens=30),
                         SpecConfig(method="draft_model", draft_length="fixed", num_draft_tokens=2),
                         batch_size=3, step_graphs=graphs)
        runs.append([(r.token_ids, r.rounds, r.accepted_tokens) for r in eng.generate(prompts)])
        if graphs:
            widths = {key[1] for key in eng.runner("target").graphs.graphs}
            assert 4 in widths and 3 not in widths  # max_draft_tokens 8: steps up to 9 wide, buckets 1, 2, 4, 8, 9
    assert runs[0] == runs[1]


@pytest.mark.parametrize("method,draft_length,kv_cache", [("draft_model", "fixed", "dense"),
                                                          ("draft_model", "goodput", "paged")])
def test_steps_left_out_run_padded_to_captured_ones_until_met_often(method, draft_length, kv_cache, monkeypatch):
    """A job whose start-up captured nothing (budget 0): a step of a shape not captured yet runs through a captured
    one with more rows, tokens or slots (`ModelRunner.cover`) until it is met more than COVER_STEPS times, and is
    captured then (one that nothing covers is captured when first met); so the job captures fewer shapes than one
    that captures each when first met (COVER_STEPS 0), more with COVER_STEPS 2 than with 32, and its tokens are those
    of either."""
    from specdec.exec.runner import ModelRunner

    runs = {}
    for most in (0, 2, ModelRunner.COVER_STEPS):
        monkeypatch.setattr(ModelRunner, "COVER_STEPS", most)
        eng, out, before, after = job(method, draft_length, kv_cache, budget=0.0)
        assert not before
        runs[most] = [r.token_ids for r in out], after
        for name, runner in eng._runners.items():  # a shape met often was captured
            assert all((name, key) in after for key, met in runner.met.items() if met > most)
    tokens = [t for t, _ in runs.values()]
    assert tokens[0] == tokens[1] == tokens[2]
    captured = [len(after) for _, after in runs.values()]
    assert captured[0] > captured[1] > captured[2] > 0, captured


def external_reads(fn, *args) -> tuple[list[tuple], object]:
    """fn(*args) under a dispatch mode: what it returns, and each tensor its ops read that none of them made
    (op, storage address, offset, shape), in order."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    made, reads = set(), []

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            read = set()
            for t in tree_flatten((args, kwargs or {}))[0]:
                if isinstance(t, torch.Tensor) and t.numel() and t.untyped_storage().data_ptr() not in made:
                    read.add(t.untyped_storage().data_ptr())
                    reads.append((func.__name__, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)))
            out = func(*args, **(kwargs or {}))
            made.update(t.untyped_storage().data_ptr() for t in tree_flatten(out)[0]
                        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in read)
            return out

    with Reads():
        out = fn(*args)
    return reads, out


@pytest.mark.skipif(DEVICE == "cuda", reason="a GPU replays real graphs: this holds a CPU's steps to their rules")
@pytest.mark.parametrize("method,kv_cache", [("none", "dense"), ("draft_model", "dense"), ("draft_model", "paged"),
                                             ("prompt_lookup", "dense")])
def test_a_captured_step_reads_the_same_tensors_at_every_replay(method, kv_cache, monkeypatch):
    """A CUDA graph replays the reads and writes of its capture, at the addresses it had then, and returns the same
    output tensors each time. Here, where steps run eagerly on their static buffers, each step of a job (rows
    leaving and joining, overlapped rounds) records the tensors it reads besides those it makes, which must be its
    key's first run's; its outputs are copied into tensors of its key's own, as a graph's are overwritten by its
    next replay, and every other key's are spoilt (NaN, -7), as one pool's graphs may write where another's outputs
    lie: the tokens stay those of eager steps. A step made to read a rebuilt RoPE table is caught."""
    from torch.utils._pytree import tree_flatten, tree_map

    from specdec.exec.graphs import StepGraphs

    first: dict[tuple, tuple[list, object]] = {}
    ran = []
    real_run = StepGraphs.run

    def run(self, key, fn, rows, *inputs):  # StepGraphs' own, its step run as a replay would
        def replay(*static):
            reads, out = external_reads(fn, *static)
            if (id(self), key) not in first:  # its first run: what later runs read, and where outputs are kept
                first[id(self), key] = reads, tree_map(torch.empty_like, out)
            seen, kept = first[id(self), key]
            assert reads == seen, f"step {key} read {len(reads)} tensors, other than the {len(seen)} of its first run"
            for (graphs, other), (_, outputs) in first.items():  # graphs share a pool: a replay may write where
                if graphs == id(self) and other != key:  # another's outputs lie
                    for t in tree_flatten(outputs)[0]:
                        t.fill_(float("nan") if t.is_floating_point() else -7)
            for buf, x in zip(tree_flatten(kept)[0], tree_flatten(out)[0]):
                buf.copy_(x)
            ran.append(key)
            return kept

        return real_run(self, key, replay, rows, *inputs)

    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 96, (int(n),), generator=g).tolist() for n in torch.randint(3, 50, (9,), generator=g)]
    params = [SamplingParams(max_new_tokens=int(m)) for m in torch.randint(6, 30, (9,), generator=g)]
    target = tiny_llama(seed=4)
    draft = noisy_copy(target, 0.05) if method == "draft_model" else None
    spec = SpecConfig(method=method, draft_length="fixed", num_draft_tokens=2)
    outs = []
    for graphs in (False, True):
        eng = SpecEngine(pair(target, draft), SamplingParams(max_new_tokens=32), spec, batch_size=4,
                         step_graphs=graphs, kv_cache=kv_cache)
        if graphs:
            monkeypatch.setattr(StepGraphs, "run", run)
        outs.append([(r.token_ids, r.rounds) for r in eng.generate(prompts, params=params)])
    assert outs[0] == outs[1]
    assert len(ran) > 2 * len(first) > 0  # keys replayed, and compared
    lean = eng.runner("target").lean
    lean.cos = lean.cos.clone()  # as code that rebuilt a tensor every step reads would
    with pytest.raises(AssertionError, match="other than"):
        eng.generate(prompts[:2], params=params[:2])
