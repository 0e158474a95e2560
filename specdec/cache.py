"""KV cache for ragged speculative batches.

Static per-row buffers, one `[rows, kv_heads, max_len, head_dim]` pair per layer: the slot of a token
is its position, so every row keeps its own length. A forward runs over a contiguous window of rows
`[start, end)` with per-row positions `[rows, tokens]`; `update()` scatters the new keys/values at
those positions and returns the window's buffers up to `kv_len`. Rolling back rejected draft tokens is
lowering a row's length in the engine: stale slots are masked out and overwritten next round, nothing
is recomputed. Rows leave by swap-remove (`move_row`), so the active rows stay `[0, n)` and the
returned buffers stay views. The buffers never move, which is what CUDA-graph capture needs (an engine
keeps its caches across `generate()` calls, specdec/runner.py).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache


def model_kv_shape(model) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a decoder-only transformers model."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers, kv_heads, head_dim


def model_kv_bytes(model) -> int:
    """Bytes of keys and values one token takes in a model's cache (every layer)."""
    layers, kv_heads, head_dim = model_kv_shape(model)
    return 2 * layers * kv_heads * head_dim * next(model.parameters()).element_size()


class RaggedKVCache(Cache):
    def __init__(self, model, rows: int, max_len: int):
        super().__init__(layers=[])
        layers, kv_heads, head_dim = model_kv_shape(model)
        p = next(model.parameters())
        shape = (rows, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in range(layers)]
        self.rows = rows
        self.max_len = max_len
        self.num_layers = layers
        self._start = 0
        self._end = 0
        self._rows: torch.Tensor | None = None  # [n, 1] row offsets inside the window
        self._pos: torch.Tensor | None = None  # [n, t] slots written by this forward
        self._kv_len = 0

    # -- set by the engine before each forward ------------------------------------------------
    def prepare(self, start: int, end: int, positions: torch.Tensor, kv_len: int) -> None:
        """Next forward covers rows [start, end), writing token t of row i at slot positions[i, t]."""
        assert positions.shape[0] == end - start
        self._start, self._end = start, end
        self._rows = torch.arange(end - start, device=positions.device)[:, None]
        self._pos = positions
        self._kv_len = kv_len

    # -- transformers Cache API -----------------------------------------------------------------
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # key_states: [n, kv_heads, t, head_dim]
        kb = self.k[layer_idx][self._start : self._end]  # [n, kv_heads, max_len, head_dim] (view)
        vb = self.v[layer_idx][self._start : self._end]
        # advanced indices (rows, pos) around a slice put their dims first: [n, t, kv_heads, head_dim]
        kb[self._rows, :, self._pos] = key_states.transpose(1, 2).to(kb.dtype)
        vb[self._rows, :, self._pos] = value_states.transpose(1, 2).to(vb.dtype)
        return kb[:, :, : self._kv_len], vb[:, :, : self._kv_len]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._kv_len

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.max_len

    def __len__(self) -> int:
        return self.num_layers

    @property
    def is_compileable(self) -> bool:
        return True

    # -- row management ---------------------------------------------------------------------------
    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy row src's first `length` slots into row dst (swap-remove compaction)."""
        if src != dst and length > 0:
            for buf in (*self.k, *self.v):
                buf[dst, :, :length] = buf[src, :, :length]

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """For rows [0, n): slot dst[i, j] takes what slot src[i, j] holds ([n, j] index tensors; every source is
        read before any destination is written). Keeps a token tree's accepted path (specdec/trees.py)."""
        n, j = src.shape
        rows = torch.arange(n, device=src.device)[:, None]
        for buf in (*self.k, *self.v):
            buf[rows, :, dst] = buf[rows, :, src]  # [n, j, kv_heads, head_dim] gathered, then scattered

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in (*self.k, *self.v))


def attention_mask(positions: torch.Tensor, kv_len: int) -> torch.Tensor:
    """Boolean 4-D mask [n, 1, t, kv_len]: a query at position p sees slots 0..p of its own row."""
    slots = torch.arange(kv_len, device=positions.device)
    return (slots[None, None, :] <= positions[:, :, None])[:, None]


def forward_hidden(model, cache: RaggedKVCache, input_ids: torch.Tensor, positions: torch.Tensor,
                   start: int, end: int, kv_len: int, slots: torch.Tensor | None = None,
                   mask: torch.Tensor | None = None) -> torch.Tensor:
    """Run the decoder body over rows [start, end) of `cache`; returns last hidden states [n, t, d].

    `kv_len` > every position (the caller knows the rows' lengths). Padding tokens (beyond a row's real
    input) get positions past its length; they write slots that are masked now and overwritten before
    they are ever read. Positions are clamped into the buffer. A token tree (specdec/trees.py) gives the
    `slots` its tokens are written at (default: their positions) and its `mask` [n, 1, t, kv_len].
    """
    positions = positions.clamp(max=cache.max_len - 1)
    kv_len = min(kv_len, cache.max_len)
    cache.prepare(start, end, positions if slots is None else slots.clamp(max=cache.max_len - 1), kv_len)
    out = model.get_decoder()(
        input_ids=input_ids,
        position_ids=positions,
        attention_mask=attention_mask(positions, kv_len) if mask is None else mask[..., :kv_len],
        past_key_values=cache,
        use_cache=True,
    )
    return out.last_hidden_state
