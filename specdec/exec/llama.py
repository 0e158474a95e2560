"""A lean forward for Llama-family decoders (Llama, Mistral, Qwen2, SmolLM) over the ragged KV cache.

The same arithmetic as transformers' modules (RMSNorm in float32, rotate-half RoPE, SDPA attention),
written as one function of plain tensors with static shapes: no Python branches on data, no host
reads, no allocation that depends on values. That is what lets a step be compiled whole
(`torch.compile(fullgraph=True)`) and captured as a CUDA graph (specdec/exec/graphs.py).

Weights are the transformers model's own: q/k/v and gate/up are concatenated once into fused
matrices, and the model's parameters become views into them, so nothing is held twice and the
generic path keeps working on the same model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .cache import KVCache, KVView

FAMILIES = ("llama", "mistral", "qwen2")


@dataclass
class Layer:
    ln1: torch.Tensor
    qkv: torch.Tensor  # [(heads + 2 kv_heads) * head_dim, d]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    ln2: torch.Tensor
    gate_up: torch.Tensor  # [2 * intermediate, d]
    down: torch.Tensor
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None  # tensor parallel: sums o's and down's partials


@dataclass
class LlamaWeights:
    embed: torch.Tensor
    layers: list[Layer]
    norm: torch.Tensor
    cos: torch.Tensor  # [max_positions, head_dim], RoPE tables in the model dtype
    sin: torch.Tensor
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    vocab_start: int = 0  # tensor parallel: `embed` holds rows [vocab_start, vocab_start + rows) of the vocabulary
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None  # and sums the ranks' embeddings


def unsupported(model, max_len: int | None = None) -> str | None:
    """Why `model` cannot run the lean forward (None if it can)."""
    cfg = model.config
    kind = getattr(cfg, "model_type", None)
    if kind not in FAMILIES:
        return f"model type {kind!r} is not one of {FAMILIES}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r}"
    if getattr(cfg, "mlp_bias", False) or (kind != "qwen2" and getattr(cfg, "attention_bias", False)):
        return "biased projections"
    window = getattr(cfg, "sliding_window", None)
    if window is not None and getattr(cfg, "use_sliding_window", kind == "mistral") and (max_len is None or window < max_len):
        return f"sliding-window attention ({window})"
    rotary = getattr(model.get_decoder(), "rotary_emb", None)
    if rotary is None or "dynamic" in str(getattr(rotary, "rope_type", "default")):
        return "rotary embedding that changes with the sequence length"
    layer = model.get_decoder().layers[0]
    if not all(hasattr(layer.self_attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")) or \
            not all(hasattr(layer.mlp, p) for p in ("gate_proj", "up_proj", "down_proj")):
        return "unexpected module layout"
    return None


def _fuse(linears: list[torch.nn.Linear], attr: str = "weight") -> torch.Tensor | None:
    """One matrix holding the linears' weights (or biases) stacked; the linears' own become views."""
    parts = [getattr(m, attr) for m in linears]
    if any(p is None for p in parts):
        return None
    fused = torch.cat([p.data for p in parts], dim=0)
    row = 0
    for m, p in zip(linears, parts):
        p.data = fused[row : row + p.shape[0]]
        row += p.shape[0]
    return fused


def _views_of(fused: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `weight` lies in `fused`'s storage (what `_fuse` made it)."""
    return weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()


def load_weights(model) -> LlamaWeights:
    """The model's weights for `forward` (fused once per model; later calls return the same). A copy of a model
    (`copy.deepcopy`) carries the cache, but its q/k/v are no longer views of the fused matrix it holds: fused anew."""
    cached = getattr(model, "_specbatch_lean", None)
    if cached is not None and _views_of(cached.layers[0].qkv, model.get_decoder().layers[0].self_attn.q_proj.weight):
        return cached
    reason = unsupported(model)
    if reason:
        raise ValueError(f"no lean forward for this model: {reason}")
    dec = model.get_decoder()
    cfg = model.config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    layers = []
    for layer in dec.layers:
        a, m = layer.self_attn, layer.mlp
        layers.append(Layer(
            ln1=layer.input_layernorm.weight,
            qkv=_fuse([a.q_proj, a.k_proj, a.v_proj]),
            qkv_bias=_fuse([a.q_proj, a.k_proj, a.v_proj], "bias"),
            o=a.o_proj.weight,
            ln2=layer.post_attention_layernorm.weight,
            gate_up=_fuse([m.gate_proj, m.up_proj]),
            down=m.down_proj.weight,
        ))
    dtype, device = dec.embed_tokens.weight.dtype, dec.embed_tokens.weight.device
    cos, sin = rope_tables(dec.rotary_emb, cfg, dtype, device)
    weights = LlamaWeights(
        embed=dec.embed_tokens.weight, layers=layers, norm=dec.norm.weight, cos=cos, sin=sin,
        heads=heads, kv_heads=kv_heads, head_dim=head_dim, eps=dec.norm.variance_epsilon,
    )
    model._specbatch_lean = weights
    return weights


def rope_tables(rotary, cfg, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_positions, head_dim] of a transformers rotary module: the same float32 arithmetic,
    done once for every position."""
    positions = getattr(cfg, "max_position_embeddings", 4096)
    freqs = torch.arange(positions, device=device)[:, None].float() * rotary.inv_freq.to(device, torch.float)
    emb = torch.cat((freqs, freqs), dim=-1)
    scale = getattr(rotary, "attention_scaling", 1.0)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def embed(w: LlamaWeights, tokens: torch.Tensor) -> torch.Tensor:
    """Token embeddings [n, t, d]; with a vocabulary split over ranks, each rank looks up the ids it holds
    (zeros for the others) and the ranks' rows are summed."""
    if w.reduce is None:
        return w.embed[tokens]
    local = tokens - w.vocab_start
    held = (local >= 0) & (local < w.embed.shape[0])
    return w.reduce(w.embed[local.clamp(0, w.embed.shape[0] - 1)] * held[..., None])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _attention_in(x: torch.Tensor, layer: Layer, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                  kv_heads: int, head_dim: int, eps: float):
    """Norm, fused q/k/v projection and RoPE: q [n, heads, t, hd], k and v [n, t, kv_heads, hd]."""
    return _heads(F.linear(rms_norm(x, layer.ln1, eps), layer.qkv, layer.qkv_bias), cos, sin, heads, kv_heads,
                  head_dim)


def _heads(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int, head_dim: int):
    """The fused projection's output [n, t, (heads + 2 kv_heads) hd] split into heads, RoPE applied: q [n, heads,
    t, hd], k and v [n, t, kv_heads, hd]."""
    n, t, _ = qkv.shape
    nh, nk, hd = heads, kv_heads, head_dim
    q, k, v = qkv.split([nh * hd, nk * hd, nk * hd], dim=-1)
    q = q.view(n, t, nh, hd).transpose(1, 2)
    k = k.view(n, t, nk, hd).transpose(1, 2)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    return q, k.transpose(1, 2), v.view(n, t, nk, hd)


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attention of q [n, heads, t, hd] over keys/values [n, kv_heads, s, hd] under mask [n, 1, group * t, s]
    (each kv head's group of query heads stacked along t: no repeated cache) -> [n, t, heads * hd]."""
    n, nh, t, hd = q.shape
    nk = keys.shape[1]
    qg = q.reshape(n, nk, (nh // nk) * t, hd)
    o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=hd ** -0.5)
    return o.reshape(n, nh, t, hd).transpose(1, 2).reshape(n, t, nh * hd)


def _layer_out(x: torch.Tensor, layer: Layer, o: torch.Tensor, eps: float) -> torch.Tensor:
    """o_proj of the attention's output o [n, t, heads * hd], the residual, and the MLP."""
    o = F.linear(o, layer.o)
    x = x + (o if layer.reduce is None else layer.reduce(o))
    h = rms_norm(x, layer.ln2, eps)
    gate, up = F.linear(h, layer.gate_up).chunk(2, dim=-1)
    down = F.linear(F.silu(gate) * up, layer.down)
    return x + (down if layer.reduce is None else layer.reduce(down))


def layer_forward(x: torch.Tensor, layer: Layer, kv: KVView, index: int, cos: torch.Tensor, sin: torch.Tensor,
                  mask: torch.Tensor, heads: int, kv_heads: int, head_dim: int, eps: float,
                  pre: Callable = _attention_in, post: Callable = _layer_out) -> torch.Tensor:
    """Decoder layer `index` over a window of cache rows: x [n, t, d] -> [n, t, d]. Writes the rows' keys and
    values where `kv` (the cache's view of this forward, specdec/exec/cache.py) puts them and attends over the slots it
    reads (kv_len = mask.shape[-1]). `pre` (norm, q/k/v, RoPE) and `post` (o_proj, MLP) may be compiled versions
    (specdec/exec/graphs.py): the cache writes and the attention stay outside them, so no compiled code sees the cache's
    or the mask's lengths."""
    q, k, v = pre(x, layer, cos, sin, heads, kv_heads, head_dim, eps)
    kv.write(index, k, v)
    return post(x, layer, kv.attend(index, q) if kv.attends else _attend(q, *kv.read(index), mask), eps)


def layer_prefill(x: torch.Tensor, layer: Layer, kv: KVView, index: int, cos: torch.Tensor, sin: torch.Tensor,
                  mask: torch.Tensor, heads: int, kv_heads: int, head_dim: int, eps: float,
                  pre: Callable = _attention_in, post: Callable = _layer_out) -> torch.Tensor:
    """Decoder layer `index` over fresh rows (their tokens from position 0): writes their keys and values where
    `kv` puts them and attends causally within the forward's own tokens (nothing to read back). `pre`, `post`: as
    `layer_forward`'s."""
    q, k, v = pre(x, layer, cos, sin, heads, kv_heads, head_dim, eps)
    kv.write(index, k, v)
    return post(x, layer, _attend(q, k.transpose(1, 2), v.transpose(1, 2), mask), eps)


def layer_parts(flat: torch.Tensor, shapes: list[tuple[int, int]], layer: Layer, views: list[KVView], index: int,
                cos: torch.Tensor, sin: torch.Tensor, masks: list[torch.Tensor], heads: int, kv_heads: int,
                head_dim: int, eps: float, pre: Callable = _attention_in, post: Callable = _layer_out) -> torch.Tensor:
    """Decoder layer `index` over several windows of cache rows at once, their tokens side by side: flat [1, T, d]
    (window i's n_i x t_i tokens in turn, `shapes`) -> the same shape. The norms, projections, RoPE (cos, sin
    [1, 1, T, hd]: each token's) and the MLP run once over every window's tokens (each weight read once: `pre` and
    `post`, as `layer_forward`'s), the cache writes and attention per window (its view and mask)."""
    q, k, v = pre(flat, layer, cos, sin, heads, kv_heads, head_dim, eps)  # [1, heads, T, hd], [1, T, kv_heads, hd]
    outs, at = [], 0
    for (n, t), kv, mask in zip(shapes, views, masks):
        window = slice(at, at + n * t)
        at += n * t
        kv.write(index, k[0, window].view(n, t, kv_heads, head_dim), v[0, window].view(n, t, kv_heads, head_dim))
        qi = q[0, :, window].view(heads, n, t, head_dim).transpose(0, 1)
        outs.append(_attend(qi, *kv.read(index), mask).reshape(n * t, heads * head_dim))
    return post(flat, layer, torch.cat(outs)[None], eps)


def _rope_and_mask(w: LlamaWeights, positions: torch.Tensor, kv_len: int | None):
    """cos, sin [n, 1, t, hd] at the positions, and the mask [n, 1, group * t, kv_len]: a query at position
    p sees slots 0..p of its own row (None for kv_len None: an attention that masks by the positions itself)."""
    cos = w.cos[positions][:, None]
    sin = w.sin[positions][:, None]
    if kv_len is None:
        return cos, sin, None
    slots = torch.arange(kv_len, device=positions.device)
    mask = (slots[None, None, :] <= positions[:, :, None])[:, None]
    return cos, sin, sdpa_mask(mask.repeat(1, 1, w.heads // w.kv_heads, 1), w.cos.dtype)


ADDITIVE_MASKS = {"cuda"}  # device types whose SDPA turns a boolean mask into an additive one at every call


def sdpa_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention mask as SDPA takes it on its device: where SDPA would turn it into an additive one (0 or
    -inf in the queries' dtype) at every layer, that mask, made once for a forward's layers."""
    if mask.dtype != torch.bool or mask.device.type not in ADDITIVE_MASKS:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def forward(w: LlamaWeights, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor, kv_len: int,
            layer_fn=layer_forward, slots: torch.Tensor | None = None, mask: torch.Tensor | None = None,
            start: int = 0, attend: bool = False) -> torch.Tensor:
    """Hidden states [n, t, d] after the final norm, for cache rows [start, start + n).

    Token j of row i is written at slot positions[i, j] (clamped into the cache's rows) and attends to slots
    0..positions[i, j] of its row, among the first `kv_len` slots. Shapes depend only on (n, t, kv_len). `layer_fn`
    runs each layer (`layer_forward`, or a compiled version of it: every layer has the same shapes, so one compiled
    function serves them all). A token tree (specdec/spec/trees.py) gives the `slots` its tokens are written at
    (default: their positions) and its own `mask` [n, 1, t, >= kv_len]. `attend`: the cache's own attention where
    it has one (a captured step's: `KVCache.view`), for chains.
    """
    n = tokens.shape[0]
    positions = positions.clamp(max=cache.max_len - 1)
    own = attend and slots is None and mask is None  # the queries sit at the slots they write
    kv = cache.view(start, start + n, positions if slots is None else slots.clamp(max=cache.max_len - 1), kv_len,
                    attend=own)
    cos, sin, causal = _rope_and_mask(w, positions, None if kv.attends else kv_len)  # (the cache's own masks)
    if mask is not None:
        causal = sdpa_mask(mask[..., :kv_len].repeat(1, 1, w.heads // w.kv_heads, 1), w.cos.dtype)
    x = embed(w, tokens)
    for index, layer in enumerate(w.layers):
        x = layer_fn(x, layer, kv, index, cos, sin, causal, w.heads, w.kv_heads, w.head_dim, w.eps)
    return rms_norm(x, w.norm, w.eps)


def forward_parts(w: LlamaWeights, cache: KVCache, parts: list[tuple[torch.Tensor, torch.Tensor, int, int]],
                  pre: Callable = _attention_in, post: Callable = _layer_out) -> list[torch.Tensor]:
    """`forward` over several windows of cache rows in one pass over the weights: parts (tokens [n_i, t_i],
    positions [n_i, t_i], kv_len, start) -> hidden states [n_i, t_i, d] after the final norm, each as `forward`
    gives it (rows at different lengths, a prefill's tail beside a round's step: every layer's halves take all
    their tokens together, `layer_parts`)."""
    shapes = [tuple(tokens.shape) for tokens, _, _, _ in parts]
    views, ropes, masks = [], [], []
    for tokens, positions, kv_len, start in parts:
        positions = positions.clamp(max=cache.max_len - 1)
        cos, sin, mask = _rope_and_mask(w, positions, kv_len)
        views.append(cache.view(start, start + tokens.shape[0], positions, kv_len))
        ropes.append((cos, sin))
        masks.append(mask)
    cos, sin = (torch.cat([r[i].reshape(-1, w.head_dim) for r in ropes])[None, None] for i in (0, 1))
    x = torch.cat([embed(w, tokens).flatten(0, 1) for tokens, _, _, _ in parts])[None]  # [1, T, d]
    for index, layer in enumerate(w.layers):
        x = layer_parts(x, shapes, layer, views, index, cos, sin, masks, w.heads, w.kv_heads, w.head_dim, w.eps,
                        pre, post)
    x = rms_norm(x, w.norm, w.eps)[0]
    return [h.view(n, t, -1) for h, (n, t) in zip(x.split([n * t for n, t in shapes]), shapes)]


def prefill(w: LlamaWeights, cache: KVCache, tokens: torch.Tensor, start: int,
            layer_fn=layer_prefill) -> torch.Tensor:
    """Fill cache rows [start, start + n) with tokens [n, t] at positions 0..t-1 (right padding past a row's
    length writes slots that are masked until overwritten); returns the hidden states [n, t, d]."""
    n, t = tokens.shape
    positions = torch.arange(t, device=tokens.device)[None, :].expand(n, t)
    cos, sin, mask = _rope_and_mask(w, positions, t)
    kv = cache.view(start, start + n, positions.clamp(max=cache.max_len - 1), 0)
    x = embed(w, tokens)
    for index, layer in enumerate(w.layers):
        x = layer_fn(x, layer, kv, index, cos, sin, mask, w.heads, w.kv_heads, w.head_dim, w.eps)
    return rms_norm(x, w.norm, w.eps)
