"""Planning a worker's GPU memory: how many rows of how many slots a batch may have.

The plan counts what the engine allocates and what its forwards hold at their peak, against what is left
under `gpu_memory_fraction` of the device once the weights are loaded (`used`: the weights, the process's
other tensors, other processes; the engine's current caches and captured steps count as free, since a new
allocation replaces them):
- the KV caches: rows x the slots the engine allocates (`alloc_len`: rounded up, at most 1.25x, and
  one, not each row's own length) x both models' KV bytes per token, and the batch's token buffer; a paged cache
  (specdec/exec/cache.py): its pool's slots instead, and its block tables;
- captured steps (specdec/exec/graphs.py): each key the runner can capture keeps its static inputs and hidden states
  for good; a key is (row bucket, width bucket, KV bucket, all positions, the last or a token tree's), and the engine
  graphs no step wider than `width` (a tree's: `tree_width`), so the keys are few and known; their logits go into one
  buffer per runner (rows x its widest step x vocab); their pool also holds the working memory of one step (over a
  paged pool with `flex`, its block mask: `FLEX_MASK_BYTES` per row and block);
- activations, the largest of: the target's prefill of a batch (rows join by a prefill, a whole batch at
  first: forwards of at most `prefill_chunk` tokens, each attending over the whole prompt), a round (one step,
  and the float32 work on the draft's and the target's distributions) with one row's last chunk of prefill in
  its forward (rows that join while others decode), and the draft's catch-up of whole rows (rows that joined
  while the policy did not draft);
- `held`: room kept for the prefix store, the prefixes a batch's rows share (`prefix_room`);
- `slack` for what is neither: the allocator's rounding, and the cuBLAS workspaces torch keeps for each stream
  that runs a matmul (`STREAM_WORKSPACE` each; two streams: the default one, and the one captures run on).
A batch that does not fit runs with fewer rows; a config whose one row of a one-token prompt does not fit is
refused at start (`OutOfMemoryPlan`, naming the figures and the keys to change).

The sizing is pure: `dense_sizes`, `paged_sizes` and `size_batch` are functions of the plan, the rows' lengths and
the sizes of the caches an engine holds now (`Caches`); the engine allocates what they return (`SpecEngine.hold`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from .cache import BLOCK, blocks_for, model_kv_shape
from .graphs import pow2_at_least, width_buckets
from .prefix import shared_blocks, shared_tokens

GiB = 1 << 30
# a FlexAttention step's block mask per cache row and pool block (specdec/exec/cache.py `_FlexView`), at its peak
# while built (tests/test_memory.py measures it): the blocks' columns, the masked and whole blocks' indices padded
# to the pool, and the columns' temporaries (up to the pool's when a row's table spans it)
FLEX_MASK_BYTES = 32
STREAM_WORKSPACE = 64 << 20  # cuBLAS and cuBLASLt workspaces torch keeps per stream (32 MiB each on Hopper)
TOP_CHUNK = 1 << 26  # the prefill's top ids take logits this many at a time (specdec/exec/runner.py)
ROUND_FLOATS = 12  # float32 [rows, width, vocab] a round holds at once: sampling (its sort's int64 order
# counts two), verification, the draft's distributions
TREE_BYTES = 128  # AASD's token trees built on the device, per row, slot and level of depth: a dozen int64 tensors
# over every start's continuation (specdec/spec/proposers/prompt_lookup.py `device_trees`)


def kv_bytes_per_token(models) -> int:
    """KV-cache bytes one token of one row takes in all layers of these models."""
    return sum(Shape.of(m).kv_per_token for m in models)


@dataclass(frozen=True)
class Shape:
    """A model's sizes, from its config and dtype: what its caches and forwards take."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    d: int
    intermediate: int
    vocab: int  # rows of its output head
    itemsize: int  # bytes of its dtype

    @classmethod
    def of(cls, model, vocab: int | None = None) -> Shape:
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        layers, kv_heads, head_dim = model_kv_shape(model)
        d = cfg.hidden_size
        inter = getattr(cfg, "intermediate_size", None) or 4 * d
        rows = vocab or model.get_output_embeddings().weight.shape[0]
        return cls(layers, cfg.num_attention_heads, kv_heads, head_dim, d, inter, rows,
                   next(model.parameters()).element_size())

    @property
    def kv_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.itemsize

    def forward(self, rows: int, tokens: int, kv: int, logits: str = "none", top_ids: int = 0,
                additive_mask: bool = True, paged: bool = False) -> int:
        """Peak bytes one lean forward (specdec/exec/llama.py; the generic path is taken as alike) holds besides the
        caches: `rows` rows of `tokens` tokens over `kv` slots. In the model's dtype, per token, in every layer: the
        fused q/k/v ((heads + 2 kv_heads) hd), the roped q, its grouped copy and the attention's output (3 heads
        hd), the roped k (kv_heads hd), RoPE's cos and sin (2 hd); with the residual (d) while attention runs, and at
        the MLP with the residual's two updates and the normed input (4 d) and gate/up, activation and product (4
        intermediate). The boolean mask (rows x group x tokens x kv bytes) lives across layers; on CUDA
        (`additive_mask`) so does its additive copy in the dtype (made once, beside its negation: llama.sdpa_mask),
        and attention may hold an aligned copy (counted as a second negation and copy).
        Then the output: `all` logits [rows, tokens, vocab] and hidden states, the `last` position's of each row,
        or (`top_ids`: the prefill's most likely ids) a copy of the hidden states, the ids, and logits 2^26 at a time.
        Over a `paged` cache, attention reads a layer's keys and values gathered (and their pool slots, int64)."""
        e, n, hd = self.itemsize, rows * tokens, self.head_dim
        common = (self.heads + 2 * self.kv_heads) * hd + 3 * self.heads * hd + self.kv_heads * hd + 2 * hd
        mask = rows * (self.heads // self.kv_heads) * tokens * kv
        attention = n * e * (self.d + common) + mask * (2 + 2 * e if additive_mask else 1)
        if paged:
            attention += rows * kv * (2 * self.kv_heads * hd * e + 8)
        mlp = n * e * (4 * self.d + common + 4 * self.intermediate) + mask
        out = 0
        if logits == "all":
            out = n * (self.vocab + self.d) * e
        elif logits == "last":
            out = n * self.d * e + rows * (self.vocab + self.d) * e
        elif logits == "top_ids":
            out = n * (self.d * e + 1 + 16 * top_ids) + min(n, max(1, TOP_CHUNK // self.vocab)) * self.vocab * e
        return max(attention, mlp) + out

    def kept(self, rows: int, width: int, kv: int, out: str) -> int:
        """Bytes a captured step of `rows` rows and `width` tokens over `kv` slots whose `out` is "all", "last" or
        "tree" (`ModelRunner.key`) keeps: its static inputs (tokens and positions; each row's last position; a
        tree's slots and boolean mask) and its hidden states (of every position or the last). Its logits go into the
        buffer all steps share (`logits`)."""
        inputs = 16 * rows * width + {"last": 8 * rows, "tree": rows * width * (8 + kv)}.get(out, 0)
        return inputs + rows * (1 if out == "last" else width) * self.d * self.itemsize

    def logits(self, rows: int, width: int) -> int:
        """Bytes of the buffer a runner's captured steps write their logits into: `rows` rows of `width` positions."""
        return rows * width * self.vocab * self.itemsize


def quarter_steps(n: int) -> int:
    """n rounded up to a multiple of a quarter of the power of two below it (powers of two up to 8): 1,000 ->
    1,024, 1,025 -> 1,280, 2,076 -> 2,560; past 8, at most 1.25x n."""
    if n <= 8:
        return pow2_at_least(n)
    step = 1 << (n.bit_length() - 3)
    return -(-n // step) * step


def row_buckets(rows: int) -> list[int]:
    """The row counts steps of up to `rows` rows are padded to (specdec/exec/runner.py): powers of two, and `rows`."""
    return sorted({min(1 << j, rows) for j in range(rows.bit_length() + 1)})


def kv_buckets(max_len: int, smallest: int) -> list[int]:
    """The attention windows steps over a cache of `max_len` slots use: powers of two from `smallest`, and the
    whole buffer."""
    out, p = [], pow2_at_least(smallest)
    while True:
        out.append(min(p, max_len))
        if p >= max_len:
            return out
        p *= 2


@dataclass(frozen=True)
class Role:
    """A model of the pair, as the plan sees it: its sizes, and which steps of it are captured."""

    name: str  # "target" or "draft"
    shape: Shape
    graphs: bool  # its steps replay captured graphs

    def step_kinds(self, width: int, tree: int = 0) -> list[tuple[int, str]]:
        return step_kinds(self.name, width, tree=tree)


def step_kinds(name: str, width: int, most: int | None = None, tree: int = 0) -> list[tuple[int, str]]:
    """(width, out) of the captured steps a round of model `name` takes (`ModelRunner.key`), widths padded to their
    buckets (`width_buckets`; `most`: of steps up to `most` tokens wide only): the target verifies every position
    ("all") of up to `width` tokens, and token trees ("tree") of 3 (a root and two nodes: a tree branches) to `tree`
    tokens; the draft feeds one token (every position) and catches up up to `width` tokens (the last)."""
    widths = width_buckets(width, most)
    if name == "target":
        return [(w, "all") for w in widths] + [(w, "tree") for w in width_buckets(tree) if w >= 3]
    return [(1, "all")] + [(w, "last") for w in widths]


def logits_width(kinds: list[tuple[int, str]]) -> int:
    """The most positions a row of a step of these kinds ((width, out): `step_kinds`) has logits at."""
    return max((w for w, out in kinds if out != "last"), default=1)


@dataclass
class Need:
    """What a batch's allocation and forwards take, in bytes."""

    rows: int  # cache rows allocated
    max_len: int  # slots per row allocated
    batch: int  # rows of the batch (all prefilled at once at its start)
    kv: int  # KV caches and the batch's token buffer
    graphs: int  # captured steps: kept inputs and outputs, and one step's working memory
    activations: int  # the largest forward (a prefill, a catch-up) or round
    pool: int | None = None  # a paged cache's slots (specdec/exec/cache.py); None: dense rows x max_len
    held: int = 0  # bytes of the plan held back for the prefix store beside these

    @property
    def total(self) -> int:
        return self.kv + self.graphs + self.activations

    def describe(self) -> str:
        cache = f"{self.rows} rows x {self.max_len} slots" if self.pool is None else \
            f"{self.rows} rows in a pool of {self.pool} slots"
        return (f"{self.total / GiB:.2f} GiB ({cache} of KV cache {self.kv / GiB:.2f}, "
                f"captured steps {self.graphs / GiB:.2f}, activations {self.activations / GiB:.2f})")


class OutOfMemoryPlan(ValueError):
    """Even one row does not fit the memory plan."""


@dataclass
class MemoryPlan:
    roles: list[Role]
    fraction: float
    total: int  # the device's memory
    used: int  # in use when the plan was made (weights, the process's other tensors, other processes)
    width: int  # the widest captured step
    kv_bucket: int  # the smallest attention window of a captured step (ModelRunner.min_kv_bucket)
    prompt_top_ids: int = 0  # the most likely ids the target's prefill computes at every prompt position (AASD)
    tree_width: int = 0  # tokens a token tree's verification takes per row (AASD: its node budget and root; 0: none)
    additive_mask: bool = True  # attention copies the boolean mask to an additive one (CUDA's SDPA; not CPU's)
    prefill_chunk: int | None = None  # most tokens (rows x tokens) one prefill forward takes (None: all)
    paged: bool = False  # the caches are paged (specdec/exec/cache.py): attention gathers what it reads
    flex: bool = False  # captured steps over a paged pool attend with FlexAttention in place (a block mask each)
    block: int = BLOCK  # slots per block of a paged pool
    held: int = 0  # bytes held back for the prefix store: the prefixes a batch's rows share (`prefix_room`)
    slack: int = GiB // 2

    @property
    def budget(self) -> int:
        """Bytes the caches, captured steps and activations may take."""
        return int(self.fraction * self.total) - self.used - self.slack - self.held

    def need(self, rows: int, max_len: int, batch: int, row_len: int, prompt: int, pool: int | None = None) -> Need:
        """What caches of `rows` rows x `max_len` slots take with a batch of `batch` rows of up to `row_len` slots
        whose prompts have up to `prompt` tokens; paged ones (`pool` slots, and a block table per row of `max_len`
        slots) hold `pool` slots instead of the rows'."""
        slots = rows * max_len if pool is None else pool
        # and each row's tokens (int64), and with AASD its prompt's top ids (int32) on the device
        kv = slots * sum(r.shape.kv_per_token for r in self.roles) + (8 + 4 * self.prompt_top_ids) * batch * row_len
        if pool is not None:
            kv += len(self.roles) * 8 * rows * blocks_for(max_len, self.block)
        keys = self.keys(rows, max_len)
        graphs = sum(role.shape.kept(r, w, window, out) for role in self.roles
                     for r, w, window, out in keys.get(role.name, ()))
        graphs += sum(role.shape.logits(rows, logits_width(self.kinds(role))) for role in self.roles if role.graphs)
        verify = max(self.width, self.tree_width)  # a round's widest verification: a chain's, or a tree's
        if graphs:  # and the pool keeps the working memory of the widest step captured
            graphs += max(self._forward(role, rows, verify if role is self.roles[0] else self.width, max_len, "all")
                          for role in self.roles if role.graphs)
            if self.flex and pool is not None:
                graphs += FLEX_MASK_BYTES * rows * (pool // self.block)
        step_rows = min(pow2_at_least(batch), rows)  # a round's step: its rows padded to a bucket
        vocab = max(r.shape.vocab for r in self.roles)
        round_ = self._forward(self.roles[0], step_rows, verify, max_len, "all") \
            + ROUND_FLOATS * 4 * step_rows * verify * vocab \
            + (TREE_BYTES * batch * row_len * (self.width - 1) if self.tree_width else 0)
        # rows join by a prefill: a whole batch at first, apart; later within a round's forward, which takes a chunk
        # of joining rows beside the others (one joining row is the most: each row more is a row less in the step,
        # whose rows cost more than a joining row's attention)
        acts = [self.prefill(self.roles[0], batch, prompt), round_ + self.prefill(self.roles[0], 1, prompt)]
        acts += [self.catch_up(role, batch, row_len) for role in self.roles[1:]]
        return Need(rows, max_len, batch, kv, graphs, max(acts), pool, self.held)

    def prefill(self, role: Role, batch: int, prompt: int) -> int:
        """Peak bytes of a prefill of `batch` rows of up to `prompt` tokens: its largest forward (rows x tokens
        within `prefill_chunk`, attending over the whole prompt), and for the target the top ids kept of every
        forward."""
        rows = min(batch, self.prefill_chunk or batch)
        tokens = min(prompt, max(1, (self.prefill_chunk or rows * prompt) // rows))
        top_ids = self.prompt_top_ids if role is self.roles[0] else 0
        kept = 8 * top_ids * batch * prompt
        return self._forward(role, rows, tokens, prompt, "top_ids" if top_ids else "none") + kept

    def catch_up(self, role: Role, batch: int, row_len: int) -> int:
        """Peak bytes of the draft's catch-up of whole rows: one forward with each row's last logits, or, past
        `prefill_chunk` tokens, a prefill in chunks and then that forward over the last token alone."""
        if self.prefill_chunk is None or batch * row_len <= self.prefill_chunk:
            return self._forward(role, batch, row_len, row_len, "last")
        return max(self.prefill(role, batch, row_len), self._forward(role, batch, 1, row_len, "last"))

    def keys(self, rows: int, max_len: int) -> dict[str, set[tuple]]:
        """Per model whose steps are captured, every key (rows, width, window, out) a runner over caches of `rows`
        rows x `max_len` slots can capture (`ModelRunner.key`)."""
        windows = kv_buckets(max_len, self.kv_bucket)
        return {role.name: {(r, w, kv, out) for r in row_buckets(rows) for w, out in self.kinds(role) for kv in windows}
                for role in self.roles if role.graphs}

    def kinds(self, role: Role) -> list[tuple[int, str]]:
        """(width, out) of the steps `role`'s runner captures (`step_kinds`)."""
        return role.step_kinds(self.width, self.tree_width if role is self.roles[0] else 0)

    def _forward(self, role: Role, rows: int, tokens: int, kv: int, logits: str) -> int:
        return role.shape.forward(rows, tokens, kv, logits, self.prompt_top_ids, self.additive_mask, self.paged)

    def fits(self, need: Need) -> bool:
        return need.total <= self.budget

    def left(self, need: Need) -> int:
        """Bytes the prefix store may take beside `need`: what was held back for it, and what the rows leave."""
        return max(0, replace(self, held=need.held).budget - need.total) + need.held

    def refuse(self, need: Need, what: str) -> OutOfMemoryPlan:
        return OutOfMemoryPlan(
            f"{what} needs {need.describe()}, but resources.gpu_memory_fraction {self.fraction} of "
            f"{self.total / GiB:.1f} GiB leaves {max(self.budget, 0) / GiB:.2f} GiB after {self.used / GiB:.1f} GiB in "
            f"use (weights) and {self.slack / GiB:.2f} GiB of slack: raise the fraction, or lower "
            "generation.max_new_tokens or the prompts' length")


def largest(fits, high: int) -> int:
    """The largest n in [1, high] with fits(n), for fits true up to some n and false after; 0 if none."""
    lo, hi = 0, high
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def device_memory(device: torch.device) -> tuple[int, int] | None:
    """(free, total) bytes of a CUDA device, the allocator's cached blocks counted free (torch reuses them); None
    elsewhere (CPU memory is not planned)."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device), total


def out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` (or the failure it reports, e.g. another process's) is running out of memory."""
    text = str(exc).lower()
    return type(exc).__name__ == "OutOfMemoryError" or "out of memory" in text or "can't allocate memory" in text


@dataclass(frozen=True)
class Caches:
    """The sizes of an engine's KV caches (every model's alike): `rows` rows of `max_len` slots; a paged cache, a
    pool of `blocks` blocks (0: dense rows)."""

    rows: int
    max_len: int
    blocks: int = 0

    def holds(self, other: Caches) -> bool:
        return self.rows >= other.rows and self.max_len >= other.max_len and self.blocks >= other.blocks


def alloc_len(slots: int, max_positions: int) -> int:
    """Slots allocated per row for rows of `slots` slots: room to grow, rounded up to a quarter of a power of two (at
    most 1.25x; caches that grow take a few sizes per doubling), and one more (the slot that padded positions are
    clamped into), but never past the models' positions: every slot's position has a RoPE table entry
    (specdec/exec/llama.py). The one length both the allocation and the plan count."""
    return max(slots, min(quarter_steps(slots) + 1, max_positions))


def pool_blocks(slots: Sequence[int], block: int = BLOCK) -> int:
    """Blocks (of `block` slots) of a paged cache that holds rows of these `slots` at once, and the scratch block."""
    return 1 + sum(blocks_for(s, block) for s in slots)


def grown(current: Caches | None, want: Caches, length: Callable[[int], int]) -> Caches:
    """Caches that hold `want` (its `max_len`: the slots a row needs) and what `current` holds: current's sizes where
    they do, else grown (a row's slots allocated by `length`)."""
    if current is None:
        return Caches(want.rows, length(want.max_len), want.blocks)
    max_len = current.max_len if want.max_len <= current.max_len else length(want.max_len)
    return Caches(max(want.rows, current.rows), max_len, max(want.blocks, current.blocks))


def dense_sizes(plan: MemoryPlan, want: int, row_len: int, prompt: int, current: Caches | None,
                length: Callable[[int], int]) -> Need:
    """Dense caches and the rows a batch may have (`batch`: up to `want`) for rows of up to `row_len` slots whose
    prompts have up to `prompt` tokens: the current caches, grown where too small, when the plan fits them (their
    captured steps are kept), else the largest fresh ones it fits. Raises `OutOfMemoryPlan` when not one row fits."""
    def need(caches: Caches, rows: int) -> Need:
        return plan.need(caches.rows, caches.max_len, rows, row_len, prompt)

    options = [lambda r: grown(current, Caches(r, row_len), length)]
    if current is not None:
        options.append(lambda r: Caches(r, length(row_len)))  # or replace them by smaller ones
    for size in options:
        rows = largest(lambda r: plan.fits(need(size(r), r)), want)
        if rows:
            return need(size(rows), rows)
    raise plan.refuse(need(options[-1](1), 1), f"one row of {row_len} slots")


def paged_sizes(plan: MemoryPlan, want: int, row_len: int, prompt: int, slots: list[int], own: list[int],
                shared: int, current: Caches | None, length: Callable[[int], int]) -> Need:
    """Paged caches for rows of these `slots` (longest first) that write `own` slots each (longest first) and share
    `shared` blocks: the most rows (up to `want`) whose steps and activations leave a pool for the shared blocks and
    that many rows of the mean own reservation (and for the longest row whole), the pool taking what they leave, up
    to what the longest rows reserve together; or the `current` caches, when the plan fits them and they have as
    many rows and blocks. Rows join while blocks are free. Raises `OutOfMemoryPlan` when not one row fits."""
    size = length(row_len)
    mean = sum(blocks_for(s, plan.block) for s in own) / len(own)
    least = pool_blocks(slots[:1], plan.block)  # the longest row alone

    def need(rows: int, blocks: int) -> Need:
        return plan.need(rows, size, rows, row_len, prompt, pool=blocks * plan.block)

    def serves(blocks: int, rows: int) -> bool:  # the longest row alone, and the shared and the mean rows together
        return blocks >= least and blocks - 1 - shared >= rows * mean

    pools: dict[int, int] = {}

    def pool(rows: int) -> int:  # the most blocks that fit beside `rows` rows' steps and activations
        if rows not in pools:
            most = max(least, pool_blocks(own[:rows], plan.block) + shared)
            pools[rows] = largest(lambda b: plan.fits(need(rows, b)), most)
        return pools[rows]

    rows = largest(lambda r: serves(pool(r), r), want)
    if not rows:
        raise plan.refuse(need(1, least), f"one row of {row_len} slots")
    if current is not None and current.max_len >= size and current.rows >= rows and serves(current.blocks, rows):
        keep = plan.need(current.rows, current.max_len, min(want, current.rows), row_len, prompt,
                         pool=current.blocks * plan.block)
        if plan.fits(keep):  # the current caches, and their captured steps, serve as many rows
            return keep
    return need(rows, pool(rows))


def size_batch(plan: MemoryPlan, held: int, size: Callable[[MemoryPlan], Need]) -> Need:
    """`size`'s batch under `plan` with `held` bytes kept back for the prefix store, or with none when not one row
    fits beside them (rows come first); the `Need` says which (`Need.held`)."""
    try:
        return size(replace(plan, held=held))
    except OutOfMemoryPlan:
        if not held:
            raise
        return size(replace(plan, held=0))


def prefix_room(plan: MemoryPlan, prompts: list[Sequence[int]], rows: int, block: int, per_token: int,
                cap: int) -> int:
    """Bytes to hold back from the rows for the prefix store: the prefixes that the prompts (one per prompt, in
    admission order) of `rows` rows running together share (`shared_tokens`, `per_token` bytes a token), at most a
    quarter of the plan's budget and `cap` (the store's own). Without them, a batch that the memory bounds would
    leave the store nothing, and every row would compute a shared instruction again."""
    return min(shared_tokens(prompts, rows, block) * per_token, max(0, plan.budget) // 4, cap)


def pool_sharing(prompts: list[Sequence[int]], slots: list[int], rows: int, block: int) -> tuple[list[int], int]:
    """For a paged pool whose prefix store shares whole prompt blocks: the slots each row (of `slots` slots, its
    prompt in `prompts`) writes itself (its prompt's whole blocks that another prompt shares it holds by reference),
    and the most blocks `rows` rows running together share (the pool holds them once)."""
    own = [s - n * block for s, n in zip(slots, shared_blocks(prompts, block))]
    return own, shared_tokens(prompts, rows, block) // block
