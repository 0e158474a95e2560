"""The job's workers on Ray: the worker actors (a placement group each for a tensor-parallel target) as an
elastic pool that follows the cluster's nodes, and the watchdog that restarts a worker that stopped making
progress.
"""

from __future__ import annotations

import math
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

from workers import loading
from workers.spec import WorkerSpec

from .manifest import JobError

NODE_POLL_S = 1.0  # how often the pool looks at the cluster's nodes and free resources
WAIT_SAY_S = 30.0  # how long workers may wait for room before the driver says so (and again every so often)
STAGE_LINES = 4  # placed workers loading whose stages are said one by one; more are counted by stage


@dataclass(eq=False)
class Member:
    """A worker actor of the pool: `ready` is its constructor's answer to wait for (None once it has loaded its
    models); `node` and `name` (host:pid) are those of its current process; `key` is where it tells its loading
    stages (workers/loading.py), `said` the last one the driver said."""

    actor: Any
    group: Any  # its placement group's scheduling strategy (tensor parallel), else None
    ready: Any
    node: str | None = None
    name: str | None = None
    key: str | None = None
    said: tuple | None = None


class Pool:
    """The job's worker actors, each loading its models once and then serving shards. Restarts are unlimited,
    and each call is retried `resources.max_retries` times when its process dies (jobs/driver.py).

    Elastic between `resources.num_workers`' (min, max): `top_up` starts workers up to max (those not placed yet
    wait: demand an autoscaler sees), or, for `auto`, as many as the free resources fit; `placed` returns those
    that have loaded their models; `lost` ends the workers of nodes that left the cluster, whose restarts could
    wait forever, so that their shards go to the others."""

    def __init__(self, spec: WorkerSpec, env: dict[str, str], say=print):
        import ray

        from workers.worker import GenerationWorker

        res = spec.resources
        self.spec, self.say = spec, say
        self.limits = res.worker_limits()
        if spec.models.target.tensor_parallel > 1 and res.gpus_per_worker > 0:  # ranks bind themselves (workers/group.py)
            env = {**env, "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
        self.actor = ray.remote(GenerationWorker)
        self.options = dict(num_cpus=res.cpus_per_worker, num_gpus=res.gpus_per_worker, max_restarts=-1,
                            max_task_retries=res.max_retries, max_concurrency=2, runtime_env={"env_vars": env})
        ranks = spec.models.target.tensor_parallel
        self.shape = {k: v * ranks for k, v in (("CPU", res.cpus_per_worker), ("GPU", res.gpus_per_worker)) if v}
        self.members: list[Member] = []
        self.started = self.loaded = 0  # workers started, and those that loaded their models (replacements included)
        self.nodes = self._alive_nodes()
        self.lost_nodes: set[str] = set()  # nodes that left the cluster while the job ran
        self.checked = time.monotonic()
        self.waiting_since: float | None = None
        self.key = f"{uuid.uuid4().hex}/"  # this pool's workers tell their loading stages under it
        self.counted: tuple = ()  # the stage counts said last (more than STAGE_LINES workers loading)

    def live(self) -> list[Member]:
        return [m for m in self.members if m.ready is None]

    def start(self, n: int) -> None:
        """Start n workers, without waiting for them (`placed` returns them once they have loaded their models)."""
        for _ in range(max(0, n)):
            group = self._placement()
            actor = self.actor.options(**self.options, **({"scheduling_strategy": group} if group else {}))
            key = f"{self.key}{self.started}"
            actor = actor.remote(self.spec, key)
            self.members.append(Member(actor, group, actor.ready.remote(), key=key))
            self.started += 1

    def top_up(self, work: int) -> None:
        """Start workers for `work` shards (to do and in flight): up to max; for `auto`, once every started one is
        placed, as many more as the cluster's free resources fit (at least `min`)."""
        lo, hi = self.limits
        if hi is None:
            if any(m.ready is not None for m in self.members):
                return
            hi = max(lo, len(self.members) + self.room())
        self.start(min(hi, work) - len(self.members))

    def room(self) -> int:
        """How many more workers the cluster's free resources fit (summed over nodes: a tensor-parallel group that
        needs one node with room for all its ranks may still wait)."""
        import ray

        free = ray.available_resources()
        return min((math.floor(free.get(k, 0) / v + 1e-9) for k, v in self.shape.items()), default=0)

    def placed(self, timeout: float = 0.0) -> list[Member]:
        """The workers that finished loading their models since the last call (waiting up to `timeout` for one);
        raises JobError, with the cause, for a worker whose constructor failed (a bad model, a config that does
        not fit): that is no fault a restart mends."""
        import ray
        from ray.exceptions import RayActorError, RayError

        pending = {m.ready: m for m in self.members if m.ready is not None}
        if not pending:
            return []
        done, _ = ray.wait(list(pending), num_returns=1, timeout=timeout)
        done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0) if done else (done, None)
        new = []
        for ref in done:
            m = pending[ref]
            try:
                info = ray.get(ref)
            except RayActorError as exc:
                if "creation task" in str(exc):  # its constructor raised: Ray does not restart it
                    raise JobError(f"a worker failed to start: {cause(exc)}") from None
                continue  # dropped while loading (`lost`)
            except RayError as exc:
                raise JobError(f"a worker failed to start: {cause(exc)}") from None
            m.ready, m.node, m.name = None, info["node"], info["name"]
            if m.group is not None:
                layout = ray.get(m.actor.group_layout.remote())
                self.say(f"specbatch: worker {m.name}: {describe_group(layout)}")
            new.append(m)
        self.loaded += len(new)
        return new

    def wait_for(self, n: int) -> list[Member]:
        """Wait until n workers have loaded their models (saying so while they wait for room); returns them."""
        t0 = time.monotonic()
        while len(self.live()) < n:
            self.placed(timeout=NODE_POLL_S)
            self.say_waiting(t0)
        return self.live()

    def say_waiting(self, since: float) -> None:
        """Say what the workers that have not loaded their models yet are doing: a placed one its loading stage
        as it changes (on which node, seconds since it started; counts by stage when more than STAGE_LINES load),
        and, every WAIT_SAY_S, how many wait for a node with room (those that have told no stage)."""
        import ray

        pending = [m for m in self.members if m.ready is not None]
        stages = loading.read(self.key) if pending else {}
        if stages is None:  # the store did not answer: say nothing rather than call placed workers unplaced
            return
        placed = [(m, stages[m.key]) for m in pending if m.key in stages]
        if len(placed) <= STAGE_LINES:
            for m, st in placed:
                if m.said != (st["name"], st["stage"]):
                    m.said = (st["name"], st["stage"])
                    self.say(f"specbatch: worker {st['name']} on node {st['node']}: {st['stage']} "
                             f"({st['elapsed_s']:.0f}s since it started)")
        else:
            counts = tuple(sorted(Counter(st["stage"] for _, st in placed).items()))
            if counts != self.counted:
                self.counted = counts
                self.say(f"specbatch: {len(placed)} workers loading: " + ", ".join(f"{n} {s}" for s, n in counts))
        now = time.monotonic()
        waiting = len(pending) - len(placed)
        if not waiting or now - since < WAIT_SAY_S or now - (self.waiting_since or 0) < WAIT_SAY_S:
            return
        self.waiting_since = now
        ranks = self.spec.models.target.tensor_parallel
        bundle = {k: v / ranks for k, v in self.shape.items()}
        self.say(f"specbatch: {waiting} of {len(self.members)} workers wait for a node with room for "
                 f"{f'{ranks} x ' if ranks > 1 else ''}{bundle} (cluster now: {ray.cluster_resources()})...")

    def lost(self) -> list[Member]:
        """The workers on nodes that left the cluster since the last look (at most every NODE_POLL_S), and those not
        placed yet (they may have been waiting on such a node), ended and out of the pool."""
        now = time.monotonic()
        if now - self.checked < NODE_POLL_S:
            return []
        self.checked = now
        alive = self._alive_nodes()
        gone, self.nodes = self.nodes - alive, alive
        if not gone:
            return []
        self.lost_nodes |= gone
        dropped = [m for m in self.members if m.node in gone or m.ready is not None]
        for m in dropped:
            self._end(m)
        self.members = [m for m in self.members if m not in dropped]
        return dropped

    def close(self) -> None:
        for m in self.members:
            self._end(m)
        self.members = []
        loading.clear(self.key)

    @staticmethod
    def _alive_nodes() -> set[str]:
        import ray

        return {n["NodeID"] for n in ray.nodes() if n["Alive"]}

    @staticmethod
    def _end(m: Member) -> None:
        import ray

        try:
            ray.kill(m.actor, no_restart=True)
        except Exception:
            pass
        if m.group is not None:
            ray.util.remove_placement_group(m.group.placement_group)

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


def describe_group(layout: list[dict]) -> str:
    """'2 tensor-parallel ranks on node 10.0.0.5: rank 0 GPU 0 (1.2 GiB of weights), ...'."""
    nodes = sorted({r["node"] for r in layout})
    ranks = ", ".join(f"rank {r['rank']} {'GPU ' + ','.join(r['gpus']) if r['gpus'] else 'CPU'} "
                      f"({r['weight_bytes'] / (1 << 30):.2f} GiB of weights)" for r in layout)
    nccl = " ".join(f"{k}={v}" for k, v in sorted(layout[0].get("nccl", {}).items())
                    if all(r.get("nccl", {}).get(k) == v for r in layout))
    return f"{len(layout)} tensor-parallel ranks on node {', '.join(nodes)}: {ranks}" + (f"; every rank has {nccl}"
                                                                                         if nccl else "")


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
        """Ask the busy workers (`inflight`: result ref -> (Member, shard, ...)) how long since their last progress,
        at most every `poll_s`; returns how many it killed."""
        import ray

        now = time.monotonic()
        if not self.timeout_s or now - self.last_check < self.poll_s:
            return 0
        self.last_check = now
        busy = {id(m.actor): (m.actor, s) for m, s, *_ in inflight.values()}
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
