"""The paged KV cache (specdec/exec/cache.py): blocks reserved and freed by rows, and the engine's output over it equal
to transformers' and to the dense cache's, on every path a step can take (float32)."""

from __future__ import annotations

import itertools

import pytest
import torch

from engine_models import MAX_NEW, engine, flat_profile, pair, tiny_llama
from specdec.exec import memory
from specdec.exec.cache import BLOCK, PagedKVCache, RaggedKVCache
from specdec.config import SamplingParams, SpecConfig
from specdec.engine import SpecEngine
from specdec.exec.prefix import PrefixStore
from specdec.sched.rounds import Rounds


def test_rows_reserve_blocks_release_them_and_move_by_their_table():
    """A row takes the blocks of its slots and no more, a leaving row gives them back, a moved row keeps its keys
    and values (its table row moves), a copied row shares the source's whole blocks (freed when neither holds them)
    and copies the rest, and a row the pool cannot hold is refused."""
    model = tiny_llama(layers=1)
    cache = PagedKVCache(model, rows=3, max_len=64, blocks=1 + 6)
    assert cache.free_slots() == 6 * BLOCK and cache.reservation(33) == 3 * BLOCK
    cache.reserve(0, 33)  # 3 blocks
    cache.reserve(1, 16)  # 1 block
    assert cache.free_slots() == 2 * BLOCK
    assert (cache.table[0, :3] > 0).all() and (cache.table[0, 3:] == 0).all() and (cache.table[2] == 0).all()
    k = torch.randn(1, cache.kv_heads, 33, cache.head_dim)
    cache.write_slots(0, 0, k, -k)
    with pytest.raises(RuntimeError, match="needs 3 blocks, 2 are free"):
        cache.reserve(2, 40)
    cache.release(1)
    cache.move_row(0, 1, 33)  # row 0 leaves its slot for row 1's: no keys are copied, the table row moves
    assert (cache.table[0] == 0).all() and cache.free_slots() == 3 * BLOCK
    torch.testing.assert_close(cache.read_slots(1, 0, 33)[0], k)
    cache.reserve(2, 40)
    assert cache.free_slots() == 0
    cache.copy_row(1, 2, 33)  # a sample of row 1's prompt: its 2 whole blocks are shared, the 33rd slot is copied
    assert cache.owned[2][:2] == cache.owned[1][:2] and cache.owned[2][2] != cache.owned[1][2]
    assert cache.held_slots(2) == 32 and cache.free_slots() == 2 * BLOCK  # row 2's own 2 came back
    torch.testing.assert_close(cache.read_slots(2, 0, 33)[1], -k)
    cache.release(1)  # the shared blocks stay while row 2 holds them
    assert cache.free_slots() == 3 * BLOCK
    torch.testing.assert_close(cache.read_slots(2, 0, 33)[1], -k)
    cache.release(2)
    assert cache.free_slots() == 6 * BLOCK and not cache.table.any()


@pytest.mark.parametrize("layout", ["dense", "paged"])
def test_moves_and_copies_of_slots_carry_every_layer_and_touch_nothing_else(layout):
    """Every layer's keys and values lie in one tensor: a row's move, a sample's copy, a tree's kept path and the
    slots the prefix store reads and writes carry each layer's own keys and values (none of another layer's), and
    leave every other slot as it was."""
    model = tiny_llama(layers=3)
    cache = RaggedKVCache(model, rows=3, max_len=48) if layout == "dense" else \
        PagedKVCache(model, rows=3, max_len=48, blocks=1 + 9)
    for row in range(3):
        cache.reserve(row, 48)
    assert all(kc.data_ptr() == cache.keys[i].data_ptr() for i, kc in enumerate(cache.k))
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(3, cache.kv_heads, 48, cache.head_dim, generator=g) for _ in range(3)]  # [layers, ...]
    for row, k in enumerate(rows):
        cache.write_slots(row, 0, k, -k)

    def held(row):
        k, v = cache.read_slots(row, 0, 48)
        torch.testing.assert_close(v, -k)
        return k.clone()

    assert all(torch.equal(held(row), rows[row]) for row in range(3))
    cache.move_row(2, 0, 20)  # row 0 takes row 2's first 20 slots, in every layer
    want = rows[0].clone()
    want[:, :, :20] = rows[2][:, :, :20]
    assert torch.equal(held(0), want) if layout == "dense" else torch.equal(held(0)[:, :, :20], want[:, :, :20])
    if layout == "paged":  # a table row moved: row 0 is row 2 now; give row 2 blocks again
        cache.reserve(2, 48)
        cache.write_slots(2, 0, rows[2], -rows[2])
        want = rows[2].clone()
    cache.copy_row(1, 2, 37)  # a sample of row 1's first 37 slots
    copied = rows[2].clone()
    copied[:, :, :37] = rows[1][:, :, :37]
    assert torch.equal(held(2)[:, :, :37], copied[:, :, :37]) and torch.equal(held(1), rows[1])
    before = [held(row) for row in range(3)]
    src = torch.tensor([[39, 41], [38, 40], [42, 37]])  # past the whole blocks rows 1 and 2 share (paged)
    dst = torch.tensor([[44, 45], [46, 47], [43, 44]])
    cache.move_slots(src, dst)  # each row's slots src[i] land at dst[i], in every layer
    for row in range(3):
        after, expect = held(row), before[row].clone()
        expect[:, :, dst[row]] = before[row][:, :, src[row]]
        assert torch.equal(after, expect)


def test_the_prefix_store_pins_pool_blocks_that_joining_rows_share_and_others_reclaim():
    """Over a paged cache the store keeps a row's own blocks (pinned, not copied); a row joining with that prompt
    holds them from the start and reserves only what it writes; blocks only the store holds count as free (one a
    joining row would share counts as taken) and are reclaimed when rows need them; blocks rows hold are never
    evicted, whatever the store's budget."""
    cache = PagedKVCache(tiny_llama(layers=1), rows=3, max_len=128, blocks=1 + 8)
    store = PrefixStore(budget=1 << 30)
    store.attach(cache)
    prompt = list(range(40))  # 2 whole blocks within the 39 tokens a prefill caches
    cache.reserve_rows([0], [60], [prompt])  # 4 blocks: nothing is stored yet
    k = torch.randn(1, cache.kv_heads, 39, cache.head_dim)
    cache.write_slots(0, 0, k, -k)
    assert store.store(cache, 0, prompt, 39) == 2
    assert {b.pool for b in store.blocks.values()} == set(cache.owned[0][:2]) and store.device_bytes == 0
    assert cache.reservation(60, prompt) == 2 * BLOCK  # row 0 holds the shared blocks: only the row's own count
    cache.reserve_rows([1], [60], [prompt])
    assert cache.owned[1][:2] == cache.owned[0][:2] and cache.held_slots(1) == 32 and cache.free_slots() == 2 * BLOCK
    torch.testing.assert_close(cache.read_slots(1, 0, 32)[0], k[:, :, :32])
    cache.release(0)
    store.budget = 0
    store._evict()  # row 1 holds both: evicting them would free nothing
    assert len(store.blocks) == 2
    cache.release(1)
    assert len(cache.free) == 6 and cache.free_slots() == 8 * BLOCK  # pinned by the store alone: free for rows
    assert cache.reservation(60, prompt) == 4 * BLOCK  # sharing them takes them out of the free ones
    store.budget = 1 << 30
    cache.reserve(2, 8 * BLOCK)  # the whole pool: the store's blocks are reclaimed
    assert not store.blocks and not cache.free
    cache.release(2)
    assert cache.free_slots() == 8 * BLOCK


@pytest.mark.parametrize("bs", [1, 3, 8])
@pytest.mark.parametrize("method,k", [("draft_model", None), ("draft_model", 4), ("none", None),
                                      ("prompt_lookup", 4)])
def test_paged_rows_give_transformers_greedy_output(target, drafts, prompts, reference, bs, method, k):
    spec = {} if k is None else {"num_draft_tokens": k, "draft_length": "fixed"}
    eng = engine(target, drafts["noisy"], method, bs, kv_cache="paged", **spec)
    out = eng.generate(prompts)
    assert [r.token_ids for r in out] == reference
    cache = eng._runners["target"].cache
    assert isinstance(cache, PagedKVCache) and cache.free_slots() == (cache.blocks - 1) * BLOCK  # all given back
    if eng.profile_s == 0:  # no start-up profile grew the pool first: without a memory plan it holds the longest
        # rows at once, each by its own slots
        longest = sorted((eng.row_tokens(len(p)) for p in prompts), reverse=True)[:bs]
        assert cache.blocks == memory.pool_blocks(longest)


@pytest.mark.parametrize("width, block, splits", [(1, BLOCK, False), (4, BLOCK, False), (4, BLOCK, True),
                                                 (3, 64, False), (3, 64, True)])
def test_flex_view_attends_as_the_rows_gathered_blocks_do(width, block, splits, monkeypatch):
    """The engine's FlexAttention view over a pool whose blocks lie anywhere (`_FlexView`, compiled as captured
    steps run it), blocks of the default size and of another, its mask as a CPU's kernel wants it (rows padded, whole
    blocks unmasked) and as CUDA's does (`splits`: the step's rows, every block masked; one query per row does not
    compile on a CPU that way): for a window of 4 of a cache's 6 rows, rows whose queries start and end on either
    side of a block's edge, one sharing another's whole blocks by reference, and a window wider than every row: the
    same output as SDPA over the rows' gathered blocks with each query seeing the slots up to its position."""
    import torch.nn.functional as F

    from specdec.exec.cache import _FlexView
    from specdec.exec.graphs import compiled_flex

    monkeypatch.setattr(_FlexView, "splits", splits)
    model = tiny_llama(layers=1)
    cache = PagedKVCache(model, rows=6, max_len=6 * block, blocks=1 + 30, block=block)
    cache.flex = compiled_flex()
    g = torch.Generator().manual_seed(width)
    perm = torch.randperm(30, generator=g).tolist()
    cache.free = [b + 1 for b in perm]  # blocks handed out in a shuffled order
    ends = [2 * block - 1, 2 * block, 3 * block + 5, width + 2]  # each row's last query's position, + 1
    cache.reserve_rows([1, 2, 3, 4], ends)
    for layer in range(cache.num_layers):
        cache.k[layer].normal_(generator=g)
        cache.v[layer].normal_(generator=g)
    cache.copy_row(3, 2, 2 * block)  # row 2's two whole blocks are row 3's
    assert cache.table[2, :2].tolist() == cache.table[3, :2].tolist()
    positions = torch.tensor(ends)[:, None] - width + torch.arange(width)
    window = 4 * block + 8
    heads, hd = model.config.num_attention_heads, cache.head_dim
    q = torch.randn(4, heads, width, hd, generator=g)
    view = cache.view(1, 5, positions, window, attend=True)
    assert isinstance(view, _FlexView)
    got = view.attend(0, q)
    k, v = cache.view(1, 5, positions, window).read(0)  # [rows, kv_heads, window, hd], gathered
    seen = torch.arange(window)[None, None, :] <= positions[:, :, None]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=seen[:, None], enable_gqa=True)
    torch.testing.assert_close(got, want.transpose(1, 2).reshape(4, width, heads * hd))


@pytest.mark.parametrize("block", [BLOCK, 64])
def test_flex_attention_over_the_pool_gives_transformers_greedy_output(target, drafts, prompts, reference, block):
    """`paged_attention="flex"`: the captured steps (here the padded static steps a CPU runs) attend with
    FlexAttention over the pool in place, prefix blocks shared by reference; rows joining through a batch of 2, a
    fixed k=2 draft model (its catch-up, draft steps and 3-wide verification all captured steps), blocks of 16 and
    64 slots: transformers' greedy tokens, the steps did attend that way, and FlexAttention compiled once per
    queries' width and pool, not again for each step's rows."""
    from torch._dynamo.utils import counters

    import specdec.exec.cache as cache_mod

    seen = []
    original = cache_mod._FlexView.attend

    def attend(self, layer, q):
        seen.append((*q.shape, *self.cache.k[layer].shape))  # queries [rows, heads, width, head_dim]; the pool's
        return original(self, layer, q)

    eng = SpecEngine(pair(target, drafts["noisy"]), SamplingParams(max_new_tokens=MAX_NEW),
                     SpecConfig(method="draft_model", draft_length="fixed", num_draft_tokens=2), batch_size=2,
                     kv_cache="paged", paged_attention="flex", step_graphs=True, kv_block=block)
    cache_mod._FlexView.attend = attend
    compiled = counters["stats"]["unique_graphs"]
    try:
        out = eng.generate(prompts[:4])
    finally:
        cache_mod._FlexView.attend = original
    assert [r.token_ids for r in out] == reference[:4]
    assert sum(r.accepted_tokens for r in out) > 0
    assert {shape[2] for shape in seen} >= {1, 4}  # draft steps and the padded 3-wide verification
    assert {shape[0] for shape in seen} == {1, 2}  # steps of one row and of two
    assert counters["stats"]["unique_graphs"] - compiled <= len({shape[1:] for shape in seen})
    assert eng._runners["draft"].cache.block == block
    with pytest.raises(ValueError, match="paged_attention"):
        SpecEngine(pair(target), SamplingParams(), SpecConfig(method="none"), paged_attention="blocks")
    with pytest.raises(ValueError, match="kv_block must be a multiple of 16, not 24"):
        SpecEngine(pair(target), SamplingParams(), SpecConfig(method="none"), kv_cache="paged", kv_block=24)


@pytest.mark.parametrize("path", [{"fast_path": False}, {"step_graphs": True}])
def test_sampled_rows_samples_trees_and_every_path_equal_the_dense_cache(target, drafts, prompts, path):
    """Sampled rows with n = 2 (a sample copies its prompt's row), then prompt lookup's token trees (a tree's
    accepted path moves slots): the same tokens over paged rows as over dense ones, through transformers' own
    modules and through the padded static steps (what CUDA graphs replay)."""
    runs = {}
    for layout in ("dense", "paged"):
        sp = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.8, n=2, seed=5)
        ticks = itertools.count()  # goodput's choices follow its rounds' timings: a clock that ticks per call
        eng = SpecEngine(pair(target, drafts["noisy"]), sp, SpecConfig(method="draft_model"), batch_size=5,
                         profile=flat_profile(), kv_cache=layout, clock=lambda: float(next(ticks)), **path)
        repeating = [p * 3 for p in prompts]
        trees = SpecEngine(pair(target), SamplingParams(max_new_tokens=MAX_NEW),
                           SpecConfig(method="prompt_lookup", num_draft_tokens=4, draft_length="fixed",
                                      prompt_lookup={"alignment_sampling": 2}),
                           batch_size=3, kv_cache=layout, **path)
        tree_out = trees.generate(repeating)
        runs[layout] = [r.token_ids for r in eng.generate(prompts)], [r.token_ids for r in tree_out]
        assert sum(r.accepted_tokens for r in tree_out) > 0
    assert runs["paged"] == runs["dense"]


@pytest.mark.parametrize("block", [BLOCK, 32])
def test_shared_prefixes_are_reused_into_paged_rows(target, block):
    """Over a paged cache the store's blocks are pool blocks that later rows point at: rows reuse the shared
    instruction, give the tokens of a run without the store, and the store holds no copy; with blocks of 16 slots
    and of 32 (`kv_block`: the pool's and the store's blocks)."""
    g = torch.Generator().manual_seed(4)
    shared = torch.randint(0, 96, (40,), generator=g).tolist()
    prompts = [shared + torch.randint(0, 96, (n,), generator=g).tolist() for n in (3, 9, 5, 12, 7)]
    eng = engine(target, None, "none", 2, kv_cache="paged", kv_block=block)
    got = eng.generate(prompts)
    ref = engine(target, None, "none", 2, prefix_caching=False).generate(prompts)
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    assert eng._runners["target"].cache.block == eng.prefix["target"].block == block
    assert sorted(r.cached_prompt_tokens for r in got) == [0] + [32] * 4  # whole blocks of the 40 shared tokens
    store, cache = eng.prefix["target"], eng._runners["target"].cache
    assert store.pool is cache and len(store.blocks) >= 32 // block
    assert store.device_bytes == 0 == eng.prefix.device_bytes
    assert all(cache.refs[b.pool] == 1 for b in store.blocks.values())  # pinned by the store alone, rows gone


@pytest.mark.parametrize("method,sp,spec", [
    ("draft_model", {"n": 2, "temperature": 0.8, "seed": 3}, {}),
    ("prompt_lookup", {}, {"prompt_lookup": {"alignment_sampling": 2}, "num_draft_tokens": 3, "draft_length": "fixed"}),
])
def test_rows_sharing_stored_blocks_from_the_start_draw_what_dense_rows_do(target, drafts, method, sp, spec,
                                                                           monkeypatch):
    """Rows of one instruction over a paged pool, batch 2 so that later rows join once its blocks are stored and
    point at them from the start (a prompt's samples too; under AASD only blocks that keep the target's top ids):
    the same tokens as dense rows without prefix caching, sampled or greedy, the draft's pool shares as well, and no
    row writes a slot of a block it holds by reference (the stored blocks keep their keys and values to the end)."""
    g = torch.Generator().manual_seed(6)
    shared = torch.randint(0, 96, (48,), generator=g).tolist()
    prompts = [shared + torch.randint(0, 96, (n,), generator=g).tolist() * 2 for n in (3, 9, 5, 12, 7)]
    joined_holding = []
    real = PagedKVCache.reserve_rows

    def reserve_rows(self, rows, slots, prompts=None):
        real(self, rows, slots, prompts)
        joined_holding.extend(self.held_slots(r) for r in rows)

    monkeypatch.setattr(PagedKVCache, "reserve_rows", reserve_rows)
    written = {}  # (cache, pool block, its tokens and parent) -> its keys and values when the store took it
    real_store = PrefixStore.store

    def store(self, cache, row, tokens, cached, top=None):
        added = real_store(self, cache, row, tokens, cached, top)
        for b in self.blocks.values():
            at = slice(b.pool * BLOCK, (b.pool + 1) * BLOCK)
            written.setdefault((id(cache), b.pool, b.tokens, b.parent), [kv[at].clone() for kv in (*cache.k, *cache.v)])
        return added

    monkeypatch.setattr(PrefixStore, "store", store)
    runs = {}
    for layout, caching in (("dense", False), ("paged", True)):
        ticks = itertools.count()  # goodput's choices follow its rounds' timings: a clock that ticks per call
        eng = SpecEngine(pair(target, drafts["noisy"] if method == "draft_model" else None),
                         SamplingParams(max_new_tokens=MAX_NEW, **sp), SpecConfig(method=method, **spec),
                         batch_size=2, profile=flat_profile(), kv_cache=layout, prefix_caching=caching,
                         clock=lambda: float(next(ticks)))
        out = eng.generate(prompts)
        runs[layout] = [r.token_ids for r in out]
        if caching:
            assert sum(r.cached_prompt_tokens for r in out) >= (len(out) - 1) * 48
            for name, store in eng.prefix.stores.items():
                cache = eng._runners[name].cache
                assert store.pool is cache and store.blocks and cache.free_slots() == (cache.blocks - 1) * BLOCK
    assert runs["paged"] == runs["dense"]
    assert joined_holding.count(48) >= 3  # rows that joined holding the instruction's 3 blocks
    kept = [(store.pool, b) for store in eng.prefix.stores.values() for b in store.blocks.values()]
    assert len(kept) >= 3
    for cache, b in kept:  # no row wrote a slot of a block it held by reference
        at = slice(b.pool * BLOCK, (b.pool + 1) * BLOCK)
        then = written[id(cache), b.pool, b.tokens, b.parent]
        assert all(torch.equal(kv[at], old) for kv, old in zip((*cache.k, *cache.v), then))


def test_rows_wait_for_blocks_and_none_is_lost(target, prompts, reference, monkeypatch):
    """A pool smaller than the batch's rows need at once: rows join as blocks come free, every row finishes with
    transformers' output, and the batch never held more rows than the pool had room for."""
    eng = engine(target, None, "none", 8, kv_cache="paged", prefix_caching=False)
    held, blocks = [], 1 + 9  # rows take 2-4 blocks (27-56 slots): 2 to 4 rows at once, not 8
    real = eng.new_batch
    monkeypatch.setattr(eng, "new_batch", lambda rows, max_len, policy, _, **kw: real(rows, max_len, policy, blocks,
                                                                                       **kw))
    real_launch = Rounds.launch
    monkeypatch.setattr(Rounds, "launch", lambda self, *a: (held.append(self.batch.n), real_launch(self, *a))[1])
    out = eng.generate(prompts)
    assert [r.token_ids for r in out] == reference
    assert eng._runners["target"].cache.blocks == blocks
    assert 2 <= max(held) <= 4 < len(prompts)
