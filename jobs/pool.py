"""The job's workers on Ray: joining a cluster or starting an embedded one, the worker actors (a placement
group each for a tensor-parallel target), and the watchdog that restarts a worker that stopped making progress.
"""

from __future__ import annotations

import logging
import os
import sys
import time

from workers.spec import WorkerSpec

from .manifest import JobError


def init_ray(address: str | None, level: str = "warning", verbose: bool = False) -> bool:
    """Join the cluster at `address`, or start an embedded local one; True if we started it."""
    import ray

    if ray.is_initialized():
        return False
    kwargs = dict(include_dashboard=False, logging_level=getattr(logging, level.upper()), log_to_driver=verbose)
    if address:
        ray.init(address=address, **kwargs)
    else:
        ray.init(address="local", num_cpus=os.cpu_count(), **kwargs)  # not a `ray start` cluster found on the machine
    return True


class Pool:
    """The job's worker actors, each loading its models once and then serving shards. Restarts are unlimited,
    and each call is retried `resources.max_retries` times when its process dies (jobs/driver.py). `grow(n)`
    starts n more; `close()` ends them all."""

    def __init__(self, spec: WorkerSpec, env: dict[str, str], say=print):
        import ray

        from workers.worker import GenerationWorker

        res = spec.resources
        self.spec, self.say = spec, say
        self.actor = ray.remote(GenerationWorker)
        self.options = dict(num_cpus=res.cpus_per_worker, num_gpus=res.gpus_per_worker, max_restarts=-1,
                            max_task_retries=res.max_retries, max_concurrency=2, runtime_env={"env_vars": env})
        self.workers: list = []
        self.groups: list = []  # placement groups, tensor parallel only

    def grow(self, n: int) -> list:
        """Start n workers: their placement groups first (waited on together), then the actors; returns them once
        each has loaded its models, and raises JobError, with the cause, if one cannot start at all."""
        import ray
        from ray.exceptions import RayError

        groups = [self._placement() for _ in range(n)]
        self.groups += [g for g in groups if g is not None]
        self._wait_for_groups(groups)
        new = [self.actor.options(**self.options, **({"scheduling_strategy": g} if g else {})).remote(self.spec)
               for g in groups]
        self.workers += new
        for w in new:
            try:
                ray.get(w.ready.remote())
            except RayError as exc:
                raise JobError(f"a worker failed to start: {cause(exc)}") from None
        for w in new:
            layout = ray.get(w.group_layout.remote())
            if layout:
                self.say(f"specbatch: worker {self.workers.index(w)}: {describe_group(layout)}")
        return new

    def close(self) -> None:
        import ray

        for w in self.workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:
                pass
        for g in self.groups:
            ray.util.remove_placement_group(g.placement_group)
        self.workers, self.groups = [], []

    def _placement(self):
        """For a tensor-parallel target: a placement group of one bundle per rank ({CPU: cpus_per_worker, GPU:
        gpus_per_worker}), packed on one node, and the strategy that puts the worker (rank 0) in bundle 0. None
        for a target in one process."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ranks, res = self.spec.models.target.tensor_parallel, self.spec.resources
        if ranks == 1:
            return None
        bundle = {"CPU": res.cpus_per_worker, **({"GPU": res.gpus_per_worker} if res.gpus_per_worker else {})}
        group = placement_group([bundle] * ranks, strategy="STRICT_PACK", name="")
        return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)

    def _wait_for_groups(self, groups: list) -> None:
        """Say so when the placement groups are not all placed within 30 s (the cluster has no node with room for
        a whole group yet: an autoscaler may be adding one); the workers start when they are."""
        import ray

        placed = [g.placement_group for g in groups if g is not None]
        if not placed:
            return
        ready, _ = ray.wait([g.ready() for g in placed], num_returns=len(placed), timeout=30)
        if len(ready) < len(placed):
            ranks, bundle = self.spec.models.target.tensor_parallel, placed[0].bundle_specs[0]
            print(f"specbatch: {len(placed) - len(ready)} of {len(placed)} workers wait for a node with room for "
                  f"{ranks} x {bundle} (models.target.tensor_parallel {ranks}; cluster: {ray.cluster_resources()})"
                  "...", file=sys.stderr, flush=True)


def describe_group(layout: list[dict]) -> str:
    """'2 tensor-parallel ranks on node 10.0.0.5: rank 0 GPU 0 (1.2 GiB of weights), ...'."""
    nodes = sorted({r["node"] for r in layout})
    ranks = ", ".join(f"rank {r['rank']} {'GPU ' + ','.join(r['gpus']) if r['gpus'] else 'CPU'} "
                      f"({r['weight_bytes'] / (1 << 30):.2f} GiB of weights)" for r in layout)
    return f"{len(layout)} tensor-parallel ranks on node {', '.join(nodes)}: {ranks}"


class Watchdog:
    """Kills a worker that reports no progress (no round's tokens, no shard started) for `timeout_s`, or that
    has not answered at all for 4 x `timeout_s` (a process hung inside native code; a restarting worker,
    still loading its models, does not answer either): Ray then restarts it and retries its shard."""

    def __init__(self, timeout_s: float | None, say=print):
        self.timeout_s, self.say = timeout_s, say
        self.poll_s = min(30.0, timeout_s / 4) if timeout_s else None
        self.last_check = time.monotonic()
        self.answered: dict[int, float] = {}  # worker -> when it last answered

    def check(self, inflight: dict) -> int:
        """Ask the busy workers (`inflight`: result ref -> (worker, shard)) how long since their last progress, at
        most every `poll_s`; returns how many it killed."""
        import ray

        now = time.monotonic()
        if not self.timeout_s or now - self.last_check < self.poll_s:
            return 0
        self.last_check = now
        busy = {id(w): (w, s) for w, s in inflight.values()}
        asks = {w.progress.remote(): key for key, (w, _) in busy.items()}
        done, _ = ray.wait(list(asks), num_returns=len(asks), timeout=min(10.0, self.poll_s))
        stuck = {key: 0.0 for key in busy}
        for ref in done:
            try:
                stuck[asks[ref]] = ray.get(ref)
                self.answered[asks[ref]] = now
            except Exception:
                pass  # restarting: Ray retries its shard
        killed = 0
        for key, (w, shard) in busy.items():
            silent = now - self.answered.setdefault(key, now)
            if stuck[key] > self.timeout_s or silent > 4 * self.timeout_s:
                why = f"made no progress for {stuck[key]:.0f}s" if stuck[key] else f"did not answer for {silent:.0f}s"
                self.say(f"specbatch: a worker {why} on shard {shard.index} (resources.shard_timeout_s); "
                         "restarting it, the shard is retried")
                ray.kill(w, no_restart=False)
                self.answered[key] = now
                killed += 1
        return killed


def cause(exc: BaseException) -> str:
    """The last line of a Ray error: the worker's own exception."""
    text = str(exc).strip().splitlines()
    tail = [t for t in text if t.strip()][-1:] or [type(exc).__name__]
    return tail[0][:300]
