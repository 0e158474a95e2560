"""A worker's tensor-parallel group on Ray: rank 0 is the generation worker itself, ranks 1..N-1 are
`RankActor`s it starts in the other bundles of its placement group (jobs/driver.py makes one per
worker: N bundles packed on one node, as Ray Data LLM places vLLM's tensor-parallel workers).

Rank 0 owns the other ranks, so a group lives and dies whole: when rank 0's process dies, Ray ends the
others; when another rank dies or fails (while joining, loading or serving), a thread of rank 0's sees
it and ends rank 0's process. Either way Ray restarts the worker, which builds a fresh group (new
processes, a new rendezvous) and the shard in flight is retried: nothing is half-committed, no row is
lost or written twice. A rank that ran out of memory leaves the others waiting in a collective: the group
restarts the same way, and its worker comes back with half the batch size (`note_oom`), as one process
halves its batch in place (workers/worker.py).

On GPUs, ranks bind as vLLM's do: Ray leaves CUDA_VISIBLE_DEVICES alone (jobs/pool.py sets
RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES for tensor-parallel workers), every rank on a node sees the
node's GPUs that Ray assigned to the group, and uses its own Ray-assigned one (`bind`): NCCL then sees
its peers' devices and can use NVLink peer-to-peer, which one visible GPU per process prevents.
"""

from __future__ import annotations

import os
import socket
import sys
import threading

from specdec.config import TargetSource
from specdec.exec.memory import out_of_memory

from . import faults, logs
from .spec import ResourcesSpec


class RankActor:
    """Rank r > 0 of a worker's group (a Ray actor): joins, loads its slice, then serves rank 0's calls."""

    def __init__(self):
        logs.to_file(os.environ.get("SPECBATCH_WORKER_LOGS"))
        logs.setup(os.environ.get("SPECBATCH_LOG_LEVEL", "warning"))
        self.rank = None

    def assigned(self) -> dict:
        """Where Ray placed this rank: its node and GPU ids (no CUDA call: nothing is bound yet)."""
        return _assigned()

    def join(self, rank: int, world: int, address: str, target: dict, use_gpu: bool, timeout_s: float,
             binding: tuple[str, int] | None = None) -> dict:
        from specdec.exec import shard, tp

        device = _device(use_gpu, binding)
        group = tp.Group.join(rank, world, address, device, timeout_s)
        part = shard.load_shard(TargetSource.model_validate(target), rank, world, device, group.all_reduce)
        self.rank = tp.Rank(part, group)
        return _where(rank, part.weight_bytes())

    def serve(self) -> None:
        steps = [0]

        def before(name: str) -> None:  # test hooks: this rank dies, or runs out of memory, at its 5th step
            steps[0] += name == "step"
            if steps[0] == 5 and faults.once("RANK_EXIT"):
                os._exit(1)
            if steps[0] == 5 and faults.once("RANK_OOM"):
                raise RuntimeError(f"CUDA out of memory (injected on rank {self.rank.group.rank})")

        self.rank.serve(before)
        self.rank.group.close()


def start(target: TargetSource, resources: ResourcesSpec):
    """Rank 0 (inside the worker actor): start ranks 1..N-1 (`target.tensor_parallel`) in this actor's placement
    group, each asking Ray for what a worker does (`resources`), join them, load this rank's slice. Returns
    (specdec.exec.tp.Rank, layout: one dict per rank)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from specdec.exec import shard, tp

    world, timeout_s, gpus = target.tensor_parallel, resources.group_timeout_s, resources.gpus_per_worker
    use_gpu = gpus > 0
    shard.check_shardable(target, world)  # a config error fails the worker here, once, not each rank
    pg = ray.util.get_current_placement_group()
    if pg is None:
        raise RuntimeError("a tensor-parallel worker must run in a placement group (jobs/driver.py makes it)")
    address = f"{ray.util.get_node_ip_address()}:{_free_port()}"
    cls = ray.remote(RankActor)
    others = [cls.options(num_cpus=resources.cpus_per_worker, num_gpus=gpus, max_restarts=0,
                          scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=r))
              .remote() for r in range(1, world)]
    bindings = [None] * world
    if use_gpu:  # before any CUDA call in any rank
        ranks = [_assigned()] + ray.get([a.assigned.remote() for a in others])
        bindings = [bind(r["gpus"], ranks, r["node"]) for r in ranks]
    joins = [a.join.remote(r, world, address, target.model_dump(mode="json"), use_gpu, timeout_s, bindings[r])
             for r, a in enumerate(others, start=1)]
    _watch(joins, "joining the group")
    device = _device(use_gpu, bindings[0])
    group = tp.Group.join(0, world, address, device, timeout_s)
    part = shard.load_shard(target, 0, world, device, group.all_reduce)
    layout = [_where(0, part.weight_bytes())] + ray.get(joins)
    _watch([a.serve.remote() for a in others], "serving", others)
    return tp.Rank(part, group), layout


def _watch(refs: list, doing: str, keep: list | None = None) -> None:
    """A thread that ends this process when any of `refs` fails (an actor died, or raised): Ray then restarts
    the worker with a fresh group. `keep` holds the actors' handles for as long as the thread runs."""
    import ray

    def run(actors: list | None) -> None:  # holding the handles keeps the actors
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except Exception as exc:  # noqa: BLE001 - any failure of another rank breaks the group
                if out_of_memory(exc):
                    note_oom()
                print(f"specbatch: a tensor-parallel rank failed while {doing} ({type(exc).__name__}: "
                      f"{str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else ''}); restarting the "
                      "worker's whole group", file=sys.stderr, flush=True)
                os._exit(1)

    threading.Thread(target=run, args=(keep,), daemon=True, name=f"tp-watch-{doing}").start()


def bind(own: list[str], ranks: list[dict], node: str) -> tuple[str, int]:
    """vLLM's binding of a rank on `node` whose Ray-assigned GPU ids are `own`: (CUDA_VISIBLE_DEVICES, the
    device index it uses), where the visible devices are the GPUs Ray assigned to the group's ranks on that
    node (`ranks`: each rank's {"node", "gpus"}), in id order, and the index is that of its own first id."""
    if not own:
        raise RuntimeError(f"a tensor-parallel rank on node {node} holds no GPU (resources.gpus_per_worker)")
    ids = sorted({str(g) for r in ranks if r["node"] == node for g in r["gpus"]},
                 key=lambda g: (0, int(g), "") if g.isdigit() else (1, 0, g))
    return ",".join(ids), ids.index(str(own[0]))


def _device(use_gpu: bool, binding: tuple[str, int] | None = None) -> str:
    """This rank's device: with a `bind` result, CUDA_VISIBLE_DEVICES set and the device chosen before CUDA starts."""
    import torch

    if binding is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = binding[0]
    if not (use_gpu and torch.cuda.is_available()):
        return "cpu"
    if binding is None:
        return "cuda"
    torch.cuda.set_device(binding[1])
    return f"cuda:{binding[1]}"


def _oom_key() -> bytes:
    import ray

    return f"specbatch/tp-oom/{ray.get_runtime_context().get_actor_id()}".encode()


def note_oom() -> None:
    """Rank 0 (the worker actor): its group ran out of memory; the worker's next life halves its batch size again.
    Kept in Ray's key-value store, which outlives the process (Ray restarts an actor under the same id)."""
    from ray.experimental.internal_kv import _internal_kv_put

    _internal_kv_put(_oom_key(), str(_ooms() + 1).encode(), overwrite=True)


def _ooms() -> int:
    from ray.experimental.internal_kv import _internal_kv_get

    value = _internal_kv_get(_oom_key())
    return int(value) if value else 0


def batch_size_after_oom(batch_size: int) -> int:
    """`batch_size`, halved once for each time this worker's group ran out of memory (`note_oom`)."""
    n = _ooms()
    if not n:
        return batch_size
    halved = max(1, batch_size >> n)
    print(f"specbatch: this tensor-parallel group ran out of memory {n} time(s): batch size {batch_size} -> "
          f"{halved}", file=sys.stderr, flush=True)
    return halved


def _assigned() -> dict:
    import ray

    return {"node": ray.util.get_node_ip_address(),
            "gpus": [str(g) for g in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])]}


def _where(rank: int, weight_bytes: int) -> dict:
    return {"rank": rank, **_assigned(), "pid": os.getpid(), "weight_bytes": weight_bytes,
            "host": socket.gethostname(), "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "nccl": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
