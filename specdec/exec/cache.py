"""KV caches for ragged speculative batches: dense rows, or a pool of blocks with a table per row.

A forward runs over a contiguous window of rows `[start, end)` with per-row positions `[rows, tokens]`: the cache's
`view(start, end, slots, kv_len)` says where each layer writes the new keys/values (`at`, an index into a layer's
`k`/`v` that `put` writes at: inside the lean forward's compiled pieces, specdec/exec/llama.py) and gives the
window's keys/values over slots `[0, kv_len)` to attend over (`read`). The slot of a token is its position, so every row
keeps its own length; rolling back rejected draft tokens is lowering a row's length in the engine: stale slots are
masked out and overwritten next round, nothing is recomputed. Rows leave by swap-remove (`move_row`), so the active
rows stay `[0, n)`. The buffers never move, which is what CUDA-graph capture needs (an engine keeps its caches
across `generate()` calls, specdec/exec/runner.py).

Every layer's keys (values) lie in one tensor, `keys` (`values`) [layers, ...], whose layer i is `k[i]` (`v[i]`): a
row's move, a prompt's sample, a tree's kept path and the prefix store's reads and writes copy every layer at once.

- `RaggedKVCache` (dense): `[rows, kv_heads, max_len, head_dim]` per layer; every row takes `max_len` slots.
- `PagedKVCache`: a pool `[blocks * block, kv_heads, head_dim]` per layer (`block`: `BLOCK` slots unless
  built with another size) and a block table `[rows, max_len / block]` (a static tensor: captured steps read it); a
  row `reserve`s the blocks of every slot it can come to hold when it joins (its prompt, `max_new_tokens` and the
  draft's slack), so no row ever waits for a block mid-round, and `release`s them when it leaves. Table entries a
  row does not own point at block 0, a scratch block that padding writes into and that is always masked. Attention
  reads the window's blocks gathered into rows (SDPA over gathered blocks), or in captured steps with `flex`
  attends over the pool in place (`_FlexView`). Whole blocks of slots no row writes again (a prompt's cached prefix)
  are shared by reference: a block counts its holders (rows, and the prefix store, specdec/exec/prefix.py, that
  `pin`s it) and is free when none is left; a prompt's samples (`copy_row`) and rows whose prefix the store holds
  take such blocks instead of copies, and a row reserves only the blocks it writes.
"""

from __future__ import annotations

from collections.abc import Callable

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


def blocks_for(slots: int, block: int = BLOCK) -> int:
    """Blocks of `block` slots (a paged cache's) that `slots` slots take."""
    return -(-slots // block)


def put(keys: torch.Tensor, values: torch.Tensor, at: tuple, k: torch.Tensor, v: torch.Tensor) -> None:
    """Keys and values [n, t, kv_heads, head_dim] into one layer's `keys` and `values` at index `at` (a view's)."""
    keys[at] = k.to(keys.dtype)
    values[at] = v.to(values.dtype)


def side_by_side(views: list[KVView], shapes: list[tuple[int, int]]) -> tuple:
    """One index for several views' slots (n_i x t_i tokens each, `shapes`), their tokens side by side: [1, T]."""
    flat = [[i.expand(n, t).reshape(-1) if isinstance(i, torch.Tensor) else i for i in view.at]
            for view, (n, t) in zip(views, shapes)]
    return tuple(torch.cat(c)[None] if isinstance(c[0], torch.Tensor) else c[0] for c in zip(*flat))


class KVView:
    """One forward's access to a window of rows: `at` indexes the forward's slots in a layer's keys/values (`k[layer]`,
    `v[layer]`) as keys/values [n, t, kv_heads, head_dim] lie (`put`, `write`); `read(layer)` gives the window's
    keys/values [n, kv_heads, kv_len, head_dim]. A view that attends over the cache itself (`attends`) gives
    `attend(layer, q)` instead of `read`."""

    attends = False
    cache: KVCache
    at: tuple

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        put(self.cache.k[layer], self.cache.v[layer], self.at, k, v)

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Attention of q [n, heads, t, hd] (at the forward's slots, causal) -> [n, t, heads * hd]."""
        raise NotImplementedError


class WholeRows:
    """Row bookkeeping of caches whose rows are allocated whole (dense rows, a tensor-parallel group's): a row takes
    nothing when it joins and gives nothing back when it leaves, and a copy is a move that keeps the source."""

    def reserve(self, row: int, slots: int) -> None:
        """Row `row` joins and may come to hold `slots` slots."""

    def reserve_rows(self, rows: list[int], slots: list[int], prompts: list[list[int]] | None = None) -> None:
        """Rows `rows` join, row rows[i] to hold up to slots[i] slots (`prompts`: their tokens)."""
        for row, n in zip(rows, slots):
            self.reserve(row, n)

    def release(self, row: int) -> None:
        """Row `row` leaves: what it holds is free."""

    def free_slots(self) -> int | None:
        """Slots rows joining now may reserve (None: no limit but the rows)."""
        return None

    def reservation(self, slots: int, prompt: list[int] | None = None) -> int:
        """Slots a row that may hold `slots` slots (`prompt`: its tokens) takes from `free_slots`."""
        return slots

    def held_slots(self, row: int) -> int:
        """Slots of row `row` it holds by reference from its first (written by others; it writes none of them)."""
        return 0

    def copy_row(self, src: int, dst: int, length: int) -> None:
        """Row dst (reserved) starts with row src's first `length` slots."""
        self.move_row(src, dst, length)


class KVCache(WholeRows, Cache):
    """What both layouts share: the rows, the slots a row can have, transformers' Cache API over `view`s, and (from
    `WholeRows`) the row bookkeeping a layout without blocks needs none of."""

    keys: torch.Tensor  # [layers, *layer_shape]
    values: torch.Tensor
    k: list[torch.Tensor]  # layer i's keys: a view of keys[i]
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

    def _allocate(self, layer_shape: tuple[int, ...]) -> None:
        """`keys` and `values` of every layer (zeros), and each layer's views of them (`k`, `v`)."""
        shape = (self.num_layers, *layer_shape)
        self.keys, self.values = (torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(2))
        self.k, self.v = list(self.keys.unbind(0)), list(self.values.unbind(0))

    def view(self, start: int, end: int, slots: torch.Tensor, kv_len: int, attend: bool = False) -> KVView:
        """Rows [start, end) write token t of row i at slot slots[i, t] and attend over slots [0, kv_len); `attend`:
        a view that attends itself where the cache has one (a captured step's)."""
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
        return 2 * self.keys.numel() * self.keys.element_size()


class _DenseView(KVView):
    def __init__(self, cache: RaggedKVCache, start: int, end: int, slots: torch.Tensor, kv_len: int):
        self.cache, self.start, self.end, self.kv_len = cache, start, end, kv_len
        # advanced indices (rows, slots) around a slice put their dims first: [n, t, kv_heads, head_dim]
        self.at = (torch.arange(start, end, device=slots.device)[:, None], slice(None), slots)

    def read(self, layer):
        return (self.cache.k[layer][self.start:self.end, :, :self.kv_len],
                self.cache.v[layer][self.start:self.end, :, :self.kv_len])


class RaggedKVCache(KVCache):
    """Dense rows: `[rows, kv_heads, max_len, head_dim]` per layer; the returned windows are views."""

    def __init__(self, model, rows: int, max_len: int):
        super().__init__(model, rows, max_len)
        self._allocate((rows, self.kv_heads, max_len, self.head_dim))

    def view(self, start, end, slots, kv_len, attend: bool = False):
        return _DenseView(self, start, end, slots, kv_len)

    def read_slots(self, row: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots [lo, hi) of row `row` in every layer: keys, values [layers, kv_heads, hi - lo, head_dim] (views of
        the cache: read them before those slots are written again)."""
        return self.keys[:, row, :, lo:hi], self.values[:, row, :, lo:hi]

    def write_slots(self, row: int, lo: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Slots [lo, lo + k.shape[2]) of row `row` take keys, values [layers, kv_heads, n, head_dim]."""
        hi = lo + k.shape[2]
        self.keys[:, row, :, lo:hi] = k
        self.values[:, row, :, lo:hi] = v

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy row src's first `length` slots into row dst (swap-remove compaction)."""
        if src != dst and length > 0:
            for buf in (self.keys, self.values):
                buf[:, dst, :, :length] = buf[:, src, :, :length]

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """For rows [0, n): slot dst[i, j] takes what slot src[i, j] holds ([n, j] index tensors; every source is
        read before any destination is written). Keeps a token tree's accepted path (specdec/spec/trees.py)."""
        n, j = src.shape
        rows = torch.arange(n, device=src.device)[:, None]
        for buf in (self.keys, self.values):
            buf[:, rows, :, dst] = buf[:, rows, :, src]  # [n, j, layers, kv_heads, head_dim] gathered, then scattered


class _PagedView(KVView):
    def __init__(self, cache: PagedKVCache, start: int, end: int, slots: torch.Tensor, kv_len: int):
        self.cache = cache
        table = cache.table[start:end]
        self.at = (cache.physical(table, slots),)  # [n, t] pool slots written
        s = torch.arange(kv_len, device=slots.device)
        self.reads = cache.physical(table, s[None, :].expand(end - start, kv_len)) if kv_len else None

    def read(self, layer):
        return (self.cache.k[layer][self.reads].transpose(1, 2), self.cache.v[layer][self.reads].transpose(1, 2))


class _FlexView(_PagedView):
    """A paged view that attends with FlexAttention over the pool in place (no gathered copy of the rows' blocks).
    A row visits the blocks of its table up to its last query's position, where a slot is seen if its place in the
    row (its block's column in the table) is at most the query's position. `positions` [n, t] are the queries' (the
    slots a step writes, for chains; increasing along a row).

    How the kernels want it (`splits`: None, on CUDA): CUDA's kernel for short queries splits each row's blocks
    across programs as the batch's rows leave room for, and only its masked blocks (with whole ones it tiles the
    pool), so there a step keeps its rows and every block it visits is masked. A CPU's kernel for one query
    compiles only with whole blocks: there the blocks below a row's first query are visited whole (no mask), and
    the queries are padded to every row of the cache (a padded row visits no block), so that its shapes depend on
    the queries' width and the pool only: one compilation per model and width."""

    attends = True
    splits: bool | None = None  # CUDA's way (True) or a CPU's (False); None: by the device

    def __init__(self, cache: PagedKVCache, start: int, end: int, positions: torch.Tensor, kv_len: int):
        from torch.nn.attention.flex_attention import BlockMask

        super().__init__(cache, start, end, positions, 0)
        n, t = positions.shape
        dev, pool, block = positions.device, cache.blocks, cache.block
        splits = dev.type == "cuda" if self.splits is None else self.splits
        rows = n if splits else cache.table.shape[0]
        columns = min(blocks_for(kv_len, block), cache.table.shape[1], pool)  # a row holds fewer blocks than the pool
        table = cache.table[start:end, :columns]
        place = torch.full((rows, pool), -1, dtype=torch.int64, device=dev)  # each block's column in a row's table
        place[:n].scatter_(1, table, torch.arange(columns, device=dev).expand(n, columns).contiguous())
        at = torch.nn.functional.pad(positions, (0, 0, 0, rows - n))
        ends = (positions[:, -1] // block + 1).clamp(max=columns)  # the columns a row's queries see
        kinds = 1 if splits else 2  # masked blocks, and (a CPU's) whole ones
        counts = torch.zeros((kinds, rows, 1, 1), dtype=torch.int32, device=dev)  # the blocks a row visits
        blocks = torch.zeros((kinds, rows, 1, 1, pool), dtype=torch.int32, device=dev)  # which
        if splits:
            counts[0, :n, 0, 0], blocks[0, :n, 0, 0, :columns] = ends, table
        else:  # those every query of a row sees whole, then the rest through the mask
            whole = ((positions[:, 0] + 1) // block).clamp(max=columns)
            after = (whole[:, None] + torch.arange(columns, device=dev)).clamp(max=columns - 1)
            counts[0, :n, 0, 0], counts[1, :n, 0, 0] = ends - whole, whole
            blocks[0, :n, 0, 0, :columns], blocks[1, :n, 0, 0, :columns] = table.gather(1, after), table

        def seen(b, h, q, kv):
            column = place[b, kv // block]
            return (column >= 0) & (column * block + kv % block <= at[b, q])

        whole_blocks = () if splits else (counts[1], blocks[1])
        self.mask = BlockMask.from_kv_blocks(counts[0], blocks[0], *whole_blocks, BLOCK_SIZE=(128, block),
                                             mask_mod=seen, seq_lengths=(t, pool * block), compute_q_blocks=False)
        # CUDA's flex kernels want their key tile to divide a block (their own tiles divide one of 128 slots)
        self.options = {"BLOCK_N": block} if dev.type == "cuda" and block < 128 else None

    def attend(self, layer, q):
        n, heads, t, hd = q.shape
        queries = q.new_zeros((self.mask.kv_num_blocks.shape[0], heads, t, hd))  # contiguous: one layout
        queries[:n] = q
        k, v = (c[layer].permute(1, 0, 2)[None] for c in (self.cache.k, self.cache.v))  # [1, kv_heads, slots, hd]
        o = self.cache.flex(queries, k.to(q.dtype), v.to(q.dtype), block_mask=self.mask, enable_gqa=True,
                            scale=hd ** -0.5, kernel_options=self.options)
        return o[:n].transpose(1, 2).reshape(n, t, heads * hd)


class PagedKVCache(KVCache):
    """A pool of `blocks` blocks of `block` slots per layer (block 0: scratch) and a block table per row. A block
    counts its holders: the rows whose table points at it, and the prefix store (`pin`); it is free when none is
    left. A row writes only the blocks after the ones it holds by reference (`held_slots`)."""

    def __init__(self, model, rows: int, max_len: int, blocks: int, block: int = BLOCK):
        super().__init__(model, rows, max_len)
        self.block = block
        if blocks < 2:
            raise ValueError("a paged cache needs at least 2 blocks (one is scratch)")
        self._allocate((blocks * block, self.kv_heads, self.head_dim))
        self.blocks = blocks
        self.table = torch.zeros((rows, blocks_for(max_len, block)), dtype=torch.int64, device=self.device)
        self.owned: list[list[int]] = [[] for _ in range(rows)]  # host: each row's blocks, in slot order
        self.shared = [0] * rows  # host: how many of a row's first blocks it holds by reference
        self.refs = [0] * blocks  # host: each block's holders
        self.free = list(range(blocks - 1, 0, -1))  # host: free blocks (popped from the end)
        self.prefix = None  # the prefix store whose pinned blocks joining rows share or reclaim (PrefixStore.attach)
        # what captured steps attend with: compiled FlexAttention over the pool in place (graphs.compiled_flex,
        # `_FlexView`), or None: SDPA over the rows' gathered blocks
        self.flex: Callable | None = None

    def physical(self, table: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Pool slots of logical `slots` [n, t] of the rows whose table rows are `table` [n, columns]."""
        return table.gather(1, slots // self.block) * self.block + slots % self.block

    def view(self, start, end, slots, kv_len, attend: bool = False):
        """`attend`: a view that attends with FlexAttention over the pool where the cache has it (`flex`; `slots` are
        then the queries' positions), else one that gathers the rows' blocks for `read`."""
        if attend and self.flex is not None:
            return _FlexView(self, start, end, slots, kv_len)
        return _PagedView(self, start, end, slots, kv_len)

    def _row_slots(self, row: int, lo: int, hi: int) -> torch.Tensor:
        s = torch.arange(lo, hi, device=self.device)[None, :]
        return self.physical(self.table[row:row + 1], s)[0]

    def read_slots(self, row: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        at = self._row_slots(row, lo, hi)
        return self.keys[:, at].transpose(1, 2), self.values[:, at].transpose(1, 2)

    def write_slots(self, row: int, lo: int, k: torch.Tensor, v: torch.Tensor) -> None:
        at = self._row_slots(row, lo, lo + k.shape[2])
        self.keys[:, at] = k.transpose(1, 2)
        self.values[:, at] = v.transpose(1, 2)

    # -- blocks of rows ---------------------------------------------------------------------------
    def free_slots(self) -> int:
        """Free blocks' slots, and those of blocks only the prefix store holds (rows reclaim them)."""
        return (len(self.free) + (self.prefix.idle_blocks() if self.prefix is not None else 0)) * self.block

    def _lookup(self, prompt: list[int] | None) -> list[int]:
        """The blocks the prefix store holds of a joining row's prompt (none without a store or a prompt)."""
        return [] if self.prefix is None or prompt is None else self.prefix.lookup(prompt)

    def reservation(self, slots: int, prompt: list[int] | None = None) -> int:
        """A row's own blocks' slots, and those of the blocks it shares that only the store holds now (they stop
        being reclaimable; counted for each row that shares them, which can only over-count)."""
        shared = self._lookup(prompt)
        idle = sum(self.refs[b] == 1 for b in shared)
        return (blocks_for(min(slots, self.max_len), self.block) - len(shared) + idle) * self.block

    def reserve(self, row: int, slots: int) -> None:
        self.reserve_rows([row], [slots])

    def reserve_rows(self, rows: list[int], slots: list[int], prompts: list[list[int]] | None = None) -> None:
        """Each row first takes the blocks the prefix store holds of its prompt (so that no row's reservation
        reclaims them), then blocks of its own for the rest of its slots."""
        prompts = prompts or [None] * len(rows)
        for row, prompt in zip(rows, prompts):
            self.release(row)
            self._adopt(row, self._lookup(prompt))
        for row, n in zip(rows, slots):
            need = blocks_for(min(n, self.max_len), self.block) - len(self.owned[row])
            if need > len(self.free) and self.prefix is not None:
                self.prefix.reclaim(need - len(self.free))
            if need > len(self.free):
                raise RuntimeError(f"paged KV cache: row {row} needs {need} blocks, {len(self.free)} are free")
            for _ in range(need):
                block = self.free.pop()
                self.refs[block] = 1
                self.owned[row].append(block)
            self._set(row)

    def release(self, row: int) -> None:
        if self.owned[row]:
            for block in reversed(self.owned[row]):
                self.unpin(block)
            self.owned[row], self.shared[row] = [], 0
            self.table[row] = 0

    def held_slots(self, row: int) -> int:
        return self.shared[row] * self.block

    def pin(self, block: int) -> None:
        """One more holder of `block` (the prefix store keeps it)."""
        self.refs[block] += 1

    def unpin(self, block: int) -> None:
        """One holder fewer: a block none holds is free."""
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.free.append(block)

    def adopt(self, row: int, blocks: list[int]) -> None:
        """Row `row`'s first blocks become `blocks` (whole blocks of its prompt that others hold: its own ones for
        those slots are given back); from now on it writes none of them."""
        self._adopt(row, blocks)
        self._set(row)

    def _adopt(self, row: int, blocks: list[int]) -> None:
        owned = self.owned[row]
        for j, block in enumerate(blocks):
            if j < len(owned) and owned[j] == block:
                continue
            self.pin(block)
            if j < len(owned):
                self.unpin(owned[j])
                owned[j] = block
            else:
                owned.append(block)
        self.shared[row] = max(self.shared[row], len(blocks))

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
        self.shared[dst], self.shared[src] = self.shared[src], 0
        self.table[dst] = self.table[src]
        self.table[src] = 0

    def copy_row(self, src: int, dst: int, length: int) -> None:
        """Row dst (reserved) shares row src's whole blocks among its first `length` slots (neither writes them
        again) and copies the slots of the last, partial one."""
        if src == dst or length <= 0:
            return
        whole = length // self.block
        self.adopt(dst, self.owned[src][:whole])
        lo = self.shared[dst] * self.block
        if lo < length:
            at_src, at_dst = self._row_slots(src, lo, length), self._row_slots(dst, lo, length)
            for buf in (self.keys, self.values):
                buf[:, at_dst] = buf[:, at_src]

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        n = src.shape[0]
        table = self.table[:n]
        at_src, at_dst = self.physical(table, src), self.physical(table, dst)
        for buf in (self.keys, self.values):
            buf[:, at_dst] = buf[:, at_src]  # [layers, n, j, kv_heads, head_dim] gathered, then scattered

    def nbytes(self) -> int:
        return super().nbytes() + self.table.numel() * self.table.element_size()

    def block_bytes(self) -> int:
        """Bytes one block takes in every layer (keys and values)."""
        return 2 * self.num_layers * self.block * self.kv_heads * self.head_dim * self.k[0].element_size()


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
    they are ever read. Positions are clamped into the buffer. A token tree (specdec/spec/trees.py) gives the
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
