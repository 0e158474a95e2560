"""Prefix caching's store (specdec/exec/prefix.py), a prefill that goes on after reused slots, and a prefill in
chunks."""

from __future__ import annotations

import pytest
import torch

from engine_models import tiny_llama
from specdec.exec.cache import RaggedKVCache
from specdec.exec.prefix import PrefixStore
from specdec.exec.runner import ModelRunner


def runner(model, rows=4, max_len=128, lean=True) -> ModelRunner:
    cache = RaggedKVCache(model, rows, max_len)
    head = model.get_output_embeddings()
    return ModelRunner(model, cache, head.weight, None, lean=lean, graphs=False)


def prefill(r: ModelRunner, row: int, tokens: list[int], store: PrefixStore | None = None) -> int:
    """Cache all but the last of `tokens` in `row`, reusing stored blocks; returns the tokens reused."""
    cached = len(tokens) - 1
    reused = store.load(r.cache, row, store.match(tokens, cached)) if store else 0
    rest = torch.tensor([tokens[reused:cached]])
    if reused:
        r.prefill(rest, row, row + 1, offsets=[reused])
    else:
        r.prefill(rest, row, row + 1)
    if store:
        store.store(r.cache, row, tokens, cached)
    return reused


@pytest.mark.parametrize("lean", [True, False])
def test_a_row_that_reuses_a_prefix_holds_what_its_own_prefill_computes(lean):
    """Row 1 shares 40 tokens with row 0: it takes two 16-token blocks from the store and computes the rest; its
    keys, values and next-token logits equal a full prefill's (row 2) in float32."""
    model = tiny_llama(vocab=96, layers=2)
    r = runner(model, lean=lean)
    store = PrefixStore(budget=1 << 30, block=16)
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(0, 96, (40,), generator=g).tolist()
    first = shared + torch.randint(0, 96, (10,), generator=g).tolist()
    second = shared + torch.randint(0, 96, (7,), generator=g).tolist()
    assert prefill(r, 0, first, store) == 0
    assert prefill(r, 1, second, store) == 32
    assert prefill(r, 2, second) == 0
    n = len(second) - 1
    for kc, vc in zip(r.cache.k, r.cache.v):
        torch.testing.assert_close(kc[1, :, :n], kc[2, :, :n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(vc[1, :, :n], vc[2, :, :n], rtol=1e-5, atol=1e-5)
    # the pending token's step over rows 1 and 2 (rows [0, 2) of a window: move them down first)
    r.cache.move_row(1, 0, n)
    r.cache.move_row(2, 1, n)
    last = torch.tensor([[second[-1]], [second[-1]]])
    logits, _ = r.step(last, torch.tensor([[n], [n]]), n + 1)
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)


def test_match_stops_at_the_first_block_not_stored_and_never_inside_the_pending_token():
    model = tiny_llama()
    r = runner(model)
    store = PrefixStore(budget=1 << 30, block=4)
    tokens = list(range(1, 14))  # 13 tokens: 12 cached, 3 full blocks
    prefill(r, 0, tokens, store)
    assert len(store.blocks) == 3
    assert len(store.match(tokens, 12)) == 3
    assert len(store.match(tokens, 11)) == 2  # the third block would reach past the tokens a prefill caches
    assert len(store.match(tokens[:6] + [90] * 7, 12)) == 1  # the second block differs
    assert store.match([90] + tokens[1:], 12) == []  # a chain: a later block never matches without its first


def test_a_hash_collision_costs_a_miss_never_a_wrong_block(monkeypatch):
    model = tiny_llama()
    r = runner(model)
    store = PrefixStore(budget=1 << 30, block=4)
    monkeypatch.setattr(store, "_key", lambda parent, tokens: 7)  # every block collides
    prefill(r, 0, [1, 2, 3, 4, 5, 6], store)
    assert store.match([9, 9, 9, 9, 5, 6], 5) == []
    assert len(store.match([1, 2, 3, 4, 5, 6], 5)) == 1


def test_the_store_keeps_its_budget_and_evicts_the_deepest_least_recent_blocks_first():
    model = tiny_llama()
    r = runner(model)
    probe = PrefixStore(budget=1 << 30, block=4)
    prefill(r, 0, [1, 2, 3, 4, 5], probe)
    one = probe.nbytes  # bytes of one block
    store = PrefixStore(budget=3 * one, block=4)
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]  # two blocks
    b = [1, 2, 3, 4, 50, 60, 70, 80, 90]  # shares a's first block
    prefill(r, 0, a, store)
    prefill(r, 1, b, store)
    assert len(store.blocks) == 3 and store.nbytes == 3 * one
    prefill(r, 2, [20, 21, 22, 23, 24], store)  # a fourth block: the least recent leaf (a's second) goes
    assert store.nbytes <= store.budget
    assert len(store.match(a, 8)) == 1  # a's first block, shared with b, was kept
    assert len(store.match(b, 8)) == 2
    tiny = PrefixStore(budget=one - 1, block=4)
    assert tiny.store(r.cache, 0, a, 8) == 0 and tiny.nbytes == 0


def shared_prompts(rows: int, shared: int = 70, seed: int = 5) -> list[list[int]]:
    """Rows with one `shared`-token prefix (a system prompt) and a short tail of their own."""
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(0, 96, (shared,), generator=g).tolist()
    return [head + torch.randint(0, 96, (3 + i % 7,), generator=g).tolist() for i in range(rows)]


def transformers_greedy(model, prompts, max_new):
    out = []
    for p in prompts:
        ids = model.generate(torch.tensor([p]), max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False)
        out.append(ids[0, len(p):].tolist())
    return out


@pytest.mark.parametrize("method", ["none", "draft_model", "prompt_lookup"])
def test_prefix_caching_keeps_transformers_tokens_and_computes_a_shared_prefix_once(target, drafts, method):
    """10 rows share a 70-token prefix, 4 at a time (the first admission computes the prefix once, later ones take
    it from the store); greedy tokens equal transformers' generate in float32, with caching on and off; a second
    call takes every row's whole prompt but its last partial block."""
    from engine_models import engine

    prompts = shared_prompts(10)
    ref = transformers_greedy(target, prompts, 12)
    on = engine(target, drafts["noisy"], method, bs=4, max_new=12)
    off = engine(target, drafts["noisy"], method, bs=4, max_new=12, prefix_caching=False)
    for eng in (on, off):
        res = eng.generate(prompts)
        assert [r.token_ids for r in res] == ref
    assert [r.cached_prompt_tokens for r in res] == [0] * 10
    res = on.generate(prompts)  # a second call (a retried shard): every row finds its whole prompt's blocks
    assert [r.token_ids for r in res] == ref
    assert [r.cached_prompt_tokens for r in res] == [(len(p) - 1) // 16 * 16 for p in prompts]
    apart = [p[:2] + [93 + j] + p[3:] for j, p in enumerate(prompts[1:4])]  # each its own first block
    assert all(r.cached_prompt_tokens == 0 for r in on.generate(apart))
    assert all(r.cached_prompt_tokens == 0 for r in off.generate(prompts))


def test_within_one_admission_the_shared_prefix_is_computed_once(target):
    from engine_models import engine

    eng = engine(target, None, "none", bs=8, max_new=4)
    prompts = shared_prompts(8, shared=64)
    res = eng.generate(prompts)
    reused = sorted(r.cached_prompt_tokens for r in res)
    assert reused[0] == 0  # one row computed the prefix
    assert reused[1:] == [64] * 7  # the others took its four 16-token blocks
    assert [r.token_ids for r in res] == transformers_greedy(target, prompts, 4)


def test_sampled_rows_draw_the_same_tokens_with_and_without_prefix_caching(target, drafts):
    from specdec.config import SamplingParams

    from engine_models import engine

    prompts = shared_prompts(6)
    sp = [SamplingParams(max_new_tokens=10, temperature=0.9, seed=11, n=2)] * len(prompts)
    runs = [engine(target, drafts["noisy"], bs=3, max_new=10, prefix_caching=on).generate(prompts, params=sp)
            for on in (True, False)]
    assert [r.token_ids for r in runs[0]] == [r.token_ids for r in runs[1]]
    assert any(r.cached_prompt_tokens for r in runs[0])


def test_a_job_counts_reused_prompt_tokens_in_its_rows_manifest_status_and_openai_usage(tmp_path, tiny_pair,
                                                                                          ray_session, capsys):
    """8 rows share a start of 60 words in the chat template, 4 at a time on one worker: one row computes it, the
    others take its full 16-token blocks; `prefix_caching: false` gives the same tokens and reuses nothing."""
    import glob
    import json

    from conftest import WORDS
    from job_helpers import TEXTS, config, read_out
    from jobs.cli import main as cli

    from transformers import AutoTokenizer

    shared = " ".join(WORDS[:60])
    rows = [{"id": f"r{i}", "prompt": f"{shared} {TEXTS[i % len(TEXTS)]} {WORDS[70 + i]}"} for i in range(8)]
    tok = AutoTokenizer.from_pretrained(tiny_pair["target"])
    ids = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                   tokenize=True, return_dict=False) for r in rows]
    common = next(j for j in range(min(map(len, ids))) if len({p[j] for p in ids}) > 1)  # tokens all rows share
    assert common >= 61
    outs = {}
    for on in (True, False):
        folder = tmp_path / ("on" if on else "off")
        folder.mkdir()
        path, _ = config(folder, tiny_pair, rows, output__format="openai_batch",
                         resources__num_workers=1, resources__shard_size=8, resources__prefix_caching=on)
        assert cli(["run", path, "--no-progress"]) == 0
        outs[on], _ = read_out(folder / "out")
        manifest = json.loads((folder / "out" / "_manifest.json").read_text())
        reused = sum(r["cached_prompt_tokens"] for r in outs[on].values())
        assert sum(p["cached_prompt_tokens"] for p in manifest["parts"].values()) == reused
        assert reused == (7 * (common // 16 * 16) if on else 0)
        for line in open(glob.glob(str(folder / "out" / "_openai_batch" / "*.jsonl"))[0]):
            got = json.loads(line)
            usage = got["response"]["body"]["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] == outs[on][got["custom_id"]]["cached_prompt_tokens"]
        capsys.readouterr()
        assert cli(["status", path]) == 0
        assert f"({reused} of them reused from cached prefixes)" in capsys.readouterr().out
    assert {k: r["token_ids"] for k, r in outs[True].items()} == {k: r["token_ids"] for k, r in outs[False].items()}


def forward_sizes(monkeypatch, steps: bool = False) -> list[int]:
    """The tokens (rows x columns) of every prefill forward from now on, the prompt tokens (rows x the most columns
    before the pending token) that joining rows end their prefills with in a round's forward, and the tokens of
    every step with `steps`."""
    from specdec.exec.runner import ModelRunner

    sizes: list[int] = []
    for name in ("prefill", "step") if steps else ("prefill",):
        def spy(self, tokens, *args, _real=getattr(ModelRunner, name), **kwargs):
            sizes.append(tokens.numel())
            return _real(self, tokens, *args, **kwargs)

        monkeypatch.setattr(ModelRunner, name, spy)

    def joined(self, tokens, positions, kv_len, join, _real=ModelRunner.step_joined):
        sizes.append(join.tokens.shape[0] * int(join.at[:, 0].max()))
        return _real(self, tokens, positions, kv_len, join)

    monkeypatch.setattr(ModelRunner, "step_joined", joined)
    return sizes


@pytest.mark.parametrize("chunk", [3, 16])
@pytest.mark.parametrize("method,extra", [("none", {}), ("draft_model", {}),
                                          ("prompt_lookup", {"prompt_lookup": {"alignment_sampling": 2}})])
def test_a_prefill_in_chunks_keeps_transformers_tokens(target, drafts, prompts, reference, method, extra, chunk,
                                                       monkeypatch):
    """Prompts of 1-30 tokens prefilled in forwards of at most `chunk` tokens (3: fewer than the rows, so rows go
    in groups of 3, one token each; 16: every row, a few tokens at a time), with and without prefix caching: the
    tokens of transformers' greedy generate, and no forward over the chunk."""
    from engine_models import engine

    sizes = forward_sizes(monkeypatch)
    for caching in (True, False):
        eng = engine(target, drafts["noisy"], method, bs=4, prefix_caching=caching, prefill_chunk=chunk, **extra)
        assert [r.token_ids for r in eng.generate(prompts)] == reference
    assert sizes and max(sizes) <= chunk and len(sizes) > 2 * len(prompts)


def test_top_ids_from_a_prefill_in_chunks_are_the_whole_prefills(target, prompts):
    """Alignment sampling's top ids at every prompt position (specdec/exec/prefill.py's chunk loop gathers each
    forward's): the same ids, zero past each row's length, as one forward over the whole admission."""
    from engine_models import pair
    from specdec.config import SamplingParams, SpecConfig
    from specdec.engine import SpecEngine
    from specdec.plan.policies.simple import FixedLength
    from specdec.sched.batch import Row

    out = []
    for chunk in (None, 5):
        eng = SpecEngine(pair(target, None), SamplingParams(max_new_tokens=4), SpecConfig(
            method="prompt_lookup", prompt_lookup={"alignment_sampling": 2}), batch_size=4, prefill_chunk=chunk)
        batch = eng.new_batch(4, 64, FixedLength(eng.spec))
        rows = [Row(i, None, list(p), None, 0.0, SamplingParams()) for i, p in enumerate(prompts[:4])]
        batch.write_rows(0, rows)  # 5, 17, 1 and 9 tokens
        out.append(batch.prefill_target(0, 4, 3)[0])
    assert out[0].shape == out[1].shape == (4, 16, 3) and (out[0] == out[1]).all() and out[0][1].any()


def test_a_draft_catching_up_on_whole_rows_does_it_in_chunks(target, drafts, prompts, monkeypatch):
    """Rows that joined while the policy drafted nothing (goodput at K = 0) have an empty draft cache; the first
    drafting round feeds them whole. With a chunk of 8 tokens the draft fills its cache in forwards of at most 8
    tokens and steps the last token alone: the same last logits and the same cache as one forward (float32)."""
    from engine_models import pair
    from specdec.sched.batch import Row
    from specdec.config import SamplingParams, SpecConfig
    from specdec.engine import SpecEngine
    from specdec.plan.policies.simple import FixedLength

    sizes = forward_sizes(monkeypatch, steps=True)
    out = {}
    for chunk in (None, 8):
        eng = SpecEngine(pair(target, drafts["noisy"]), SamplingParams(max_new_tokens=4),
                         SpecConfig(method="draft_model"), batch_size=4, prefix_caching=False, prefill_chunk=chunk)
        batch = eng.new_batch(4, 64, FixedLength(eng.spec))
        rows = [Row(i, None, list(p), None, 0.0, SamplingParams()) for i, p in enumerate(prompts[4:8])]
        batch.write_rows(0, rows)  # 30, 3, 12 and 8 tokens
        batch.proposer.admit(0, 4, drafting=False)
        sizes.clear()
        with torch.inference_mode():
            logits, _ = batch.proposer.catch_up(4)
        cache = batch.proposer.runner.cache
        out[chunk] = (logits.clone(), [cache.k[0][i, :, : len(p)].clone() for i, p in enumerate(prompts[4:8])],
                      max(sizes), len(sizes))
    (whole, whole_cache, whole_max, whole_n), (part, part_cache, part_max, part_n) = out[None], out[8]
    assert whole_n == 1 and whole_max == 4 * 30 and part_max <= 8 and part_n > 4
    assert torch.allclose(whole, part, atol=1e-5) and torch.equal(whole.argmax(-1), part.argmax(-1))
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(whole_cache, part_cache))


def test_a_draft_catching_up_takes_its_prefix_store_blocks(target, drafts, monkeypatch):
    """Rows whose draft cache is empty (they joined while the policy drafted nothing) take the blocks the draft's
    store holds of their prompts when the draft catches up, and compute only the rest: the same last logits as a
    catch-up without a store (float32)."""
    from engine_models import pair
    from specdec.sched.batch import Row
    from specdec.config import SampleResult, SamplingParams, SpecConfig
    from specdec.engine import SpecEngine
    from specdec.plan.policies.simple import FixedLength

    computed = forward_sizes(monkeypatch, steps=True)  # tokens of the models' forwards (a prefill or a step)
    prompts = shared_prompts(4, shared=48)
    out = {}
    for caching in (False, True):
        eng = SpecEngine(pair(target, drafts["noisy"]), SamplingParams(max_new_tokens=4),
                         SpecConfig(method="draft_model"), batch_size=4, prefix_caching=caching)

        def batch(drafting: bool):
            b = eng.new_batch(4, 128, FixedLength(eng.spec))
            b.write_rows(0, [Row(i, SampleResult(key=i, prompt_tokens=len(p)), list(p), None, 0.0,
                                 SamplingParams()) for i, p in enumerate(prompts)])
            b.prefill_target(0, 4)
            b.proposer.admit(0, 4, drafting=drafting)
            return b

        batch(drafting=True)  # an earlier admission that drafted: the draft's store holds the shared blocks
        later = batch(drafting=False)
        computed.clear()
        with torch.inference_mode():
            logits, _ = later.proposer.catch_up(4)
        out[caching] = (logits.clone(), sum(computed))
    assert torch.allclose(out[False][0], out[True][0], atol=1e-5)
    assert out[True][1] <= out[False][1] - 4 * 48  # the shared 48 tokens of every row came from the store


def test_admission_runs_rows_of_one_prefix_together_longest_cluster_first():
    from specdec.exec.prefix import admission_order

    a, b = [1] * 8, [2] * 8
    prompts = [a + [5], b + [9, 9, 9], a + [3, 3], [7, 7], b + [4], a + [5]]
    # clusters by their first 8 tokens: b's (longest row 11) first, then a's (10), then the short one; inside a
    # cluster in token order, equal prompts in their own order
    assert admission_order(prompts, 8) == [4, 1, 2, 0, 5, 3]


def test_the_shared_tokens_are_the_most_blocks_rows_running_together_share():
    from specdec.exec.prefix import shared_tokens

    a, b = list(range(40)), list(range(100, 200))  # 2 whole 16-token blocks, and 6
    prompts = [a + [i] for i in range(3)] + [b + [i] for i in range(3)] + [[7] * 50]
    assert shared_tokens(prompts, 3, 16) == 96  # b's instruction, counted once
    assert shared_tokens(prompts, 2, 16) == 96
    assert shared_tokens(prompts, 7, 16) == 32 + 96  # both run together
    assert shared_tokens(prompts, 1, 16) == 0  # a row alone shares nothing
    assert shared_tokens([b + [0], [9] * 20 + b], 2, 16) == 0  # the same text past the first block is no prefix
    assert shared_tokens([a[:32], a[:32]], 2, 16) == 16  # within what a prefill caches (all but the last token)


def test_rows_of_two_instructions_each_compute_theirs_once_when_the_store_holds_one(target):
    """Rows of two 144-token instructions, interleaved by length (longest first would alternate them), a store that
    holds one instruction's blocks: the rows of one instruction run together, so each instruction is computed once
    and every other row takes its nine blocks; greedy tokens equal transformers'."""
    from engine_models import engine
    from specdec.exec.cache import model_kv_bytes

    g = torch.Generator().manual_seed(3)
    heads = [torch.randint(0, 96, (144,), generator=g).tolist() for _ in range(2)]
    prompts = [heads[i % 2] + torch.randint(0, 96, (10 - i,), generator=g).tolist() for i in range(8)]
    eng = engine(target, None, "none", bs=2, max_new=3)
    eng.prefix.limit(12 * 16 * model_kv_bytes(target))
    res = eng.generate(prompts)
    assert sum(r.cached_prompt_tokens for r in res) == 6 * 144
    assert [r.token_ids for r in res] == transformers_greedy(target, prompts, 3)


def test_alignment_top_ids_come_with_a_stored_prefix(target):
    """AASD's top ids at every prompt position (alignment sampling): rows that take a stored prefix get the ids
    kept with its blocks and compute the rest, the same ids as a prefill without a store; a block stored by a
    prefill that did not compute ids is not matched by one that needs them, and gets them when such a row stores."""
    from engine_models import pair
    from specdec.sched.batch import Row
    from specdec.config import SampleResult, SamplingParams, SpecConfig
    from specdec.engine import SpecEngine
    from specdec.plan.policies.simple import FixedLength

    prompts = shared_prompts(4, shared=40)
    off, on = (SpecEngine(pair(target, None), SamplingParams(max_new_tokens=4), SpecConfig(
        method="prompt_lookup", prompt_lookup={"alignment_sampling": 2}), batch_size=4, prefix_caching=caching)
        for caching in (False, True))
    out = []
    for eng, want in ((off, 3), (on, 0), (on, 3), (on, 3)):
        b = eng.new_batch(4, 128, FixedLength(eng.spec))
        b.write_rows(0, [Row(i, SampleResult(key=i, prompt_tokens=len(p)), list(p), None, 0.0, SamplingParams())
                         for i, p in enumerate(prompts)])
        ids, plan = b.prefill_target(0, 4, want)
        out.append((ids, plan.counts("reused")))
    ids, reused = out[0]
    assert out[1][0] is None and out[1][1].tolist() == [0] * 4  # a store without ids: blocks of 32 tokens
    assert out[2][1].tolist() == [0] * 4  # ... that rows needing ids do not take, and compute (then store) them
    assert out[3][1].tolist() == [32] * 4  # now every row takes two blocks with their ids
    for got, _ in out[2:]:
        assert got.shape == ids.shape and (got == ids).all()
