"""Tensor-parallel targets: N processes (ranks) each hold a slice of the target (specdec/exec/shard.py) and run
every target forward together, in lock-step, driven by rank 0.

Rank 0 runs everything else as on one device: the draft, the proposer, verification, the length policy.
Its target runner (`TPRunner`) has specdec/exec/runner.py's interface; each call it gets (allocate, prefill,
step, a cache row move) is sent to the other ranks, then run on its own slice. A call's name and its
arguments' shapes go over a CPU (gloo) group; the tensors themselves (token ids, positions, cache slots,
a tree's mask: never activations) over the device group, NCCL on GPUs, so rank 0 never waits on its GPU
to send them. Every rank then runs the same lean forward (specdec/exec/llama.py) on its slice, with all-reduces
after the row-parallel projections (in bf16 where the model computes in bf16, as vLLM's are; float16 is
summed in float32, which cannot overflow), and gathers the logits' vocabulary slices. The other
ranks run `Rank.serve`: rank 0's calls, in order, until `stop`.

Steps run eagerly (no CUDA graphs, no compiled layer: the collectives are not captured yet). A failed
call leaves the ranks out of step: `GroupBroken` says the group must be rebuilt (workers/group.py).
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import llama
from .cache import RaggedKVCache, WholeRows
from .inputs import Join
from .runner import ModelRunner
from .shard import ShardedModel


class GroupBroken(RuntimeError):
    """A tensor-parallel call failed on rank 0: the other ranks are out of step, the group must be rebuilt."""


@dataclass(frozen=True)
class _Tensor:  # a tensor argument's place in a call: its shape and dtype go ahead of its data
    shape: tuple[int, ...]
    dtype: torch.dtype


class Group:
    """This process's place in a tensor-parallel group, and the group's collectives."""

    def __init__(self, rank: int, world: int, device: torch.device, timeout_s: float):
        self.rank, self.world, self.device = rank, world, device
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.data = dist.group.WORLD
        # the control group keeps the configured timeout too (torch's default for a new group is 30 minutes)
        self.control = dist.new_group(backend="gloo", timeout=self.timeout) if device.type == "cuda" else self.data

    @classmethod
    def join(cls, rank: int, world: int, address: str, device: str | torch.device, timeout_s: float) -> Group:
        """Rendezvous with the other ranks at `address` (host:port, rank 0's) within `timeout_s`."""
        device = torch.device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://{address}",
                                rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
        return cls(rank, world, device, timeout_s)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the ranks, in `reduce_dtype(x.dtype)`."""
        y = x.to(reduce_dtype(x.dtype))
        dist.all_reduce(y, group=self.data)
        return y.to(x.dtype)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' x side by side along the last dimension, in rank order."""
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous(), group=self.data)
        return torch.cat(parts, dim=-1)

    def send(self, name: str, args: tuple) -> None:
        """Rank 0: announce a call to the other ranks."""
        head = [_Tensor(tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a for a in args]
        dist.broadcast_object_list([name, head], src=0, group=self.control)
        for a in args:
            if isinstance(a, torch.Tensor):
                dist.broadcast(_wire(a).to(self.device).contiguous(), src=0, group=self.data)

    def receive(self) -> tuple[str, list]:
        """Another rank: the next call rank 0 announced."""
        box = [None, None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        name, head = box
        args = []
        for a in head:
            if isinstance(a, _Tensor):
                t = torch.empty(a.shape, dtype=_wire_dtype(a.dtype), device=self.device)
                dist.broadcast(t, src=0, group=self.data)
                a = t.to(a.dtype)
            args.append(a)
        return name, args

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def reduce_dtype(dtype: torch.dtype) -> torch.dtype:
    """What an all-reduce of `dtype` sums in: bf16 and float32 as they are (bf16 has float32's range: half the
    bytes on the wire), anything else in float32 (float16 could overflow)."""
    return dtype if dtype in (torch.bfloat16, torch.float32) else torch.float32


def _wire_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.uint8 if dtype == torch.bool else dtype  # gloo has no bool


def _wire(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.uint8) if t.dtype == torch.bool else t


class ShardRunner(ModelRunner):
    """A rank's runner over its slice and its KV cache: the lean forward, logits gathered from every rank."""

    def __init__(self, shard: ShardedModel, cache: RaggedKVCache, group: Group):
        super().__init__(shard, cache, shard.head, None, graphs=False, weights=shard.weights)
        self.pieces = llama.EAGER  # eager: the all-reduces are not compiled
        self.group = group
        self.vocab = shard.vocab_rows

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather(F.linear(hidden, self.head_weight))[..., : self.vocab]


class Rank:
    """One rank's side of a tensor-parallel target: its slice, its KV caches (one per engine on rank 0, by the
    engine's key), and the calls rank 0 sends."""

    def __init__(self, shard: ShardedModel, group: Group):
        self.shard, self.group = shard, group
        self.runners: dict[int, ShardRunner] = {}

    def allocate(self, key: int, rows: int, max_len: int) -> None:
        self.runners.pop(key, None)  # the old cache goes before the new one comes
        self.runners[key] = ShardRunner(self.shard, RaggedKVCache(self.shard, rows, max_len), self.group)

    def prefill(self, key: int, tokens, start, end, top_ids, lengths, offsets):
        return self.runners[key].prefill(tokens, start, end, top_ids, lengths, offsets)

    def step(self, key: int, tokens, positions, kv_len, last, slots, mask):
        return self.runners[key].step(tokens, positions, kv_len, last, slots=slots, mask=mask)

    def step_joined(self, key: int, tokens, positions, kv_len, *join):
        return self.runners[key].step_joined(tokens, positions, kv_len, Join(*join))

    def move_row(self, key: int, src: int, dst: int, length: int) -> None:
        self.runners[key].cache.move_row(src, dst, length)

    def move_slots(self, key: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.runners[key].cache.move_slots(src, dst)

    def all_reduce_probe(self, key: int, nbytes: int, dtype: torch.dtype) -> tuple[float, bool]:
        """Every rank: all-reduce `nbytes` of `dtype` (once to warm, then timed 3 times); (seconds per
        all-reduce, whether the sum came out right)."""
        x = torch.ones(nbytes // _itemsize(dtype), dtype=dtype, device=self.group.device)
        dist.all_reduce(x, group=self.group.data)
        right = bool((x == self.group.world).all())
        sync = torch.cuda.synchronize if x.device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        for _ in range(3):
            dist.all_reduce(x, group=self.group.data)
        sync()
        return (time.perf_counter() - t0) / 3, right

    @torch.inference_mode()
    def serve(self, before: Callable[[str], None] | None = None) -> None:
        """Ranks 1..N-1: run rank 0's calls until it sends `stop`; `before(name)` is called ahead of each."""
        while True:
            name, args = self.group.receive()
            if name == "stop":
                return
            if before is not None:
                before(name)
            getattr(self, name)(*args)

    def stop(self) -> None:
        """Rank 0: end the other ranks' `serve` loops."""
        self.group.send("stop", ())


class TPRunner:
    """Rank 0's target runner: specdec/exec/runner.py's interface, every call run by the whole group. `key` names its
    KV caches on every rank (an engine's: reallocating replaces them)."""

    def __init__(self, rank: Rank, rows: int, max_len: int, key: int):
        self.rank, self.key = rank, key
        self.call("allocate", rows, max_len)
        self.own = rank.runners[key]
        self.device = self.own.device
        self.cache = _Cache(self)

    def call(self, name: str, *args):
        try:
            self.rank.group.send(name, (self.key, *args))
            return getattr(self.rank, name)(self.key, *args)
        except Exception as exc:
            raise GroupBroken(f"tensor-parallel {name} failed on rank 0 ({type(exc).__name__}: {exc})") from exc

    @property
    def path(self) -> str:
        return f"{self.own.path}-tp{self.rank.group.world}"

    def prefill(self, tokens: torch.Tensor, start: int, end: int, top_ids: int = 0, lengths=None, offsets=None):
        return self.call("prefill", tokens, start, end, top_ids, lengths, offsets)

    def step(self, tokens, positions, kv_len, last=None, slots=None, mask=None):
        return self.call("step", tokens, positions, kv_len, last, slots, mask)

    def step_joined(self, tokens, positions, kv_len, join: Join):
        return self.call("step_joined", tokens, positions, kv_len, join.tokens, join.positions, join.kv_len, join.start,
                         join.at)


class _Cache(WholeRows):
    """Rank 0's view of the group's KV caches: its own sizes; row moves happen on every rank."""

    def __init__(self, runner: TPRunner):
        self._runner = runner
        self.rows, self.max_len = runner.own.cache.rows, runner.own.cache.max_len

    def nbytes(self) -> int:
        return self._runner.own.cache.nbytes()

    def move_row(self, src: int, dst: int, length: int) -> None:
        self._runner.call("move_row", src, dst, length)

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self._runner.call("move_slots", src, dst)

