"""The lean Llama forward and the GPU fast path's pieces, on CPU: the same logits as transformers'
modules, the verify step compiles whole (no graph break: no host sync, no data-dependent branch),
padded static steps change nothing, and a round reads the device back once."""

import collections
import traceback

import numpy as np
import pytest
import torch

from engine_models import DEVICE, MAX_NEW, flat_profile, noisy_copy, pair
from specdec.exec import llama
from specdec.exec.cache import PagedKVCache, RaggedKVCache, blocks_for, forward_hidden
from specdec.config import SamplingParams, SpecConfig
from specdec.engine import SpecEngine
from specdec.exec.runner import ModelRunner

def ragged_inputs(seed=0, n=3):
    """A prefill of 20 tokens per row, then a 3-token step at ragged lengths 20, 15, 9."""
    g = torch.Generator().manual_seed(seed)
    prefill = torch.randint(0, 96, (n, 20), generator=g)
    step = torch.randint(0, 96, (n, 3), generator=g)
    lengths = torch.tensor([20, 15, 9][:n])
    return prefill.to(DEVICE), step.to(DEVICE), (lengths[:, None] + torch.arange(3)[None]).to(DEVICE)


def cache_of(target, layout: str, rows: int = 4, max_len: int = 64):
    """A cache of `rows` rows of `max_len` slots: dense, or paged with every row's blocks reserved (rows taking
    them in reverse, so that no row's blocks are contiguous in the pool: the table is what maps them)."""
    if layout == "dense":
        return RaggedKVCache(target, rows, max_len)
    cache = PagedKVCache(target, rows, max_len, 1 + rows * blocks_for(max_len) + 3)
    cache.free.reverse()
    for row in range(rows):
        cache.reserve(row, max_len)
    return cache


def held(cache, rows: int, length: int) -> list[torch.Tensor]:
    """Keys and values of slots [0, length) of rows [0, rows) in every layer: [layers, rows, kv_heads, length, hd]."""
    return [torch.stack([kv[i] for kv in (cache.read_slots(r, 0, length) for r in range(rows))], dim=1)
            for i in range(2)]


@pytest.mark.parametrize("additive", [False, True])
@pytest.mark.parametrize("layout", ["dense", "paged"])
def test_lean_forward_matches_transformers(target, layout, additive, monkeypatch):
    """Prefill and a ragged multi-token step: hidden states and cache contents as transformers' modules
    compute them over a dense cache (float32; fused q/k/v may round differently in the last bits), the lean
    forward's over a dense or a paged one; with its masks boolean, or additive as CUDA's get them (made once a
    forward, not by SDPA at every layer)."""
    monkeypatch.setattr(llama, "ADDITIVE_MASKS", {DEVICE} if additive else set())
    assert llama._rope_and_mask(llama.load_weights(target), torch.zeros((1, 1), dtype=torch.int64, device=DEVICE),
                                4)[2].dtype == (target.dtype if additive else torch.bool)
    prefill, step, positions = ragged_inputs()
    w = llama.load_weights(target)
    hf, lean = RaggedKVCache(target, 4, 64), cache_of(target, layout)
    with torch.inference_mode():
        a = forward_hidden(target, hf, prefill, torch.arange(20, device=DEVICE)[None].expand(3, 20), 0, 3, 20)
        b = llama.prefill(w, lean, prefill, 0)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        a = forward_hidden(target, hf, step, positions, 0, 3, 23)
        b = llama.forward(w, lean, step, positions, 23)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        for x, y in zip(held(hf, 3, 23), held(lean, 3, 23)):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    assert llama.load_weights(target) is w  # fused once per model
    fused = w.layers[0].qkv
    q = target.model.layers[0].self_attn.q_proj.weight
    assert q.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()  # a view: nothing held twice


@pytest.mark.parametrize("layout", ["dense", "paged"])
def test_one_forward_over_a_step_and_joining_rows_computes_what_two_do(target, layout):
    """A round's step over rows 0-1 and, in the same pass over the weights, rows 2-3 ending their prefills (each
    after its own cached slots, at ragged lengths): hidden states and cache contents as two forwards give them."""
    prefill, step, positions = ragged_inputs(n=2)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, 96, (2, 12), generator=g).to(DEVICE)
    w = llama.load_weights(target)
    apart, together = cache_of(target, layout), cache_of(target, layout)
    joined = torch.tensor([5, 2], device=DEVICE)[:, None] + torch.arange(7, device=DEVICE)  # rows at 5 and 2 slots
    with torch.inference_mode():
        for cache in (apart, together):
            llama.prefill(w, cache, prefill, 0)
            llama.prefill(w, cache, prompts, 2)
        a = [llama.forward(w, apart, step, positions, 23), llama.forward(w, apart, prompts[:, 5:], joined, 12, start=2)]
        b = llama.forward_parts(w, together, [(step, positions, 23, 0), (prompts[:, 5:], joined, 12, 2)])
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
        for x, y in zip(held(apart, 4, 23), held(together, 4, 23)):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["dense", "paged"])
def test_the_compiled_pieces_write_the_cache_where_it_lies(target, layout):
    """The compiled pieces write a step's keys and values into the cache in place: no forward allocates anything the
    size of a cache layer (a write through a copy of the layer, copied back, would move the whole cache twice a
    layer: on a GPU, more bytes than the weights), and the cache holds what the eager pieces write."""
    from torch.profiler import ProfilerActivity, profile

    from specdec.exec import graphs

    prefill, step, positions = ragged_inputs()
    w = llama.load_weights(target)
    eager, compiled = cache_of(target, layout, max_len=2048), cache_of(target, layout, max_len=2048)
    layer = compiled.k[0].numel() * compiled.k[0].element_size()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    with torch.inference_mode():
        for cache, pieces in ((eager, llama.EAGER), (compiled, graphs.compiled_pieces())):
            llama.prefill(w, cache, prefill, 0, pieces)
            llama.forward(w, cache, step, positions, 23, pieces)  # (compiled here)
        with profile(activities=activities, profile_memory=True) as prof:
            llama.forward(w, compiled, step, positions + 3, 26, graphs.compiled_pieces())
        llama.forward(w, eager, step, positions + 3, 26)
    largest = max(max(e.cpu_memory_usage, e.device_memory_usage) for e in prof.events())
    assert 0 < largest < layer / 8, (largest, layer)  # (0: the profiler saw no allocation at all)
    for x, y in zip(held(eager, 3, 29), held(compiled, 3, 29)):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [2048, None])
def test_rows_that_join_end_their_prefills_in_the_rounds_forward(target, prompts, reference, chunk, monkeypatch):
    """Rows joining a batch (prompts within one prefill chunk, or no chunks) take no target forward of their own:
    each round runs one, which ends the joining rows' prefills beside the others' verification; transformers'
    tokens."""
    calls = collections.Counter()
    for name in ("prefill", "step", "step_joined"):
        def spy(self, *args, _real=getattr(ModelRunner, name), _name=name, **kwargs):
            calls[_name] += 1
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(ModelRunner, name, spy)
    eng = SpecEngine(pair(target), SamplingParams(max_new_tokens=MAX_NEW), SpecConfig(method="none"), batch_size=3,
                     profile=flat_profile(), prefix_caching=False, prefill_chunk=chunk)
    out = eng.generate(prompts)
    assert [r.token_ids for r in out] == reference
    assert calls["prefill"] == 0 and calls["step"] + calls["step_joined"] == eng.context.staging.rounds
    assert calls["step_joined"] >= 2  # the first admission, and rows joining as others finish


@pytest.mark.parametrize("layout", ["dense", "paged"])
def test_prefills_and_joining_rows_run_through_the_compiled_pieces(target, prompts, reference, layout, monkeypatch):
    """Where the pieces between the attentions are compiled, the forwards no graph captures (the first admission's
    prefill, prompts that go on from a cached prefix, rows joining a round beside the others' step) run through
    them too, each compilation's first forward checked against eager's as a step's is: none falls back, and the
    tokens are transformers'. (On a GPU the joining forward is then a few fused kernels a layer instead of ~48 eager
    ops; here compiling is forced, as bench/step_speed.py's fast-compiled does.)"""
    import inspect

    from specdec.exec import graphs

    monkeypatch.setattr(ModelRunner, "compile_layers", True)
    used = collections.Counter()
    for name in ("prefill", "forward_parts"):
        def spy(*args, _real=getattr(llama, name), _name=name, **kwargs):
            pieces = inspect.signature(_real).bind(*args, **kwargs).arguments.get("pieces", llama.EAGER)
            used[_name, pieces is graphs.compiled_pieces()] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(llama, name, spy)
    eng = SpecEngine(pair(target), SamplingParams(max_new_tokens=MAX_NEW), SpecConfig(method="none"), batch_size=3,
                     profile=flat_profile(), kv_cache=layout, step_graphs=False)
    out = eng.generate(prompts + prompts[:2])  # the last two go on from the prefixes the first two stored
    assert [r.token_ids for r in out] == reference + reference[:2]
    runner = eng._runners["target"]
    assert runner.eager == {} and {("layer", False, True, False), ("layer", True, True, False)} <= runner.checked
    worst, _ = eng.step_errors  # float32: the compiled pieces' rounding, ~1e-7, far below the check's 1e-3
    assert set(runner.errors) == runner.checked and worst < 1e-5, runner.errors
    # eager runs a joining forward once, in its compilation's first check
    assert used["prefill", True] and used["forward_parts", True] > 1 >= used["forward_parts", False], used
    # a job's capture compiles them before its rows join (`SpecEngine.capture_steps`)
    fresh = ModelRunner(target, RaggedKVCache(target, 4, 64), target.lm_head.weight)
    fresh.warm_pieces()
    assert fresh.eager == {} and fresh.checked == {("layer", False, True, False), ("layer", True, True, False)}


@pytest.mark.parametrize("method,layout", [("none", "dense"), ("draft_model", "paged")])
def test_while_rows_decode_rows_join_within_one_chunk_in_the_rounds_forward(target, drafts, method, layout,
                                                                           monkeypatch):
    """While rows decode, rows join within one `prefill_chunk` of prompt tokens (padded to the longest, as the
    round's forward takes them), all of it in the round's forward: no target prefill forward runs but while no row
    decodes (the first admission). Here two rows of 25 and 22 tokens could join together when two others end, but
    join one round apart in a chunk of 32. Transformers' tokens."""
    from engine_models import engine

    from specdec.exec.prefill import Prefiller

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (30, 28, 26, 25, 22, 20)]  # admission order
    lengths = [MAX_NEW, 2, 2, 5, MAX_NEW, 3]  # rows 1 and 2 end together while row 0 decodes
    with torch.inference_mode():
        reference = [target.generate(torch.tensor([p], device=DEVICE), max_new_tokens=m, min_new_tokens=m,
                                     do_sample=False)[0, len(p):].tolist() for p, m in zip(prompts, lengths)]
    apart, joined = [], []
    real_forwards, real_joined = Prefiller.forwards, ModelRunner.step_joined

    def forwards(self, start, done, upto, top_ids=0):
        if self.runner is eng._runners["target"] and (upto - done).sum() > 0:
            apart.append(start)  # the rows decoding while this prefill runs
        return real_forwards(self, start, done, upto, top_ids)

    def step_joined(self, tokens, positions, kv_len, join):
        joined.append(join.tokens.shape[0] * int(join.at[:, 0].max()))
        return real_joined(self, tokens, positions, kv_len, join)

    monkeypatch.setattr(Prefiller, "forwards", forwards)
    monkeypatch.setattr(ModelRunner, "step_joined", step_joined)
    eng = engine(target, drafts["noisy"] if method == "draft_model" else None, method, bs=3, prefill_chunk=32,
                 kv_cache=layout)
    out = eng.generate(prompts, params=[SamplingParams(max_new_tokens=m) for m in lengths])
    assert [r.token_ids for r in out] == reference
    assert set(apart) <= {0} and len(joined) >= 4 and max(joined) <= 32


@pytest.mark.parametrize("layout", ["dense", "paged"])
def test_verify_step_compiles_whole_and_matches_eager(target, layout):
    """torch.compile(fullgraph=True) of the verify step (lean forward over the ragged cache + head; a paged cache's
    table lookups included): a host sync or a data-dependent Python branch would be a graph break and fail here."""
    prefill, step, positions = ragged_inputs(seed=1)
    w = llama.load_weights(target)
    head = target.get_output_embeddings().weight
    caches = [cache_of(target, layout) for _ in range(2)]

    def verify_step(cache, tokens, pos):
        return torch.nn.functional.linear(llama.forward(w, cache, tokens, pos, 32), head)

    compiled = torch.compile(verify_step, fullgraph=True, dynamic=False)
    with torch.inference_mode():
        for c in caches:
            llama.prefill(w, c, prefill, 0)
        eager = verify_step(caches[0], step, positions)
        got = compiled(caches[1], step, positions)
    torch.testing.assert_close(got, eager, rtol=1e-4, atol=1e-4)
    for x, y in zip(held(caches[0], 3, 64), held(caches[1], 3, 64)):  # the compiled step wrote the cache
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


def test_runner_padded_static_steps_equal_unpadded(target):
    """Rows padded to a power of two, attention over a power-of-two bucket of slots, static input buffers
    reused across calls (what CUDA graphs replay): the same logits as the exact-shape step."""
    prefill, step, positions = ragged_inputs(seed=2)
    head = target.get_output_embeddings().weight
    plain = ModelRunner(target, RaggedKVCache(target, 4, 128), head, graphs=False)
    padded = ModelRunner(target, RaggedKVCache(target, 4, 128), head, graphs=True)
    with torch.inference_mode():
        for r in (plain, padded):
            r.prefill(prefill, 0, 3)
        for _ in range(2):  # the second call reuses the static buffers
            a, ha = plain.step(step, positions, 23)
            b, hb = padded.step(step, positions, 23)
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            last = torch.tensor([2, 0, 1], device=DEVICE)
            a, ha = plain.step(step, positions, 23, last=last)
            b, hb = padded.step(step, positions, 23, last=last)
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(ha, hb, rtol=1e-5, atol=1e-5)
    assert b.shape == (3, 96) and len(padded.graphs) == 2  # (4 rows, 3 wide, 64 slots) x (all, last)


@pytest.mark.parametrize("method", ["none", "draft_model", "prompt_lookup"])
@pytest.mark.parametrize("graphs", [False, True])
def test_fast_paths_give_transformers_greedy_output(target, prompts, method, graphs):
    """Greedy output through the lean forward (eagerly, or as padded static steps) equals the generic
    path's, which equals transformers' generate (tests/test_engine.py)."""
    draft = noisy_copy(target, 0.02) if method == "draft_model" else None
    spec = SpecConfig(method=method, num_draft_tokens=3, draft_length="fixed")
    runs = {}
    for fast in (False, True):
        eng = SpecEngine(pair(target, draft), SamplingParams(max_new_tokens=MAX_NEW), spec, batch_size=3,
                         fast_path=fast, step_graphs=graphs if fast else None)
        runs[fast] = [r.token_ids for r in eng.generate(prompts)]
        assert eng.step_path == ("generic" if not fast else "graphs" if graphs and DEVICE == "cuda" else "lean")
    assert runs[True] == runs[False]


@pytest.mark.parametrize("fault", ["raise", "nan", "off"])
def test_a_failing_fast_step_falls_back_to_eager_per_shape(target, prompts, fault):
    """The first step of each shape on the fast path is checked against eager: a capture that raises or
    non-finite logits sends that shape to eager (same greedy tokens, '+eager-fallback'); a sound one stays."""
    seen = []
    spec = SpecConfig(method="draft_model", num_draft_tokens=3, draft_length="fixed")
    sp = SamplingParams(max_new_tokens=MAX_NEW)
    ref = [r.token_ids for r in SpecEngine(pair(target, noisy_copy(target, 0.02)), sp, spec, batch_size=3,
                                           step_graphs=False).generate(prompts)]
    eng = SpecEngine(pair(target, noisy_copy(target, 0.02)), sp, spec, batch_size=3,  # graphs: the hook's doing
                     step_fault=lambda key: seen.append(key) or (None if fault == "off" else fault))
    assert [r.token_ids for r in eng.generate(prompts)] == ref
    runners = eng._runners.values()
    assert len(seen) == sum(len(r.checked) + len(r.eager) for r in runners) > 1  # each runner checks a shape once
    target_runner = eng._runners["target"]
    base = "graphs" if DEVICE == "cuda" else "lean"
    if fault == "off":
        assert eng.step_path == base and not target_runner.eager and len(target_runner.checked) > 0
    else:
        assert eng.step_path == base + "+eager-fallback" and not target_runner.checked
        assert all(("injected" if fault == "raise" else "non-finite") in why for why in target_runner.eager.values())
        eng.generate(prompts)
        assert len(seen) == sum(len(r.checked) + len(r.eager) for r in runners)  # no shape is tried again


def test_mismatch_tells_a_broken_step_from_rounding():
    """The first-step check passes what rounding explains (per position, relative to eager's logits) and
    refuses a step off by much more, or non-finite."""
    from specdec.exec.runner import mismatch
    ref = torch.randn(4, 3, 500, generator=torch.Generator().manual_seed(0))
    assert mismatch(ref + 1e-5 * torch.randn(ref.shape), ref) is None
    assert "differ" in mismatch(ref + 0.01 * torch.randn(ref.shape), ref)  # float32: 1e-3
    off = ref.clone()
    off[2, 1] = torch.randn(500)  # one position's logits wrong: a wrong slot, a stale buffer
    assert "differ" in mismatch(off.bfloat16(), ref.bfloat16())
    assert mismatch((ref + 0.05 * torch.randn(ref.shape)).bfloat16(), ref.bfloat16()) is None  # 16-bit rounding
    bad = ref.clone()
    bad[0, 0, 7] = float("nan")
    assert mismatch(bad, ref) == "non-finite logits"


def test_other_architectures_take_the_generic_path(prompts):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                      initializer_range=0.3)).to(DEVICE).eval().requires_grad_(False)
    assert "gpt2" in llama.unsupported(gpt2)
    eng = SpecEngine(pair(gpt2, gpt2), SamplingParams(max_new_tokens=12), SpecConfig(num_draft_tokens=3, draft_length="fixed"),
                     batch_size=4)
    out = eng.generate(prompts)
    assert eng.step_path == "generic"
    for p, r in zip(prompts, out):
        ref = gpt2.generate(torch.tensor([p], device=DEVICE), max_new_tokens=12, min_new_tokens=12, do_sample=False)
        assert r.token_ids == ref[0, len(p):].tolist()
        assert r.accepted_tokens == r.drafted_tokens  # its own draft: everything passes


class HostReads(torch.overrides.TorchFunctionMode):
    """Counts the host's waits on the device, by the specdec line that asked for each: reads of tensor values into
    Python (each one a device sync on a GPU) and, on CUDA, synchronizing an event, a stream or the device (how a
    round's pinned read-back waits)."""

    READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
             torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.cpu}
    SYNCS = [(torch.cuda.Event, "synchronize"), (torch.cuda.Stream, "synchronize"), (torch.cuda, "synchronize")]

    def __init__(self):
        super().__init__()
        self.count = 0
        self.sites = collections.Counter()
        self.paused = False
        self.real = [getattr(owner, name) for owner, name in self.SYNCS]

    def __enter__(self):
        for (owner, name), real in zip(self.SYNCS, self.real):
            setattr(owner, name, lambda *a, _real=real, **kw: (self.read(), _real(*a, **kw))[1])
        return super().__enter__()

    def __exit__(self, *exc):
        for (owner, name), real in zip(self.SYNCS, self.real):
            setattr(owner, name, real)
        return super().__exit__(*exc)

    def read(self):
        if not self.paused:
            self.count += 1
            ours = [f for f in traceback.extract_stack()[:-2] if "/specdec/" in f.filename]
            self.sites[f"{ours[-1].filename.rsplit('/', 1)[-1]}:{ours[-1].lineno}" if ours else "elsewhere"] += 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            self.read()
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("method,draft_length,temperature", [
    ("none", "fixed", 0.0), ("draft_model", "fixed", 0.0), ("draft_model", "fixed", 0.8),
    ("draft_model", "goodput", 0.0), ("draft_model", "heuristic", 0.0), ("prompt_lookup", "fixed", 0.0),
])
def test_a_round_reads_the_device_once(target, prompts, method, draft_length, temperature, monkeypatch):
    """Every round reads its results back once, at its end; nothing else in generate() waits on the device
    (admissions, prefills, draft steps, policies, retirements)."""
    draft = noisy_copy(target, 0.02) if method == "draft_model" else None
    eng = SpecEngine(pair(target, draft), SamplingParams(max_new_tokens=MAX_NEW, temperature=temperature),
                     SpecConfig(method=method, num_draft_tokens=3, draft_length=draft_length, max_draft_tokens=4),
                     batch_size=3, step_graphs=True)
    eng.generate(prompts[:2])  # warm: caches allocated, goodput's first choices made
    # a shape's first graphed or compiled step (captured or compiled, then compared with eager's: one read) comes
    # once per shape and process; its reads are not a round's
    firsts, original = [], ModelRunner._first

    def first(self, *args):
        firsts.append(args[0])
        reads.paused = True
        try:
            return original(self, *args)
        finally:
            reads.paused = False

    monkeypatch.setattr(ModelRunner, "_first", first)
    before = eng.context.staging.rounds
    with HostReads() as reads:
        out = eng.generate(prompts)
    rounds = max(r.rounds for r in out)  # rows share rounds: the batch ran at least this many
    assert rounds <= reads.count == eng.context.staging.rounds - before, dict(reads.sites)
    assert not firsts or DEVICE == "cuda" or ModelRunner.compile_layers


def test_policies_that_stop_on_draft_outputs_sync_per_step(target, prompts):
    """confidence stops rows on the draft's own probabilities: the one kind of round allowed more reads
    (one per draft step), and still correct."""
    eng = SpecEngine(pair(target, noisy_copy(target, 0.02)), SamplingParams(max_new_tokens=MAX_NEW),
                     SpecConfig(draft_length="confidence", max_draft_tokens=4), batch_size=3)
    with HostReads() as reads:
        out = eng.generate(prompts)
    assert reads.count > eng.context.staging.rounds
    assert np.mean([r.mean_accepted_length for r in out]) > 1



def test_compiled_layers_of_four_model_shapes_never_fall_back(prompts, monkeypatch):
    """The compiled pieces specialize on a model's shape (heads, head_dim) and on one row or token vs more: a
    target and three drafts of other shapes, over batch sizes 1..4, compile more than 8 times per piece, past
    torch's default recompile limit (where fullgraph turns the ninth into an error and that shape would run
    eagerly for good). Every step stays on the compiled path and matches eager."""
    from transformers import LlamaConfig, LlamaForCausalLM
    monkeypatch.setattr(ModelRunner, "compile_layers", True)

    def shaped(hidden, heads, kv_heads, seed):
        torch.manual_seed(seed)
        cfg = LlamaConfig(vocab_size=96, hidden_size=hidden, num_hidden_layers=1, num_attention_heads=heads,
                          num_key_value_heads=kv_heads, intermediate_size=2 * hidden, initializer_range=0.3,
                          max_position_embeddings=512, bos_token_id=None, eos_token_id=None, pad_token_id=None)
        return LlamaForCausalLM(cfg).to(DEVICE).eval().requires_grad_(False)

    target = shaped(64, 4, 2, 0)
    spec = SpecConfig(method="draft_model", num_draft_tokens=2, draft_length="fixed")
    runners = []
    for draft in (shaped(32, 2, 1, 1), shaped(48, 3, 3, 2), shaped(96, 4, 4, 3)):
        eng = SpecEngine(pair(target, draft), SamplingParams(max_new_tokens=6), spec, batch_size=4, step_graphs=False)
        for n in (1, 2, 4):
            eng.generate(prompts[:n])
        runners += eng._runners.values()
    assert all(r.pieces is not llama.EAGER and r.checked for r in runners)
    assert [r.eager for r in runners] == [{}] * len(runners)


def test_a_copy_of_a_model_the_lean_forward_ran_computes_with_its_own_weights(target):
    """A model copied after the lean forward fused its weights (as the tests' noisy drafts are), then changed, runs
    the lean forward with the changed weights, as transformers does with it: the fused matrices it carried from the
    original are not its own (its q/k/v no longer view them)."""
    import copy

    llama.load_weights(target)
    changed = copy.deepcopy(target)
    with torch.no_grad():
        for p in changed.parameters():
            p.add_(torch.randn_like(p) * 0.02 * p.std())
    w = llama.load_weights(changed)
    assert w is not llama.load_weights(target)
    prefill, _, _ = ragged_inputs()
    hf, lean = RaggedKVCache(changed, 4, 64), cache_of(changed, "dense")
    with torch.inference_mode():
        a = forward_hidden(changed, hf, prefill, torch.arange(20, device=DEVICE)[None].expand(3, 20), 0, 3, 20)
        torch.testing.assert_close(a, llama.prefill(w, lean, prefill, 0), rtol=1e-5, atol=1e-5)
