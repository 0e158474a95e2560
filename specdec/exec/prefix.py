"""Prefix caching: the keys and values of prompt prefixes a worker has computed, reused by later rows.

A model's prefix store keeps blocks of `block` prompt tokens. A block is keyed by a hash chain (its parent's key
and its own tokens), so a key stands for the whole prefix up to the block's end; the tokens are kept too and
compared on a match, so a hash collision costs a miss, never a wrong token. A row's match is the longest run of
stored blocks from its first token, within the tokens its prefill would cache; the row's cache rows take those
slots by copy and only the rest of its prompt is computed (`ModelRunner.prefill(offsets=)`). A target's block also
keeps the model's most likely next ids at its positions when its prefill computed them (alignment sampling,
specdec/spec/proposers/prompt_lookup.py); a row that needs them matches only blocks that have them. The store is kept by
the engine across `generate()` calls, bounded in bytes and evicted least recently used, deepest blocks first (a
prefix's first blocks serve every row that shares any of it).

Over a paged cache (specdec/exec/cache.py) the store keeps no copies: a stored block is the pool block the row that
computed it wrote, pinned there (`attach`); rows whose prompt begins with stored blocks hold those blocks by reference
from the time they join (`lookup`), and reserve only the blocks they write. A pinned block that no row holds is
reclaimed, least recently used first, when joining rows need blocks (`reclaim`); one that rows hold is never evicted
(it would free nothing).

Keys and values at a position depend only on the tokens up to it, so a reused block holds what a prefill would
compute, up to the rounding of a different batch shape.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .cache import KVCache, PagedKVCache


@dataclass
class Block:
    tokens: tuple[int, ...]
    parent: int | None  # the previous block's key (None: the prompt's first block)
    k: torch.Tensor | None  # [layers, kv_heads, block, head_dim] (None: a paged cache's pool block holds them)
    v: torch.Tensor | None
    top: np.ndarray | None = None  # [block, ids] the model's most likely next ids at its positions
    pool: int | None = None  # the pool block that holds its keys and values (paged)
    pool_bytes: int = 0  # that block's bytes

    @property
    def nbytes(self) -> int:
        kv = self.pool_bytes if self.k is None else 2 * self.k.numel() * self.k.element_size()
        return kv + (0 if self.top is None else self.top.nbytes)


class PrefixStore:
    """One model's stored prefix blocks (see the module's docstring), at most `budget` bytes of them."""

    def __init__(self, budget: int, block: int = 16):
        if block < 1:
            raise ValueError("a prefix block has at least one token")
        self.budget = budget
        self.block = block
        self.blocks: OrderedDict[int, Block] = OrderedDict()  # least recently used first
        self.nbytes = 0
        self.pool: PagedKVCache | None = None  # the paged cache whose blocks the store pins (`attach`)
        self.joining_top_ids = 0  # the most likely ids a joining row's shared blocks must keep (`lookup`)

    def attach(self, cache: KVCache, top_ids: int = 0) -> None:
        """The cache the store's rows live in: over a paged one the store pins its pool's blocks instead of keeping
        copies (what it kept of another cache is dropped), and rows joining it share what `lookup` finds, blocks
        with at least `top_ids` most likely ids."""
        pool = cache if isinstance(cache, PagedKVCache) else None
        if pool is not self.pool:
            self.clear()
            self.pool = pool
        if pool is not None:
            pool.prefix = self
        self.joining_top_ids = top_ids

    @property
    def device_bytes(self) -> int:
        """Bytes the store takes besides the caches (none over a paged cache: its blocks are the pool's)."""
        return 0 if self.pool is not None else self.nbytes

    def lookup(self, tokens: Sequence[int]) -> list[int]:
        """The pool blocks of the stored blocks that begin a joining row's prompt `tokens`, within what its prefill
        caches (all but the last token)."""
        return [self.blocks[key].pool for key in self.match(tokens, len(tokens) - 1, self.joining_top_ids, touch=False)]

    def idle_blocks(self) -> int:
        """Pinned pool blocks no row holds: free for rows that need them (`reclaim`)."""
        return sum(self.pool.refs[b.pool] == 1 for b in self.blocks.values())

    def reclaim(self, blocks: int) -> None:
        """Give the pool back up to `blocks` pinned blocks no row holds, least recently used first."""
        for key in [key for key, b in self.blocks.items() if self.pool.refs[b.pool] == 1][:blocks]:
            self._drop(key)

    def _in_use(self, block: Block) -> bool:
        return block.pool is not None and self.pool.refs[block.pool] > 1

    def _drop(self, key: int) -> None:
        block = self.blocks.pop(key)
        self.nbytes -= block.nbytes
        if block.pool is not None:
            self.pool.unpin(block.pool)

    def _key(self, parent: int | None, tokens: tuple[int, ...]) -> int:
        return block_key(parent, tokens)

    def chain(self, tokens: Sequence[int], limit: int) -> list[tuple[int, tuple[int, ...], int | None]]:
        """(key, tokens, parent key) of each full block in the first `limit` tokens, in order."""
        return chain(tokens, limit, self.block, self._key)

    def match(self, tokens: Sequence[int], limit: int, top_ids: int = 0, touch: bool = True) -> list[int]:
        """Keys of the stored blocks that begin `tokens`, as many as fit in its first `limit` tokens (with `top_ids`:
        blocks that keep at least that many most likely ids). With `touch`, they become the most recently used, the
        first blocks last (evicted after the blocks that follow them)."""
        keys: list[int] = []
        for key, chunk, parent in iter_chain(tokens, limit, self.block, self._key):
            found = self.blocks.get(key)
            if found is None or found.tokens != chunk or found.parent != parent:
                break
            if top_ids and (found.top is None or found.top.shape[1] < top_ids):
                break
            keys.append(key)
        for key in reversed(keys if touch else []):
            self.blocks.move_to_end(key)
        return keys

    def followers(self, prompts: list[Sequence[int]], limits: list[int]) -> list[bool]:
        """For rows about to be prefilled together: whether each would find more of its prefix stored once the rows
        before it that it is not flagged for are prefilled and stored (its first block not stored yet is one of
        theirs). Prefilling the others first, then these, computes a prefix they share once."""
        seen: set[int] = set()
        out = []
        for tokens, limit in zip(prompts, limits):
            fresh = [key for key, _, _ in self.chain(tokens, limit) if key not in self.blocks]
            follows = bool(fresh) and fresh[0] in seen
            if not follows:
                seen.update(fresh)
            out.append(follows)
        return out

    def load(self, cache: KVCache, row: int, keys: list[int]) -> int:
        """Write the blocks `keys` (a match) into slots [0, len(keys) * block) of cache row `row` (a paged cache's
        row takes the pool blocks themselves); returns that many tokens."""
        if not keys:
            return 0
        if self.pool is not None:
            self.pool.adopt(row, [self.blocks[key].pool for key in keys])
            return len(keys) * self.block
        k = torch.cat([self.blocks[key].k for key in keys], dim=2)  # [layers, kv_heads, n, head_dim]
        v = torch.cat([self.blocks[key].v for key in keys], dim=2)
        cache.write_slots(row, 0, k, v)
        return k.shape[2]

    def top_ids(self, keys: list[int], top_ids: int) -> np.ndarray:
        """The first `top_ids` most likely ids the blocks `keys` keep [len(keys) * block, top_ids]."""
        return np.concatenate([self.blocks[key].top[:, :top_ids] for key in keys])

    def store(self, cache: KVCache, row: int, tokens: Sequence[int],
              cached: int, top: np.ndarray | None = None) -> int:
        """Keep the full blocks among the first `cached` tokens of cache row `row` (holding `tokens`) that are not
        stored yet, evicting the least recently used beyond the budget; returns the blocks added. `top` [>= cached,
        ids]: the model's most likely ids at those positions, kept with the blocks (and given to stored blocks
        that keep fewer). A block larger than the whole budget is not kept."""
        added, keys = 0, []
        chain = self.chain(tokens, cached)
        new = [i for i, (key, _, _) in enumerate(chain) if key not in self.blocks]
        if new and self.pool is None:  # the row's slots from its first new block, one copy per layer, then a block each
            lo, hi = new[0] * self.block, len(chain) * self.block
            k, v = (kv.split(self.block, dim=2) for kv in cache.read_slots(row, lo, hi))
        for i, (key, chunk, parent) in enumerate(chain):
            have = self.blocks.get(key)
            if have is not None and (have.tokens != chunk or have.parent != parent):
                break  # a collision: the chain cannot go on through this key
            ids = None if top is None else np.array(top[i * self.block:(i + 1) * self.block])
            if have is None:
                if self.pool is None:
                    j = i - new[0]
                    block = Block(chunk, parent, k[j].clone(), v[j].clone(), ids)
                else:  # the row's own pool block: it writes no slot of it again
                    block = Block(chunk, parent, None, None, ids, self.pool.owned[row][i], self.pool.block_bytes())
                if block.nbytes > self.budget:
                    break
                if block.pool is not None:
                    self.pool.pin(block.pool)
                self.blocks[key] = block
                self.nbytes += block.nbytes
                added += 1
            elif ids is not None and (have.top is None or have.top.shape[1] < ids.shape[1]):
                self.nbytes += ids.nbytes - (0 if have.top is None else have.top.nbytes)
                have.top = ids
            keys.append(key)
        for key in reversed(keys):
            self.blocks.move_to_end(key)
        self._evict()
        return added

    def _evict(self) -> None:
        """Least recently used first, down to the budget; blocks rows hold stay (dropping them frees nothing)."""
        if self.nbytes <= self.budget:
            return
        for key in list(self.blocks):
            if self.nbytes <= self.budget:
                break
            if not self._in_use(self.blocks[key]):
                self._drop(key)

    def clear(self) -> None:
        for key in list(self.blocks):
            self._drop(key)


def block_key(parent: int | None, tokens: tuple[int, ...]) -> int:
    """A block's key: its parent's key and its tokens hashed, so that it stands for the whole prefix to its end."""
    return hash((parent, tokens))


def iter_chain(tokens: Sequence[int], limit: int, block: int,
               key_of=block_key) -> Iterator[tuple[int, tuple[int, ...], int | None]]:
    """(key, tokens, parent key) of each full `block`-token block in the first `limit` tokens, in order."""
    parent = None
    for start in range(0, limit - block + 1, block):
        chunk = tuple(tokens[start:start + block])
        key = key_of(parent, chunk)
        yield key, chunk, parent
        parent = key


def chain(tokens: Sequence[int], limit: int, block: int,
          key_of=block_key) -> list[tuple[int, tuple[int, ...], int | None]]:
    """`iter_chain`'s blocks, as a list."""
    return list(iter_chain(tokens, limit, block, key_of))


def shared_tokens(prompts: Sequence[Sequence[int]], rows: int, block: int) -> int:
    """The most prompt tokens (whole blocks within what a prefill caches) that some `rows` consecutive prompts, in
    admission order, share with another of them, each shared block counted once: what a prefix store holds for rows
    that run together to reuse the prefixes they share (a synthesis job's instruction: its length)."""
    window: deque[list[int]] = deque()
    count: Counter[int] = Counter()
    shared = most = 0
    for prompt in prompts:
        keys = [key for key, _, _ in chain(prompt, len(prompt) - 1, block)]
        window.append(keys)
        for key in keys:
            count[key] += 1
            shared += count[key] == 2
        if len(window) > rows:
            for key in window.popleft():
                count[key] -= 1
                shared -= count[key] == 1
        most = max(most, shared)
    return most * block


def shared_blocks(prompts: Sequence[Sequence[int]], block: int) -> list[int]:
    """For each prompt, its first whole blocks (within what a prefill caches) that another of `prompts` begins with
    too."""
    chains = [[key for key, _, _ in chain(p, len(p) - 1, block)] for p in prompts]
    count = Counter(key for keys in chains for key in keys)
    return [sum(count[key] > 1 for key in keys) for keys in chains]


def admission_order(prompts: Sequence[Sequence[int]], span: int) -> list[int]:
    """Indices of `prompts` in the order their rows are admitted: rows whose first `span` tokens are the same (a
    shared instruction, a template's fixed text, one prompt's samples) run together, so that their prefix is computed
    once and is still stored when the next of them comes; inside such a cluster in token order (rows that share more
    sit side by side), clusters by their longest prompt first (the long tail does not trail at the end). Sorting is
    stable: equal prompts keep their order."""
    longest: dict[tuple[int, ...], int] = {}
    heads = [tuple(p[:span]) for p in prompts]
    for head, p in zip(heads, prompts):
        longest[head] = max(longest.get(head, 0), len(p))
    return sorted(range(len(prompts)), key=lambda i: (-longest[heads[i]], heads[i], prompts[i]))


class Prefixes:
    """An engine's prefix stores, one per model, within one byte budget shared by the bytes each model's keys and
    values take per token (so every store holds about as many tokens)."""

    def __init__(self, budget: int, per_token: dict[str, int], block: int = 16):
        self.budget = budget  # the most bytes (`limit` may lower it for a while)
        self.block = block
        self.per_token = sum(per_token.values())  # bytes a token takes in all the stores
        self.shares = {name: size / (self.per_token or 1) for name, size in per_token.items()}
        self.stores = {name: PrefixStore(int(budget * share), block) for name, share in self.shares.items()}

    def limit(self, room: int) -> None:
        """At most min(room, budget) bytes from now on (the memory a batch's plan leaves), least recent evicted."""
        for name, store in self.stores.items():
            store.budget = int(min(room, self.budget) * self.shares[name])
            store._evict()

    def __getitem__(self, name: str) -> PrefixStore | None:
        return self.stores.get(name)

    def detach(self) -> None:
        """The caches are replaced: stores pinned in a pool drop what they hold there."""
        for store in self.stores.values():
            if store.pool is not None:
                store.clear()
                store.pool = None

    def attach(self, caches: dict, top_ids: dict[str, int]) -> None:
        """Each store's cache (by model name; `PrefixStore.attach`)."""
        for name, store in self.stores.items():
            if name in caches:
                store.attach(caches[name], top_ids.get(name, 0))

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.stores.values())

    @property
    def device_bytes(self) -> int:
        """Bytes the stores take besides the caches."""
        return sum(s.device_bytes for s in self.stores.values())

    def clear(self) -> None:
        for s in self.stores.values():
            s.clear()
