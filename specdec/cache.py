"""KV caches for ragged speculative batches: dense rows, or a pool of blocks with a table per row.

A forward runs over a contiguous window of rows `[start, end)` with per-row positions `[rows, tokens]`: the cache's
`view(start, end, slots, kv_len)` says where each layer writes the new keys/values (`write`) and gives the window's
keys/values over slots `[0, kv_len)` to attend over (`read`). The slot of a token is its position, so every row
keeps its own length; rolling back rejected draft tokens is lowering a row's length in the engine: stale slots are
masked out and overwritten next round, nothing is recomputed. Rows leave by swap-remove (`move_row`), so the active
rows stay `[0, n)`. The buffers never move, which is what CUDA-graph capture needs (an engine keeps its caches
across `generate()` calls, specdec/runner.py).

- `RaggedKVCache` (dense): one `[rows, kv_heads, max_len, head_dim]` pair per layer; every row takes `max_len` slots.
- `PagedKVCache`: one pool `[blocks * BLOCK, kv_heads, head_dim]` pair per layer and a block table `[rows,
  max_len / BLOCK]` (a static tensor: captured steps read it); a row `reserve`s the blocks of every slot it can
  come to hold when it joins (its prompt, `max_new_tokens` and the draft's slack), so no row ever waits for a
  block mid-round, and `release`s them when it leaves. Table entries a row does not own point at block 0, a
  scratch block that padding writes into and that is always masked. Attention reads the window's blocks gathered
  into rows (SDPA over gathered blocks).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

BLOCK = 16  # slots per block of a paged cache


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


def blocks_for(slots: int) -> int:
    """Blocks of a paged cache that `slots` slots take."""
    return -(-slots // BLOCK)


class KVView:
    """One forward's access to a window of rows: `write(layer, k, v)` puts keys/values [n, t, kv_heads, head_dim]
    at the forward's slots; `read(layer)` gives the window's keys/values [n, kv_heads, kv_len, head_dim]."""

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        raise NotImplementedError

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class WholeRows:
    """Row bookkeeping of caches whose rows are allocated whole (dense rows, a tensor-parallel group's): a row takes
    nothing when it joins and gives nothing back when it leaves, and a copy is a move that keeps the source."""

    def reserve(self, row: int, slots: int) -> None:
        """Row `row` joins and may come to hold `slots` slots."""

    def release(self, row: int) -> None:
        """Row `row` leaves: what it holds is free."""

    def free_slots(self) -> int | None:
        """Slots rows joining now may reserve (None: no limit but the rows)."""
        return None

    def reservation(self, slots: int) -> int:
        """Slots a row that may hold `slots` slots takes from `free_slots`."""
        return slots

    def copy_row(self, src: int, dst: int, length: int) -> None:
        """Row dst (reserved) starts with row src's first `length` slots."""
        self.move_row(src, dst, length)


class KVCache(WholeRows, Cache):
    """What both layouts share: the rows, the slots a row can have, transformers' Cache API over `view`s, and (from
    `WholeRows`) the row bookkeeping a layout without blocks needs none of."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]

    def __init__(self, model, rows: int, max_len: int):
        super().__init__(layers=[])
        self.num_layers, self.kv_heads, self.head_dim = model_kv_shape(model)
        p = next(model.parameters())
        self.dtype, self.device = p.dtype, p.device
        self.rows = rows
        self.max_len = max_len
        self._view: KVView | None = None
        self._kv_len = 0

    def view(self, start: int, end: int, slots: torch.Tensor, kv_len: int) -> KVView:
        """Rows [start, end) write token t of row i at slot slots[i, t] and attend over slots [0, kv_len)."""
        raise NotImplementedError

    # -- set by the engine before each forward of transformers' own modules ---------------------------
    def prepare(self, start: int, end: int, positions: torch.Tensor, kv_len: int) -> None:
        """Next forward covers rows [start, end), writing token t of row i at slot positions[i, t]."""
        assert positions.shape[0] == end - start
        self._view = self.view(start, end, positions, kv_len)
        self._kv_len = kv_len

    # -- transformers Cache API -----------------------------------------------------------------
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # key_states: [n, kv_heads, t, head_dim]
        self._view.write(layer_idx, key_states.transpose(1, 2), value_states.transpose(1, 2))
        return self._view.read(layer_idx)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._kv_len

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.max_len

    def __len__(self) -> int:
        return self.num_layers

    @property
    def is_compileable(self) -> bool:
        return True

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in (*self.k, *self.v))


class _DenseView(KVView):
    def __init__(self, cache: RaggedKVCache, start: int, end: int, slots: torch.Tensor, kv_len: int):
        self.cache, self.start, self.end, self.slots, self.kv_len = cache, start, end, slots, kv_len
        self.rows = torch.arange(end - start, device=slots.device)[:, None]

    def write(self, layer, k, v):
        # advanced indices (rows, slots) around a slice put their dims first: [n, t, kv_heads, head_dim]
        self.cache.k[layer][self.start:self.end][self.rows, :, self.slots] = k.to(self.cache.dtype)
        self.cache.v[layer][self.start:self.end][self.rows, :, self.slots] = v.to(self.cache.dtype)

    def read(self, layer):
        return (self.cache.k[layer][self.start:self.end, :, :self.kv_len],
                self.cache.v[layer][self.start:self.end, :, :self.kv_len])


class RaggedKVCache(KVCache):
    """Dense rows: `[rows, kv_heads, max_len, head_dim]` per layer; the returned windows are views."""

    def __init__(self, model, rows: int, max_len: int):
        super().__init__(model, rows, max_len)
        shape = (rows, self.kv_heads, max_len, self.head_dim)
        self.k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self.v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]

    def view(self, start, end, slots, kv_len):
        return _DenseView(self, start, end, slots, kv_len)

    def read_slots(self, row: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots [lo, hi) of row `row` in every layer: keys, values [layers, kv_heads, hi - lo, head_dim]."""
        return (torch.stack([kc[row, :, lo:hi] for kc in self.k]), torch.stack([vc[row, :, lo:hi] for vc in self.v]))

    def write_slots(self, row: int, lo: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Slots [lo, lo + k.shape[2]) of row `row` take keys, values [layers, kv_heads, n, head_dim]."""
        hi = lo + k.shape[2]
        for layer, (kc, vc) in enumerate(zip(self.k, self.v)):
            kc[row, :, lo:hi] = k[layer]
            vc[row, :, lo:hi] = v[layer]

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


class _PagedView(KVView):
    def __init__(self, cache: PagedKVCache, start: int, end: int, slots: torch.Tensor, kv_len: int):
        self.cache = cache
        table = cache.table[start:end]
        self.at = cache.physical(table, slots)  # [n, t] pool slots written
        s = torch.arange(kv_len, device=slots.device)
        self.reads = cache.physical(table, s[None, :].expand(end - start, kv_len)) if kv_len else None

    def write(self, layer, k, v):
        self.cache.k[layer][self.at] = k.to(self.cache.dtype)  # [n, t, kv_heads, head_dim]
        self.cache.v[layer][self.at] = v.to(self.cache.dtype)

    def read(self, layer):
        return (self.cache.k[layer][self.reads].transpose(1, 2), self.cache.v[layer][self.reads].transpose(1, 2))


class PagedKVCache(KVCache):
    """A pool of `blocks` blocks of `BLOCK` slots per layer (block 0: scratch) and a block table per row."""

    def __init__(self, model, rows: int, max_len: int, blocks: int):
        super().__init__(model, rows, max_len)
        if blocks < 2:
            raise ValueError("a paged cache needs at least 2 blocks (one is scratch)")
        shape = (blocks * BLOCK, self.kv_heads, self.head_dim)
        self.k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self.v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self.blocks = blocks
        self.table = torch.zeros((rows, blocks_for(max_len)), dtype=torch.int64, device=self.device)
        self.owned: list[list[int]] = [[] for _ in range(rows)]  # host: each row's blocks, in slot order
        self.free = list(range(blocks - 1, 0, -1))  # host: free blocks (popped from the end)

    def physical(self, table: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Pool slots of logical `slots` [n, t] of the rows whose table rows are `table` [n, columns]."""
        return table.gather(1, slots // BLOCK) * BLOCK + slots % BLOCK

    def view(self, start, end, slots, kv_len):
        return _PagedView(self, start, end, slots, kv_len)

    def _row_slots(self, row: int, lo: int, hi: int) -> torch.Tensor:
        s = torch.arange(lo, hi, device=self.device)[None, :]
        return self.physical(self.table[row:row + 1], s)[0]

    def read_slots(self, row: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        at = self._row_slots(row, lo, hi)
        return (torch.stack([kc[at].transpose(0, 1) for kc in self.k]),
                torch.stack([vc[at].transpose(0, 1) for vc in self.v]))

    def write_slots(self, row: int, lo: int, k: torch.Tensor, v: torch.Tensor) -> None:
        at = self._row_slots(row, lo, lo + k.shape[2])
        for layer, (kc, vc) in enumerate(zip(self.k, self.v)):
            kc[at] = k[layer].transpose(0, 1)
            vc[at] = v[layer].transpose(0, 1)

    # -- blocks of rows ---------------------------------------------------------------------------
    def free_slots(self) -> int:
        return len(self.free) * BLOCK

    def reservation(self, slots: int) -> int:
        return blocks_for(min(slots, self.max_len)) * BLOCK

    def reserve(self, row: int, slots: int) -> None:
        need = self.reservation(slots) // BLOCK
        self.release(row)
        if need > len(self.free):
            raise RuntimeError(f"paged KV cache: row {row} needs {need} blocks, {len(self.free)} are free")
        self.owned[row] = [self.free.pop() for _ in range(need)]
        self._set(row)

    def release(self, row: int) -> None:
        if self.owned[row]:
            self.free.extend(reversed(self.owned[row]))
            self.owned[row] = []
            self.table[row] = 0

    def _set(self, row: int) -> None:
        entries = torch.zeros(self.table.shape[1], dtype=torch.int64)
        entries[: len(self.owned[row])] = torch.tensor(self.owned[row], dtype=torch.int64)
        self.table[row] = entries.to(self.device)

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Row dst (released) takes row src's blocks: a table row moves, no keys or values do."""
        if src == dst:
            return
        self.release(dst)
        self.owned[dst], self.owned[src] = self.owned[src], []
        self.table[dst] = self.table[src]
        self.table[src] = 0

    def copy_row(self, src: int, dst: int, length: int) -> None:
        if src != dst and length > 0:
            at_src, at_dst = self._row_slots(src, 0, length), self._row_slots(dst, 0, length)
            for buf in (*self.k, *self.v):
                buf[at_dst] = buf[at_src]

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        n = src.shape[0]
        table = self.table[:n]
        at_src, at_dst = self.physical(table, src), self.physical(table, dst)
        for buf in (*self.k, *self.v):
            buf[at_dst] = buf[at_src]  # [n, j, kv_heads, head_dim] gathered, then scattered

    def nbytes(self) -> int:
        return super().nbytes() + self.table.numel() * self.table.element_size()


def attention_mask(positions: torch.Tensor, kv_len: int) -> torch.Tensor:
    """Boolean 4-D mask [n, 1, t, kv_len]: a query at position p sees slots 0..p of its own row."""
    slots = torch.arange(kv_len, device=positions.device)
    return (slots[None, None, :] <= positions[:, :, None])[:, None]


def forward_hidden(model, cache: KVCache, input_ids: torch.Tensor, positions: torch.Tensor,
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
