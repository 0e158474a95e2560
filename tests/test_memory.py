"""The memory plan (specdec/exec/memory.py) against what the engine really allocates, and rows that would index
past the models' position table.

What a run allocates is measured, not computed: `Peak` records every tensor storage created while it is on
(caches, captured steps' buffers, activations, the batch's buffers) and the most bytes alive at once. On a
GPU a captured step keeps its outputs until its key runs again (specdec/exec/graphs.py); on a CPU `StepGraphs`
keeps the same static inputs and recomputes the outputs, so `KeptGraphs` keeps each key's last outputs too,
as a graph would. Device figures are injected through `SpecEngine.device_memory`, so a CPU drives the plan.
"""

from __future__ import annotations

import weakref
from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from engine_models import noisy_copy, pair, flat_profile, tiny_llama
from specdec.exec import llama, memory
from specdec.exec import runner as runner_mod
from specdec.exec.cache import BLOCK
from specdec.config import SamplingParams, SpecConfig
from specdec.engine import SpecEngine
from specdec.exec.graphs import StepGraphs
from specdec.sched.rounds import Rounds

GiB = memory.GiB


class Peak(TorchDispatchMode):
    """Bytes of the tensor storages created inside it that are still alive, and the most at once (`peak`)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

    def _freed(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in inputs or key in self.live or storage.nbytes() == 0:  # a view, or written in place
                continue
            self.live[key] = storage.nbytes()
            self.now += storage.nbytes()
            weakref.finalize(storage, self._freed, key)
            self.peak = max(self.peak, self.now)
        return out


class KeptGraphs(StepGraphs):
    """StepGraphs that also keep each key's last outputs on a CPU, as a captured graph keeps its own."""

    def __init__(self, device):
        super().__init__(device)
        self.kept: dict[tuple, object] = {}

    def run(self, key, fn, rows, *inputs):
        out = super().run(key, fn, rows, *inputs)
        self.kept[key] = out
        return out


@pytest.fixture
def kept_graphs(monkeypatch):
    monkeypatch.setattr(runner_mod, "StepGraphs", KeptGraphs)


@pytest.fixture(scope="module")
def models():
    target, other = tiny_llama(vocab=300, seed=0).cpu(), tiny_llama(vocab=300, layers=1, seed=5).cpu()  # measured here
    draft = noisy_copy(target, 0.02)
    for m in (target, draft, other):
        llama.load_weights(m)  # fused once, outside any measurement
    return {"target": target, "draft": draft, "small": other}


def make_engine(models, method="draft_model", bs=4, max_new=16, m=4, draft="draft", figures=(1 << 40, 1 << 40),
                sp=None, prefill_chunk: int | None = 2048, kv_cache: str = "dense", kv_block: int = BLOCK, **spec):
    spec = {"max_draft_tokens": m, "num_draft_tokens": m, "draft_length": "fixed", **spec}
    eng = SpecEngine(pair(models["target"], models[draft] if method == "draft_model" else None),
                     SamplingParams(max_new_tokens=max_new, **(sp or {})), SpecConfig(method=method, **spec),
                     batch_size=bs, step_graphs=True, profile=flat_profile(), prefill_chunk=prefill_chunk,
                     kv_cache=kv_cache, kv_block=kv_block)
    eng.device_memory = lambda: figures
    return eng


def prompts_of(lengths, vocab=300, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def visit_every_key(eng, keys: dict[str, set]) -> None:
    """Run one step of every key `keys` names (per model) on the engine's runners: a long job's captured steps."""
    with torch.inference_mode():
        _visit(eng, keys)


def _visit(eng, keys: dict[str, set]) -> None:
    for name, runner in eng._runners.items():
        dev = runner.device
        runner.sealed = False  # a long job meets each step often enough to capture it (ModelRunner.cover)
        for rows, width, kv, out in sorted(keys.get(name, ())):
            positions = (kv - width + torch.arange(width, device=dev))[None, :].expand(rows, width)
            tokens = torch.zeros((rows, width), dtype=torch.int64, device=dev)
            last = torch.full((rows,), width - 1, device=dev) if out == "last" else None
            tree = (torch.arange(kv, device=dev) <= positions[:, :, None])[:, None] if out == "tree" else None
            runner.step(tokens, positions, kv, last, slots=None if tree is None else positions, mask=tree)


def captured(eng) -> dict[str, set]:
    return {name: set(r.graphs.graphs) for name, r in eng._runners.items() if r.graphs is not None}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("kv_cache", ["dense", "paged"])
def test_on_a_gpu_the_plan_covers_the_allocators_peak(monkeypatch, kv_cache):
    """On a GPU, what the caching allocator hands out (real CUDA graphs and their pool, SDPA's additive mask, a
    prefill of every row) stays within the plan's figure, and not 2.5x under it: a run, every planned key (dozens
    of captures), the run again, on a bf16 model big enough for its activations to count; dense rows, and a paged
    pool whose rows share a 512-token instruction (held by reference, its blocks pinned by the prefix store). The
    layer runs uncompiled (compiling takes minutes); the plan's real device figures size the batch. First in this
    file: the GPU kit's budget reaches it before the tests that measure on the CPU."""
    monkeypatch.setattr(runner_mod.ModelRunner, "compile_layers", False)
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, num_hidden_layers=4, num_attention_heads=16,
                      num_key_value_heads=4, intermediate_size=2816, max_position_embeddings=4096)
    target = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval().requires_grad_(False)
    draft = noisy_copy(target, 0.02)
    for m in (target, draft):
        llama.load_weights(m)
    eng = SpecEngine(pair(target, draft), SamplingParams(max_new_tokens=32), SpecConfig(max_draft_tokens=4),
                     batch_size=16, profile=flat_profile(), kv_cache=kv_cache)
    prompts = prompts_of([1500, 20, 700, 1000] * 4, vocab=32000)
    if kv_cache == "paged":
        prompts = [prompts[0][:512] + p for p in prompts]
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    first = [r.token_ids for r in eng.generate(prompts)]
    need = eng.need
    keys = eng.memory_plan().keys(need.rows, need.max_len)
    visit_every_key(eng, keys)
    again = [r.token_ids for r in eng.generate(prompts)]
    torch.cuda.synchronize()
    used = torch.cuda.max_memory_allocated() - base
    assert eng.step_path.startswith("graphs") and captured(eng) == keys and again == first
    # besides the plan's figure: the two streams' cuBLAS workspaces (within its slack) and the prefix store
    # (within what the plan leaves)
    beside = 2 * memory.STREAM_WORKSPACE + eng.prefix.nbytes
    assert 2 * memory.STREAM_WORKSPACE <= eng.memory_plan().slack
    assert used <= need.total + beside and need.total <= 2.5 * used, (used, need, beside)


GRID = [  # method, batch size, prompt lengths, max_new_tokens, max_draft_tokens, extra settings
    ("draft_model", 4, [10, 50, 30, 100, 7], 24, 4, {}),
    ("draft_model", 8, [100] * 8, 16, 6, {"sp": {"temperature": 0.8, "top_p": 0.9, "top_k": 40}}),
    ("draft_model", 2, [300, 10], 100, 8, {"draft": "small", "draft_length": "heuristic", "num_draft_tokens": 0}),
    ("draft_model", 1, [400], 40, 3, {}),
    ("none", 3, [200, 5, 40], 30, 4, {}),
    ("prompt_lookup", 4, [60, 20, 90], 20, 4, {"prompt_lookup": {"alignment_sampling": 2}}),
    # AASD's trees built on the device while a round is in flight, as on a GPU (`Proposer.ahead_pays`)
    ("prompt_lookup", 4, [60, 20, 90], 20, 4, {"prompt_lookup": {"alignment_sampling": 2}, "ahead": True}),
    ("prompt_lookup", 6, [40] * 7, 64, 2, {}),
    ("none", 3, [400, 350, 40], 16, 4, {"prefill_chunk": 128}),  # the prefill in forwards of 3 rows x 42 tokens
    ("prompt_lookup", 4, [300, 20, 250], 8, 4, {"prefill_chunk": 100, "prompt_lookup": {"alignment_sampling": 2}}),
    ("draft_model", 2, [300, 10], 100, 8, {"draft": "small", "draft_length": "heuristic", "num_draft_tokens": 0,
                                           "prefill_chunk": 64}),  # both models prefill in chunks
]


@pytest.mark.parametrize("method,bs,lengths,max_new,m,extra", GRID)
def test_the_plan_covers_what_a_run_allocates(models, kept_graphs, method, bs, lengths, max_new, m, extra,
                                              monkeypatch):
    """Planned >= allocated, and not more than 2.5x: a run, then one step of every key the plan allows for (what a
    long job ends up holding), then the run again. The caches are the length the plan counted (rounded up), the
    runners capture exactly the keys it counted, and steps wider than its width run eagerly."""
    if extra.get("ahead"):
        from specdec.spec.proposers.base import Proposer
        monkeypatch.setattr(Proposer, "ahead_pays", property(lambda self: True))
    eng = make_engine(models, method, bs, max_new, m, **{k: v for k, v in extra.items() if k != "ahead"})
    prompts = prompts_of(lengths)
    with Peak() as peak:
        first = [r.token_ids for r in eng.generate(prompts)]
        need = eng.need
        plan = eng.memory_plan()
        keys = plan.keys(need.rows, need.max_len)
        assert all(captured(eng)[name] <= keys[name] for name in keys)  # the run's keys are planned ones
        visit_every_key(eng, keys)
        wide = eng.graph_width + 1
        with torch.inference_mode():
            eng._runners["target"].step(torch.zeros((1, wide), dtype=torch.int64), torch.arange(wide)[None], 64)
        again = [r.token_ids for r in eng.generate(prompts)]
    assert again == first and eng.need == need  # the same caches, kept: the same output
    row_len = max(eng.row_tokens(n) for n in lengths)
    assert need.max_len == eng.alloc_len(row_len)
    for runner in eng._runners.values():
        assert (runner.cache.rows, runner.cache.max_len) == (need.rows, need.max_len)
    assert captured(eng) == keys  # every key planned, none else (not the wide step)
    assert need.batch == need.rows == min(bs, len(prompts))
    assert peak.peak <= need.total <= 2.5 * peak.peak, (peak.peak, need)


@pytest.mark.parametrize("method,extra", [("draft_model", {}),
                                          ("prompt_lookup", {"prompt_lookup": {"alignment_sampling": 2}})])
def test_each_captured_key_keeps_what_the_plan_counts(models, kept_graphs, method, extra):
    """Per key, the plan's bytes are the static inputs and hidden states the runner keeps for it, exactly (AASD's
    token trees: their slots and masks too); every key's logits lie in the one buffer the runner's steps share, as
    large as the plan counts: its rows x its widest step's positions x the vocabulary."""
    eng = make_engine(models, method, bs=3, max_new=20, m=3, **extra)
    eng.generate(prompts_of([70, 8, 33]))
    plan = eng.memory_plan()
    keys = plan.keys(eng.need.rows, eng.need.max_len)
    visit_every_key(eng, keys)
    for role in plan.roles:
        graphs = eng._runners[role.name].graphs
        shared = graphs._shared
        assert shared.nbytes == role.shape.logits(eng.need.rows, memory.logits_width(plan.kinds(role)))
        for key in keys[role.name]:
            static, (logits, hidden) = graphs.graphs[key][1], graphs.kept[key]
            assert logits.untyped_storage().data_ptr() == shared.untyped_storage().data_ptr(), key
            kept = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in (*static, hidden)}
            assert sum(kept.values()) == role.shape.kept(*key), key


def test_the_prefill_estimate_bounds_a_measured_prefill(models):
    """The activation formula against one measured forward of each kind, within 2x above it."""
    from specdec.exec.cache import RaggedKVCache
    target = models["target"]
    shape = memory.Shape.of(target)
    for rows, tokens, kv, logits in [(4, 100, 100, "none"), (4, 100, 100, "top_ids"), (1, 500, 500, "none"),
                                     (8, 9, 500, "all"), (4, 200, 500, "last")]:
        runner = runner_mod.ModelRunner(target, RaggedKVCache(target, 8, 512), target.get_output_embeddings().weight)
        tok = torch.zeros((rows, tokens), dtype=torch.int64)
        with torch.inference_mode(), Peak() as peak:
            if logits in ("none", "top_ids"):
                runner.prefill(tok, 0, rows, top_ids=3 if logits == "top_ids" else 0)
            else:
                positions = (kv - tokens + torch.arange(tokens))[None].expand(rows, tokens)
                runner.step(tok, positions, kv, last=torch.full((rows,), tokens - 1) if logits == "last" else None)
        estimate = shape.forward(rows, tokens, kv, logits, top_ids=3, additive_mask=False)
        assert peak.peak <= estimate <= 2 * peak.peak, (rows, tokens, kv, logits, peak.peak, estimate)


def budget_for(eng, rows: int, lengths, fraction=0.9) -> tuple[int, int]:
    """Device figures (free, total) whose budget fits `rows` rows of these prompts and not one more."""
    plan = eng.memory_plan()
    row_len = max(eng.row_tokens(n) for n in lengths)
    need = lambda r: plan.need(r, eng.alloc_len(row_len), r, row_len, max(lengths)).total  # noqa: E731
    budget = (need(rows) + need(rows + 1)) // 2
    total = 8 * GiB
    return budget + plan.slack + total - int(fraction * total), total


def test_a_batch_that_does_not_fit_runs_with_fewer_rows(models, kept_graphs):
    """With room for 2 rows of these prompts the engine allocates 2 and runs them all, within the budget, with the
    output of an unconstrained run; the kept prompt prefixes take only what the two rows leave."""
    lengths = [80, 60, 70, 90, 50]
    free = make_engine(models, bs=5)
    ref = [r.token_ids for r in free.generate(prompts_of(lengths))]
    eng = make_engine(models, bs=5)
    figures = budget_for(eng, 2, lengths)
    eng.device_memory = lambda: figures
    plan = eng.memory_plan()
    with Peak() as peak:
        out = eng.generate(prompts_of(lengths))
    assert [r.token_ids for r in out] == ref
    assert eng.need.rows == eng.need.batch == 2 and eng._runners["target"].cache.rows == 2
    assert peak.peak <= plan.budget < free.need.total
    assert 0 < eng.prefix.nbytes <= plan.budget - eng.need.total


@pytest.mark.parametrize("kv_cache", ["dense", "paged"])
def test_a_batch_the_memory_bounds_still_keeps_the_prefix_its_rows_share(models, kept_graphs, kv_cache):
    """Eight rows that share a 200-token instruction, under a budget that 3 rows of them take whole: the plan holds
    back room for the shared blocks (one copy, in each model's store), so every row after the first reuses them
    (without it the store got nothing and every row computed the instruction again); fewer rows run at once, within
    the budget, with the output of an unconstrained run."""
    shared = prompts_of([200])[0]
    prompts = [shared + [250 + i, 7, 9] for i in range(8)]
    free = make_engine(models, bs=8, kv_cache=kv_cache)
    ref = [r.token_ids for r in free.generate(prompts)]
    plan, row = free.memory_plan(), free.row_tokens(len(prompts[0]))
    budget = plan.need(3, free.alloc_len(row), 3, row, len(prompts[0])).total + 1000
    eng = make_engine(models, bs=8, kv_cache=kv_cache, figures=(budget + plan.slack, 1 << 40))
    eng.gpu_memory_fraction = 1.0
    plan = eng.memory_plan()
    with Peak() as peak:
        out = eng.generate(prompts)
    assert [r.token_ids for r in out] == ref
    assert [r.cached_prompt_tokens for r in out] == [0] + [192] * 7  # whole 16-token blocks of the instruction
    assert eng.prefix.nbytes == 192 * eng.prefix.per_token
    assert 1 <= eng.need.batch < 8 and peak.peak <= plan.budget


@pytest.mark.parametrize("block", [BLOCK, 64])
def test_paged_rows_under_the_budget_of_two_dense_ones_run_more_at_once(kept_graphs, monkeypatch, block):
    """Mixed lengths under a budget that fits 2 dense rows (every row sized for the longest): the paged cache's
    pool holds the short rows' own slots (in blocks of 16 or 64), so twice the rows run at once, within the budget,
    with the same output, and rows that find no free blocks wait for them. (An 8-layer model: its keys and values,
    not its logits, take most of a row's bytes, as a real model's do.)"""
    models = {"target": tiny_llama(vocab=300, layers=8, seed=0).cpu()}
    lengths = [400, 40, 30, 50, 20, 45, 35, 25]
    dense = make_engine(models, "none", bs=8, prefill_chunk=64)
    figures = budget_for(dense, 2, lengths)
    dense.device_memory = lambda: figures
    ref = [r.token_ids for r in dense.generate(prompts_of(lengths))]
    assert dense.need.batch == 2
    eng = make_engine(models, "none", bs=8, figures=figures, prefill_chunk=64, kv_cache="paged", kv_block=block)
    plan = eng.memory_plan()
    held = []
    real_launch = Rounds.launch
    monkeypatch.setattr(Rounds, "launch", lambda self, *a: (held.append(self.batch.n), real_launch(self, *a))[1])
    with Peak() as peak:
        out = eng.generate(prompts_of(lengths))
    assert [r.token_ids for r in out] == ref
    pool = eng._runners["target"].cache
    assert pool.block == plan.block == block
    assert eng.need.pool == pool.blocks * block < sum(pool.reservation(eng.row_tokens(n)) for n in lengths)
    assert max(held) >= 2 * dense.need.batch
    assert peak.peak <= plan.budget


@pytest.mark.parametrize("rows, blocks, window", [(4, 64, 48), (16, 300, 48), (2, 40, 64)])
def test_a_flex_steps_block_mask_takes_what_the_plan_counts(models, rows, blocks, window):
    """A FlexAttention step over a paged pool (`paged_attention: flex`) builds a block mask over every pool block
    for each of its rows: what it allocates is at most the plan's `FLEX_MASK_BYTES` per row and block (and more
    than half of it), and an engine's plan counts it beside its captured steps only where it attends that way."""
    from specdec.exec.cache import PagedKVCache, _FlexView

    cache = PagedKVCache(models["target"], rows, 64 * BLOCK, blocks)
    cache.table[:] = torch.randint(1, blocks, cache.table.shape)
    positions = torch.full((rows, 4), 40 * BLOCK) + torch.arange(4)
    with Peak() as peak:
        view = _FlexView(cache, 0, rows, positions, window * BLOCK)  # (64: past the pool's 40 blocks)
    assert view.mask is not None
    planned = memory.FLEX_MASK_BYTES * rows * blocks
    assert planned / 2 < peak.peak <= planned + 4096, (peak.peak, planned)
    lengths = [300, 40, 30, 50]
    gather, flex = (make_engine(models, "none", bs=4, kv_cache="paged") for _ in range(2))
    flex.paged_attention = "flex"
    plans = [e.memory_plan() for e in (gather, flex)]
    needs = [p.need(4, 512, 4, 400, max(lengths), pool=blocks * BLOCK) for p in plans]
    assert not plans[0].flex and plans[1].flex
    assert needs[1].graphs - needs[0].graphs == memory.FLEX_MASK_BYTES * 4 * blocks


@pytest.mark.parametrize("method,spec", [("none", {}), ("draft_model", {}), ("draft_model", {"num_draft_tokens": 0})])
def test_paged_rows_of_one_instruction_share_its_blocks_and_more_of_them_run_at_once(kept_graphs, monkeypatch,
                                                                                     method, spec):
    """A synthesis job (12 rows of one 400-token instruction and a short input) under a budget that fits 3-4 whole
    rows: over a paged pool the store's blocks of the instruction are the rows' own (pinned, shared by reference),
    so a row reserves only what it writes and at least twice the rows run at once as without prefix caching, within
    the budget, with the same output, also after a call of one row (whose caches are then too small to keep), and
    with a draft that does not draft when rows join (K = 0: its pool shares the instruction too).
    (8-layer models: keys and values take most of a row's bytes.)"""
    target = tiny_llama(vocab=300, layers=8, seed=0).cpu()
    models = {"target": target, "draft": noisy_copy(target, 0.02)}
    shared = prompts_of([400])[0]
    prompts = [shared + [250 + i, 7, 9 + i] for i in range(12)]
    runs, held = {}, []
    real_launch = Rounds.launch
    monkeypatch.setattr(Rounds, "launch", lambda self, *a: (held.append(self.batch.n), real_launch(self, *a))[1])
    for caching in (False, True):
        eng = make_engine(models, method, bs=12, prefill_chunk=256, kv_cache="paged", **spec)
        eng.prefix = eng.prefix if caching else None
        figures = budget_for(eng, 3, [len(prompts[0])])
        eng.device_memory = lambda: figures
        eng.generate(prompts[:1])  # a first call of one row: its caches must not bound the next call's rows
        plan = eng.memory_plan()
        held.clear()
        with Peak() as peak:
            out = eng.generate(prompts)
        assert peak.peak <= plan.budget
        runs[caching] = [r.token_ids for r in out], max(held), [r.cached_prompt_tokens for r in out]
    (tokens, off, _), (cached_tokens, on, reused) = runs[False], runs[True]
    assert cached_tokens == tokens
    assert off <= 4 and on >= 2 * off
    assert reused[0] == 0 and reused[1:] == [400] * 11  # the 25 whole blocks of the instruction
    cache = eng._runners["target"].cache
    assert cache.free_slots() == (cache.blocks - 1) * BLOCK  # the pinned blocks are free for rows that need them
    assert eng.prefix["target"].nbytes == 400 * (eng.prefix.per_token * eng.prefix.shares["target"])


def test_what_cannot_fit_one_row_is_refused_with_the_figures(models):
    """A config whose one row of a 1-token prompt does not fit stops at start, naming the figures and the keys to
    change; a prompt too long for one row alone is an error row that says so."""
    eng = make_engine(models, max_new=16)
    eng.device_memory = lambda: (8 * GiB - int(0.9 * 8 * GiB) + GiB // 2 + 1000, 8 * GiB)  # a 1000-byte budget
    with pytest.raises(memory.OutOfMemoryPlan, match=r"one row of a 1-token prompt \+ max_new_tokens 16 needs "
                                                     r"[0-9.]+ GiB \(1 rows x 25 slots of KV cache .* "
                                                     r"resources.gpu_memory_fraction 0.9 of 8.0 GiB leaves 0.00 GiB.*"
                                                     r"generation.max_new_tokens"):
        eng.plan_check()
    from specdec.exec.preflight import memory_fit
    assert memory_fit(eng)["ok"] is False and " 0 rows of a 1-token prompt" in memory_fit(eng)["result"]
    figures = budget_for(eng, 1, [100])
    eng.device_memory = lambda: figures
    assert memory_fit(eng)["ok"] is True  # `specbatch check`: one row at least of the shortest prompts fits
    short, long = eng.generate(prompts_of([10, 300]))
    assert short.error is None and short.generated_tokens == 16
    assert long.error.startswith("prompt_too_long: 300 tokens") and "GPU memory plan" in long.error


def test_the_plan_sizes_rows_by_what_fits(models):
    """Rows grow until the next would pass the budget; the figures grow with rows, slots and the rows' length."""
    eng = make_engine(models, bs=64)
    plan = eng.memory_plan()
    a = plan.need(4, 257, 4, 200, 100)
    assert plan.need(8, 257, 8, 200, 100).kv > a.kv and plan.need(4, 513, 4, 200, 100).kv == a.kv + 4 * 256 * \
        sum(r.shape.kv_per_token for r in plan.roles)
    assert plan.need(4, 257, 8, 200, 100).activations > a.activations < plan.need(4, 257, 4, 250, 100).activations
    plan.used = int(plan.fraction * plan.total) - plan.slack - plan.need(10, 257, 10, 200, 100).total
    assert memory.largest(lambda r: plan.fits(plan.need(r, 257, r, 200, 100)), 64) == 10
    assert memory.row_buckets(24) == [1, 2, 4, 8, 16, 24] and memory.kv_buckets(513, 64) == [64, 128, 256, 512, 513]
    assert memory.kv_bytes_per_token([models["target"]] * 2) == 2 * 2 * (2 * 2 * 16 * 4)  # 2 layers, K+V, 2x16, fp32
    assert memory.device_memory(torch.device("cpu")) is None and SpecEngine(
        pair(models["target"]), SamplingParams(), SpecConfig(method="none")).memory_plan() is None  # CPU: not planned


def test_a_chunked_prefill_is_planned_one_chunk_at_a_time():
    """An 8B target's first admission of 64 rows x 2,048 tokens: in one forward it holds ~17 GiB of activations; in
    forwards of 8,192 tokens (each over the whole prompt's keys) under 2 GiB, and the chunk bounds rows x tokens."""
    shape = memory.Shape(layers=32, heads=32, kv_heads=8, head_dim=128, d=4096, intermediate=14336, vocab=128256,
                         itemsize=2)

    target = memory.Role("target", shape, True)

    def plan(chunk):
        return memory.MemoryPlan([target], 0.9, 80 * GiB, 16 * GiB, 5, 64, prefill_chunk=chunk)

    whole, chunked = plan(None).prefill(target, 64, 2048), plan(8192).prefill(target, 64, 2048)
    assert 12 * GiB < whole < 24 * GiB and chunked < 2 * GiB
    assert chunked == shape.forward(64, 128, 2048)  # 64 rows x 128 tokens
    assert plan(8192).prefill(target, 1, 2048) == plan(None).prefill(target, 1, 2048)  # within one chunk: one forward
    assert plan(16).prefill(target, 64, 2048) == shape.forward(16, 1, 2048)  # fewer tokens than rows: rows in groups


def test_the_allocated_length_is_at_most_a_quarter_more_and_one_within_the_positions(models):
    """Rows of n slots get n rounded up to a quarter of a power of two, plus one, within the 512 positions."""
    eng = make_engine(models)
    assert [eng.alloc_len(n) for n in (1, 100, 128, 129, 300, 410, 512)] == [2, 113, 129, 161, 321, 449, 512]
    assert all(n < eng.alloc_len(n) <= 1.25 * n + 1 for n in range(9, 409))
    assert len({eng.alloc_len(n) for n in range(65, 129)}) == 4  # four sizes per doubling: few reallocations
    eng.generate(prompts_of([5]))
    assert eng._runners["target"].cache.max_len == eng.alloc_len(eng.row_tokens(5)) == 29


def test_caches_come_from_one_allocator_and_a_lookup_never_reallocates(models):
    """`hold` is where caches are allocated: it keeps caches that hold what is asked (a lookup after it finds the same
    runners), grows every model's together where they do not (keeping the longer rows), and allocates a plan's sizes
    exactly; `runner` only looks up."""
    eng = make_engine(models)
    eng.hold(memory.Caches(2, 40))
    first = eng.runner("target")
    assert eng.caches == memory.Caches(2, eng.alloc_len(40)) and eng.runner("target") is first
    eng.hold(memory.Caches(1, 30))
    assert eng.runner("target") is first and eng.runner("draft").cache.rows == 2
    eng.hold(memory.Caches(3, 30))
    assert eng.runner("target") is not first and eng.caches == memory.Caches(3, eng.alloc_len(40))
    assert eng.runner("draft").cache.rows == 3
    eng.hold(memory.Caches(1, 30), exact=True)
    assert eng.caches == memory.Caches(1, 30) == memory.Caches(eng.runner("draft").cache.rows,
                                                              eng.runner("draft").cache.max_len)


def test_the_prefix_room_yields_to_one_row_and_the_plan_says_so(models):
    """Sizing a batch with room held back for the prefix store is a function of the plan: when not one row fits
    beside the room, the batch is sized without it, the `Need` says so, and the plan is left as it was."""
    eng = make_engine(models)
    plan = eng.memory_plan()
    row = eng.row_tokens(100)
    one = plan.need(1, eng.alloc_len(row), 1, row, 100)
    plan = replace(plan, used=int(plan.fraction * plan.total) - plan.slack - one.total - 1000)  # one row, and 1000
    size = lambda p: eng.sizes(4, row, 100, p)  # noqa: E731
    assert memory.size_batch(plan, 500, size).held == 500 and memory.size_batch(plan, 500, size).batch == 1
    fallback = memory.size_batch(plan, one.total, size)
    assert fallback.held == 0 and fallback.batch == 1 and plan.held == 0
    with pytest.raises(memory.OutOfMemoryPlan):
        memory.size_batch(replace(plan, used=plan.used + 2000), 0, size)


@pytest.fixture(scope="module")
def short_context():
    """A target whose position table has 64 entries."""
    torch.manual_seed(0)
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, initializer_range=0.3, max_position_embeddings=64, bos_token_id=None,
                      eos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(cfg).eval().requires_grad_(False)


@pytest.mark.parametrize("method", ["draft_model", "prompt_lookup"])
def test_rows_past_the_position_table_are_refused_before_they_run(short_context, method):
    """prompt + max_new_tokens + the draft's slack must fit the 64 positions: the longest such prompt runs, with
    transformers' greedy output, its verification padded to the widest width every round (what reaches furthest
    past a row's length), and no cache is longer than the table. The old limit (prompt + max_new_tokens) let a
    48-token prompt run until a padded step looked RoPE up at position 64 (an IndexError here, a device-side assert
    that kills the CUDA context on a GPU): it is now prompt_too_long, as is one token more than the room;
    truncate=left keeps the last tokens."""
    spec = SpecConfig(method=method, max_draft_tokens=4, num_draft_tokens=1, draft_length="fixed")
    eng = SpecEngine(pair(short_context, short_context if method == "draft_model" else None),
                     SamplingParams(max_new_tokens=16), spec, batch_size=2, profile=flat_profile())
    eng.context.widths.times = {(b, w): [1.0 if w == 5 else 2.0] * 2 for b in (1, 2) for w in range(1, 6)}  # 5 is cheapest
    room = eng.max_prompt_tokens(None)
    assert room == 64 - 16 - eng.spec.max_nodes - 2 == 42
    pattern = [5, 17, 33, 2, 60, 71, 9]  # repeated, so that prompt lookup finds drafts
    fits, over, old_limit = ((pattern * 10)[:n] for n in (room, room + 1, 64 - 16))
    ok, too_long, also = eng.generate([fits, over, old_limit])
    ref = short_context.generate(torch.tensor([fits]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert ok.error is None and ok.token_ids == ref[0, room:].tolist() and sum(ok.draft_lengths) > 0
    assert too_long.error == (f"prompt_too_long: {room + 1} tokens + max_new_tokens 16 exceed the {room + 16} tokens "
                              "a row can have (the models' 64 positions less 6 for the draft, or the GPU memory plan); "
                              "input.truncate: left keeps the last tokens")
    assert also.error.startswith("prompt_too_long: 48 tokens")
    assert all(r.cache.max_len <= 64 for r in eng._runners.values())
    cut, = eng.generate([over], truncate="left")
    assert cut.error is None and cut.prompt_tokens == room
    with pytest.raises(ValueError, match="65 cache slots exceed the models' 64 positions"):
        eng.hold(memory.Caches(1, 65))
