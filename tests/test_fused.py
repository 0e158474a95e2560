"""The fused decode kernels (specdec/exec/fused.py): each computes what the ops it replaces do, and captured steps of
few tokens through them give transformers' greedy rows, dense and paged. On a GPU; on a CPU under Triton's
interpreter (triton installed and TRITON_INTERPRET=1 in the environment: a check, slow); skipped where neither is
(CI's CPU image has no triton: the GPU kit's first call runs this file)."""

import itertools
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from engine_models import DEVICE, LOOKUP_NEW, MAX_NEW, pair
from specdec.config import SamplingParams, SpecConfig
from specdec.engine import SpecEngine
from specdec.exec import fused, llama
from specdec.exec.runner import ModelRunner
from test_fastpath import cache_of

WHY = fused.available(torch.device(DEVICE))
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"the fused products: {WHY}")
HALF = torch.bfloat16 if DEVICE == "cuda" else torch.float16  # (the interpreter's numpy has no bfloat16)


@pytest.fixture(params=["widest", "narrowed"])
def tiles(request, monkeypatch):
    """The products' tiles as CONFIGS gives them, or narrowed for a grid of WAVES programs per multiprocessor (what
    these small weights take; no grid of them has that many programs, so WAVES 0 keeps the widest)."""
    if request.param == "widest":
        monkeypatch.setattr(fused, "WAVES", 0)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_each_fused_product_computes_what_its_unfused_ops_do(rows, dtype, tiles):
    """RMSNorm then the product with a bias (q/k/v), the product then the residual (o), SwiGLU then the product then
    the residual (down), against the ops the compiled pieces run, at sizes no block divides (masked tails), in the
    widest tiles and narrowed ones: equal up to a rounding of the output (float32 sums in another order; in half
    precision a rare intermediate rounded the other way)."""
    g = torch.Generator().manual_seed(rows)
    k, n = 200, 150

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(DEVICE, dtype)

    x, gu, res = randn(rows, k), randn(rows, 2 * k), randn(rows, n)
    w, ln, bias = randn(n, k, scale=0.1), 1 + randn(k, scale=0.1), randn(n)
    cases = {
        "norm, bias": (fused.product(x, w, fused.NORM, ln, 1e-5, bias=bias),
                       F.linear(llama.rms_norm(x, ln, 1e-5), w, bias)),
        "residual": (fused.product(x, w, residual=res), res + F.linear(x, w)),
        "swiglu, residual": (fused.product(gu, w, fused.SWIGLU, residual=res),
                             res + F.linear(F.silu(gu[:, :k]) * gu[:, k:], w)),
        "3-d input": (fused.product(x.view(1, rows, k), w), F.linear(x, w).view(1, rows, n)),
    }
    for name, (got, want) in cases.items():
        assert got.shape == want.shape and got.dtype == dtype, name
        tol = (1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps) * want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=0, atol=tol, msg=name)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows,tokens", [(1, 1), (3, 2), (8, 1)])
@pytest.mark.parametrize("layout", ["dense", "paged"])
def test_the_fused_layer_start_gives_the_pieces_q_and_writes_their_keys_and_values(target, layout, rows, tokens,
                                                                                   bias, tiles):
    """`qkv_rope` (RMSNorm, q/k/v with or without a bias, RoPE, k and v into the cache at each token's slot) against
    llama's `_first` over another cache of the same layout: the same q, and the same caches (every slot, written or
    not), dense and paged (rows' blocks scattered over the pool), at ragged positions, in the widest tiles and
    narrowed ones (fewer pairs of columns a program)."""
    g = torch.Generator().manual_seed(rows * 10 + tokens)
    w = llama.load_weights(target)
    layer = w.layers[0]
    if bias:
        layer = replace(layer, qkv_bias=torch.randn(layer.qkv.shape[0], generator=g).to(DEVICE, layer.qkv.dtype))
    caches = [cache_of(target, layout, rows=8) for _ in range(2)]
    start = torch.randint(0, 40, (rows, 1), generator=g)
    positions = (start + torch.arange(tokens)).to(DEVICE)
    x = torch.randn(rows, tokens, w.embed.shape[1], generator=g).to(DEVICE, w.embed.dtype)
    cos, sin, _ = llama._rope_and_mask(w, positions, None)
    dims = (w.heads, w.kv_heads, w.head_dim)
    views = [c.view(0, rows, positions, 64) for c in caches]
    want = llama._first(x, layer, cos, sin, *dims, w.eps, caches[0].k[0], caches[0].v[0], views[0].at)
    k, v = caches[1].k[0], caches[1].v[0]
    got = fused.qkv_rope(x, layer, w.eps, cos, sin, *dims, k, v, *fused.token_offsets(views[1].at, k))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in ((caches[0].k[0], k), (caches[0].v[0], v)):
        assert a.abs().sum() > 0  # (written)
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_cache", ["dense", "paged"])
def test_captured_steps_through_the_fused_kernels_give_transformers_greedy_rows(target, drafts, prompts, reference,
                                                                                 kv_cache, monkeypatch):
    """Float32 greedy rows through the static steps (captured on a GPU): autoregressive at batch 8 and 1, and a draft
    model's fixed chains of 2 at batch 2 (its steps and the target's 3-token verifications fused too). Steps of at
    most MAX_TOKENS tokens run through the fused kernels (counted), none falls back to eager, and every row equals
    transformers' generate."""
    monkeypatch.setattr(ModelRunner, "fuse_products", True)
    calls = {"product": 0, "widest": 0}
    product, qkv_rope = fused.product, fused.qkv_rope

    def counted(*a, **kw):
        calls["product"] += 1
        return product(*a, **kw)

    def widest(x, *a, **kw):
        calls["widest"] = max(calls["widest"], x.shape[1])
        return qkv_rope(x, *a, **kw)

    monkeypatch.setattr(fused, "product", counted)
    monkeypatch.setattr(fused, "qkv_rope", widest)
    chains = dict(method="draft_model", draft_length="fixed", num_draft_tokens=2)
    for bs, draft, spec in ((8, None, dict(method="none")), (1, None, dict(method="none")),
                            (2, drafts["noisy"], chains)):
        ticks = itertools.count()
        engine = SpecEngine(pair(target, draft), SamplingParams(max_new_tokens=MAX_NEW), SpecConfig(**spec),
                            batch_size=bs, step_graphs=True, kv_cache=kv_cache, clock=lambda: float(next(ticks)))
        out = engine.generate(prompts)
        for runner in engine._runners.values():
            assert runner.path.startswith("graphs+fused" if DEVICE == "cuda" else "lean+fused"), runner.path
            assert runner.checked and not runner.eager, runner.eager  # each shape checked against eager, none failed
        assert [r.token_ids for r in out] == reference, (bs, spec)
    layers = len(target.model.layers)
    assert calls["product"] >= 2 * 3 * layers * MAX_NEW  # three a layer a step, at the least, at batch 8 and 1
    assert 3 <= calls["widest"] <= fused.MAX_TOKENS  # several tokens a row (verifications, the draft's catch-up)


def test_token_trees_through_the_fused_kernels_give_transformers_greedy_rows(target, repeating, greedy, monkeypatch):
    """AASD's token trees (prompt lookup, 2 deep with 2 siblings a node: up to 7 tokens with the root) at batch 1
    through the static steps: the trees' steps fused (at most MAX_TOKENS tokens), none falls back to eager, and
    float32 greedy rows equal transformers' generate."""
    monkeypatch.setattr(ModelRunner, "fuse_products", True)
    spec = SpecConfig(method="prompt_lookup", draft_length="fixed", num_draft_tokens=2, max_draft_tokens=2,
                      prompt_lookup={"alignment_sampling": 2})
    engine = SpecEngine(pair(target, None), SamplingParams(max_new_tokens=LOOKUP_NEW), spec, batch_size=1,
                        step_graphs=True)
    out = engine.generate(repeating)
    runner = engine._runners["target"]
    assert runner.path.startswith("graphs+fused" if DEVICE == "cuda" else "lean+fused"), runner.path
    assert runner.checked and not runner.eager, runner.eager
    trees = [key for key in runner.checked if key[3] == "tree"]
    assert trees and all(rows * width <= fused.MAX_TOKENS for rows, width, _, _ in trees), runner.checked
    assert [r.token_ids for r in out] == greedy


# last in the file: the GPU kit gives the file a budget, and this test's many kernel variants compile after the rows'
@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("rows,tokens", [(1, 1), (3, 2), (8, 1)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 32)])
def test_the_fused_attention_computes_the_pieces_attention_under_the_causal_mask(rows, tokens, heads, kv_heads,
                                                                                   head_dim, dtype):
    """`attend` against llama's `_attend` under the mask a forward builds from the positions (query j of a row sees
    slots 0..its position), over a dense cache's window (a view of rows [1, 1 + rows)) and a gathered one (a paged
    read's strides), windows no block divides, in one program a kv head and with the slots split over programs
    (a second kernel combining them); query groups of 3 (SmolLM2's) and 4."""
    g = torch.Generator().manual_seed(rows * 100 + tokens * 10 + heads)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(DEVICE, dtype)

    for slots, splits in ((50, None), (50, 1), (300, None), (300, 3)):
        dense = randn(10, kv_heads, 512, head_dim), randn(10, kv_heads, 512, head_dim)
        gathered = [randn(rows, slots, kv_heads, head_dim).transpose(1, 2) for _ in range(2)]
        q = randn(rows, heads, tokens, head_dim)
        positions = (torch.randint(0, slots - tokens + 1, (rows, 1), generator=g) + torch.arange(tokens)).to(DEVICE)
        seen = torch.arange(slots, device=DEVICE)[None, None, :] <= positions[:, :, None]
        mask = llama.sdpa_mask(seen[:, None].repeat(1, 1, heads // kv_heads, 1), dtype)
        for name, (keys, values) in (("dense", [c[1:1 + rows, :, :slots] for c in dense]), ("gathered", gathered)):
            got = fused.attend(q, keys, values, positions, splits)
            want = llama._attend(q, keys, values, mask)
            tol = (1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps) * want.abs().max().item()
            torch.testing.assert_close(got, want, rtol=0, atol=tol, msg=f"{name}, {slots} slots, splits {splits}")

