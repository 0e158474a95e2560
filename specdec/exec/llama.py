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

from .cache import KVCache, put, side_by_side

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


@dataclass(frozen=True)
class Pieces:
    """What a forward runs between its attentions: `first` (layer 0's norm, q/k/v, RoPE and cache writes), `between`
    (a layer's o_proj, residual and MLP, then the next layer's `first`), `last` (the last layer's o_proj, residual,
    MLP and the final norm). `EAGER`'s, or compiled (specdec/exec/graphs.py): one compiled graph then spans an
    attention's output to the next attention's input, so a layer's residual add fuses with the next layer's norm
    and RoPE with the cache writes. The attention itself runs between them, eagerly (`_layers`)."""

    first: Callable
    between: Callable
    last: Callable
    # attend(q, keys, values, positions) -> [n, t, heads * hd]: the pieces' own causal attention over a window
    # (`_attend`'s, query j of row i seeing slots 0..positions[i, j]; None: `_attend` under the forward's mask)
    attend: Callable | None = None


def _first(x: torch.Tensor, layer: Layer, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
           head_dim: int, eps: float, keys: torch.Tensor, values: torch.Tensor, at: tuple) -> torch.Tensor:
    """Norm, fused q/k/v projection and RoPE of a layer's input x [n, t, d]; k and v written into the layer's `keys`
    and `values` at `at` (specdec/exec/cache.py's `put`). Returns q [n, heads, t, hd]."""
    q, k, v = _heads(F.linear(rms_norm(x, layer.ln1, eps), layer.qkv, layer.qkv_bias), cos, sin, heads, kv_heads,
                     head_dim)
    put(keys, values, at, k, v)
    return q


def _heads(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int, head_dim: int):
    """The fused projection's output [n, t, (heads + 2 kv_heads) hd] split into heads, RoPE applied: q [n, heads,
    t, hd] (contiguous: the attention groups its heads with a view, and compiled RoPE writes it so in its kernel),
    k and v [n, t, kv_heads, hd]."""
    n, t, _ = qkv.shape
    nh, nk, hd = heads, kv_heads, head_dim
    q, k, v = qkv.split([nh * hd, nk * hd, nk * hd], dim=-1)
    q = q.view(n, t, nh, hd).transpose(1, 2)
    k = k.view(n, t, nk, hd).transpose(1, 2)
    q = (q * cos + _rotate_half(q) * sin).contiguous()
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


def _between(x: torch.Tensor, o: torch.Tensor, layer: Layer, following: Layer, cos: torch.Tensor, sin: torch.Tensor,
             heads: int, kv_heads: int, head_dim: int, eps: float, keys: torch.Tensor, values: torch.Tensor,
             at: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """`layer`'s output from its attention's o, then the `following` layer's `_first` over it: (x, q)."""
    x = _layer_out(x, layer, o, eps)
    return x, _first(x, following, cos, sin, heads, kv_heads, head_dim, eps, keys, values, at)


def _last(x: torch.Tensor, o: torch.Tensor, layer: Layer, norm: torch.Tensor, eps: float) -> torch.Tensor:
    """The last layer's output from its attention's o, after the final norm."""
    return rms_norm(_layer_out(x, layer, o, eps), norm, eps)


EAGER = Pieces(_first, _between, _last)


def _layers(w: LlamaWeights, x: torch.Tensor, pieces: Pieces, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
            at: tuple, attend: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """x [n, t, d] through every layer, then the final norm: `pieces` between the attentions, each layer's keys and
    values written at `at` of its cache tensors, attend(index, q) the layer's attention output [n, t, heads * hd]."""
    dims = (cos, sin, w.heads, w.kv_heads, w.head_dim, w.eps)
    layers, k, v = w.layers, cache.k, cache.v
    q = pieces.first(x, layers[0], *dims, k[0], v[0], at)
    for i in range(len(layers) - 1):
        x, q = pieces.between(x, attend(i, q), layers[i], layers[i + 1], *dims, k[i + 1], v[i + 1], at)
    return pieces.last(x, attend(len(layers) - 1, q), layers[-1], w.norm, w.eps)


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
            pieces: Pieces = EAGER, slots: torch.Tensor | None = None, mask: torch.Tensor | None = None,
            start: int = 0, attend: bool = False) -> torch.Tensor:
    """Hidden states [n, t, d] after the final norm, for cache rows [start, start + n).

    Token j of row i is written at slot positions[i, j] (clamped into the cache's rows) and attends to slots
    0..positions[i, j] of its row, among the first `kv_len` slots. Shapes depend only on (n, t, kv_len). `pieces` run
    between the attentions (`EAGER`, or compiled: every layer has the same shapes, so one compiled function serves them
    all), and the attention where they have their own (`Pieces.attend`) and the cache's view does not. A token tree
    (specdec/spec/trees.py) gives the `slots` its tokens are written at (default: their positions) and its own `mask`
    [n, 1, t, >= kv_len]. `attend`: the cache's own attention where it has one (a captured step's: `KVCache.view`), for
    chains.
    """
    n = tokens.shape[0]
    positions = positions.clamp(max=cache.max_len - 1)
    own = attend and slots is None and mask is None  # the queries sit at the slots they write
    kv = cache.view(start, start + n, positions if slots is None else slots.clamp(max=cache.max_len - 1), kv_len,
                    attend=own)
    causal_own = pieces.attend if slots is None and mask is None and not kv.attends else None
    cos, sin, causal = _rope_and_mask(w, positions, None if kv.attends or causal_own else kv_len)  # (their own masks)
    if mask is not None:
        causal = sdpa_mask(mask[..., :kv_len].repeat(1, 1, w.heads // w.kv_heads, 1), w.cos.dtype)

    def attention(index: int, q: torch.Tensor) -> torch.Tensor:
        if kv.attends:
            return kv.attend(index, q)
        if causal_own is not None:
            return causal_own(q, *kv.read(index), positions)
        return _attend(q, *kv.read(index), causal)

    return _layers(w, embed(w, tokens), pieces, cos, sin, cache, kv.at, attention)


def forward_parts(w: LlamaWeights, cache: KVCache, parts: list[tuple[torch.Tensor, torch.Tensor, int, int]],
                  pieces: Pieces = EAGER) -> list[torch.Tensor]:
    """`forward` over several windows of cache rows in one pass over the weights: parts (tokens [n_i, t_i],
    positions [n_i, t_i], kv_len, start) -> hidden states [n_i, t_i, d] after the final norm, each as `forward`
    gives it (rows at different lengths, a prefill's tail beside a round's step). The pieces between the attentions
    take every window's tokens side by side, [1, T, d] (each weight read once); the attention runs per window (its
    view and mask)."""
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

    def attention(index: int, q: torch.Tensor) -> torch.Tensor:  # q [1, heads, T, hd]
        outs, at = [], 0
        for (n, t), kv, mask in zip(shapes, views, masks):
            qi = q[0, :, at:at + n * t].view(w.heads, n, t, w.head_dim).transpose(0, 1)
            outs.append(_attend(qi, *kv.read(index), mask).reshape(n * t, w.heads * w.head_dim))
            at += n * t
        return torch.cat(outs)[None]

    x = _layers(w, x, pieces, cos, sin, cache, side_by_side(views, shapes), attention)[0]
    return [h.view(n, t, -1) for h, (n, t) in zip(x.split([n * t for n, t in shapes]), shapes)]


def prefill(w: LlamaWeights, cache: KVCache, tokens: torch.Tensor, start: int, pieces: Pieces = EAGER) -> torch.Tensor:
    """Fill cache rows [start, start + n) with tokens [n, t] at positions 0..t-1 (right padding past a row's
    length writes slots that are masked until overwritten); returns the hidden states [n, t, d] after the final
    norm. Each layer attends over the slots it has just written."""
    n, t = tokens.shape
    positions = torch.arange(t, device=tokens.device)[None, :].expand(n, t)
    return forward(w, cache, tokens, positions, t, pieces, start=start)
