"""A worker's tensor-parallel group on Ray: rank 0 is the generation worker itself, ranks 1..N-1 are
`RankActor`s it starts in the other bundles of its placement group (jobs/driver.py makes one per
worker: N bundles packed on one node, as Ray Data LLM places vLLM's tensor-parallel workers).

Rank 0 owns the other ranks, so a group lives and dies whole: when rank 0's process dies, Ray ends the
others; when another rank dies or fails (while joining, loading or serving), a thread of rank 0's sees
it and ends rank 0's process. Either way Ray restarts the worker, which builds a fresh group (new
processes, a new rendezvous) and the shard in flight is retried: nothing is half-committed, no row is
lost or written twice.
"""

from __future__ import annotations

import os
import socket
import sys
import threading

from specdec.config import TargetSource

from . import faults, logs
from .spec import ResourcesSpec


class RankActor:
    """Rank r > 0 of a worker's group (a Ray actor): joins, loads its slice, then serves rank 0's calls."""

    def __init__(self):
        logs.to_file(os.environ.get("SPECBATCH_WORKER_LOGS"))
        logs.setup(os.environ.get("SPECBATCH_LOG_LEVEL", "warning"))
        self.rank = None

    def join(self, rank: int, world: int, address: str, target: dict, use_gpu: bool, timeout_s: float) -> dict:
        from specdec import shard, tp

        device = _device(use_gpu)
        group = tp.Group.join(rank, world, address, device, timeout_s)
        part = shard.load_shard(TargetSource.model_validate(target), rank, world, device, group.all_reduce)
        self.rank = tp.Rank(part, group)
        return _where(rank, part.weight_bytes())

    def serve(self) -> None:
        steps = [0]

        def before(name: str) -> None:  # test hook: this rank dies mid-shard (its 5th step)
            steps[0] += name == "step"
            if steps[0] == 5 and faults.once("RANK_EXIT"):
                os._exit(1)

        self.rank.serve(before)
        self.rank.group.close()


def start(target: TargetSource, resources: ResourcesSpec):
    """Rank 0 (inside the worker actor): start ranks 1..N-1 (`target.tensor_parallel`) in this actor's placement
    group, each asking Ray for what a worker does (`resources`), join them, load this rank's slice. Returns
    (specdec.tp.Rank, layout: one dict per rank)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from specdec import shard, tp

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
    joins = [a.join.remote(r, world, address, target.model_dump(mode="json"), use_gpu, timeout_s)
             for r, a in enumerate(others, start=1)]
    _watch(joins, "joining the group")
    device = _device(use_gpu)
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
                print(f"specbatch: a tensor-parallel rank failed while {doing} ({type(exc).__name__}: "
                      f"{str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else ''}); restarting the "
                      "worker's whole group", file=sys.stderr, flush=True)
                os._exit(1)

    threading.Thread(target=run, args=(keep,), daemon=True, name=f"tp-watch-{doing}").start()


def _device(use_gpu: bool) -> str:
    import torch

    return "cuda" if use_gpu and torch.cuda.is_available() else "cpu"


def _where(rank: int, weight_bytes: int) -> dict:
    import ray

    ctx = ray.get_runtime_context()
    return {"rank": rank, "node": ray.util.get_node_ip_address(), "pid": os.getpid(),
            "gpus": [str(g) for g in ctx.get_accelerator_ids().get("GPU", [])], "weight_bytes": weight_bytes,
            "host": socket.gethostname()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
