"""The job driver: scan the input, hand shards to long-lived worker actors, commit, resume, report.

Exactly-once: a shard's rows are fixed by the input, its part is committed create-only under a name
made from the shard number, and a re-run skips every part already present.

Faults are Ray's to handle: workers are actors with unlimited restarts, and every call to one is
retried up to `resources.max_retries` times if its process dies (SIGKILL, a lost node, a preemption),
whether it was loading its models or halfway through a shard: Ray starts the process again, the
constructor loads the models again, and the call runs again (a retried shard whose part was already
committed returns that part). The driver adds what Ray cannot see: a worker that makes no progress
for `resources.shard_timeout_s` is killed, which Ray then treats as any other death. A Python error in
a worker (a bad model path, a permanent storage error) is not retried: it stops the job with its cause.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections import Counter, deque

from workers.inputs import scan
from workers.outputs import OPENAI_DIR, commit_jsonl, jsonl_name
from workers.storage import is_s3, open_storage

from .manifest import MANIFEST, PART_KEYS, SUCCESS, JobError, error_counts, prepare_output
from .spec import ConfigError, JobSpec

log = logging.getLogger("specbatch")

# the manifest is rewritten at most this often (a resume re-reads the parts committed since, from the parts)
MANIFEST_EVERY_S = 10.0


def _models(spec: JobSpec) -> list:
    """(config key, source) of the models the workers load."""
    out = [("models.target.path", spec.models.target)]
    if spec.speculation.method == "draft_model" and spec.models.draft is not None:
        out.append(("models.draft.path", spec.models.draft))
    return out


def check_models(spec: JobSpec, cluster: bool = False) -> None:
    """Refuse, naming the key, a model path that is nothing: no local folder here, and not `pypi:`, `s3://` or
    a Hub id `ORG/NAME`. On a cluster an absolute path missing here may be the nodes' own (a shared folder):
    the workers check it there."""
    from workers.fetch import ModelPathError, check_path

    for key, src in _models(spec):
        if cluster and os.path.isabs(os.path.expanduser(src.path)):
            continue
        try:
            check_path(src.path, key)
        except ModelPathError as exc:
            raise ConfigError(str(exc)) from None




def is_control(index: int, fraction: float) -> bool:
    """Whether shard `index` is a control shard: evenly spaced, `fraction` of all shards, the same on every run."""
    return int((index + 1) * fraction) > int(index * fraction)


def worker_logs_dir(spec: JobSpec) -> str:
    """Where workers write their own output: `_logs/` in a local output folder, else a local cache folder
    (on a cluster: that folder on each worker's node)."""
    if not is_s3(spec.output.path):
        return os.path.join(os.path.abspath(spec.output.path), "_logs")
    from workers.fetch import cache_dir

    return str(cache_dir() / "logs" / f"{spec.name}-{spec.fingerprint()[:8]}")


def _init_ray(address: str | None, level: str = "warning", verbose: bool = False) -> bool:
    """Join a cluster (address or RAY_ADDRESS) or start an embedded local one; True if we started it."""
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or None
    kwargs = dict(include_dashboard=False, logging_level=getattr(logging, level.upper()), log_to_driver=verbose)
    if address:
        ray.init(address=address, **kwargs)
    else:
        ray.init(num_cpus=os.cpu_count(), **kwargs)
    return True


class _Progress:
    def __init__(self, total: int, done: int, enabled: bool):
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=done, unit="row", disable=not enabled, file=sys.stderr,
                        dynamic_ncols=True, desc="specbatch")
        self.t0 = time.perf_counter()
        self.tokens = self.rounds = self.drafted = self.accepted = self.rows = 0
        self.errors: Counter[str] = Counter()  # error rows by reason
        self.peaks: dict[str, int] = {}  # peak GPU memory per worker
        self.paths: set[str] = set()  # how workers ran their steps
        self.workers: set[str] = set()  # worker processes that committed parts (restarts are new ones)
        self.hangs = 0

    def add(self, res: dict) -> None:
        self.rows += res["rows"]
        self.paths.add(res["step_path"])
        self.workers.add(res["worker"])
        if res["peak_gpu_bytes"] is not None:
            self.peaks[res["worker"]] = max(self.peaks.get(res["worker"], 0), res["peak_gpu_bytes"])
        self.errors.update(res["errors"])
        self.tokens += res["generated_tokens"]
        self.rounds += res["rounds"]
        self.drafted += res["drafted_tokens"]
        self.accepted += res["accepted_tokens"]
        self.bar.update(res["rows"])
        self.bar.set_postfix(self.figures(), refresh=False)

    def figures(self) -> dict:
        dt = max(1e-9, time.perf_counter() - self.t0)
        out = {"tok/s": f"{self.tokens / dt:.1f}"}
        if self.drafted:
            out["accept"] = f"{self.accepted / self.drafted:.2f}"
        return out

    def close(self) -> None:
        self.bar.close()


def run_job(spec: JobSpec, address: str | None = None, overwrite: bool = False, progress: bool = True,
            log_level: str = "warning", verbose: bool = False) -> dict:
    """Run (or resume) a job to completion; returns the summary. Unless `verbose`, the workers' own output
    (model loading, conversion progress, Ray's task messages) goes to log files (`worker_logs`)."""
    import ray
    from ray.exceptions import RayActorError, RayError, RayTaskError

    from workers.worker import GenerationWorker

    check_models(spec, cluster=bool(address or os.environ.get("RAY_ADDRESS")))
    storage = open_storage(spec.output.path)
    shards, total = scan(spec.input.path, spec.input.key_column, spec.resources.shard_size)
    manifest = prepare_output(spec, storage, shards, total, shards.files, overwrite)
    storage.put(MANIFEST, json.dumps(manifest, indent=2).encode())
    todo = deque(s for s in shards if s.part not in manifest["parts"])
    done_rows = sum(p["rows"] for p in manifest["parts"].values())
    prog = _Progress(total, done_rows, progress)
    if not todo:
        prog.close()
        storage.put(SUCCESS, b"")
        return _summary(manifest, prog, resumed=done_rows, ran=0)

    started = _init_ray(address, log_level, verbose)
    logs_dir = None if verbose else worker_logs_dir(spec)
    if started:  # an embedded Ray: the workers share this machine's cache, so fetch here, where it is seen
        from workers.fetch import ModelPathError, localize

        try:
            for key, source in _models(spec):
                localize(source, key)
        except BaseException as exc:
            prog.close()
            ray.shutdown()
            if isinstance(exc, ModelPathError):
                raise ConfigError(str(exc)) from None
            raise
    res = spec.resources
    worker = spec.worker_spec(ray.cluster_resources().get("GPU", 0))  # the job's sections, GPUs resolved
    gpus = worker.resources.gpus_per_worker
    # restarts are unlimited; each call is retried max_retries times when its process dies (see the docstring)
    env = {k: v for k, v in os.environ.items() if k.startswith("SPECBATCH_")}  # the cache folder, test hooks
    env["SPECBATCH_LOG_LEVEL"] = log_level
    if logs_dir:
        env["SPECBATCH_WORKER_LOGS"] = logs_dir
    actor_cls = ray.remote(GenerationWorker)
    options = dict(num_cpus=res.cpus_per_worker, num_gpus=gpus, max_restarts=-1, max_task_retries=res.max_retries,
                   max_concurrency=2, runtime_env={"env_vars": env})
    groups = [_placement(spec, gpus) for _ in range(min(res.num_workers, len(todo)))]  # tensor parallel only
    _wait_for_groups(groups, spec)
    workers = [actor_cls.options(**options, **({"scheduling_strategy": g} if g else {})).remote(worker)
               for g in groups]
    inflight: dict = {}  # result ref -> (worker, shard)
    try:
        for w in workers:  # fail fast, with the cause, when workers cannot start at all
            try:
                ray.get(w.ready.remote())
            except RayError as exc:
                raise JobError(f"a worker failed to start: {_cause(exc)}") from None
        for i, w in enumerate(workers):
            layout = ray.get(w.group_layout.remote())
            if layout:
                prog.bar.write(f"specbatch: worker {i}: {describe_group(layout)}", file=sys.stderr)

        def submit(w) -> None:
            if todo:
                shard = todo.popleft()
                control = is_control(shard.index, spec.speculation.control_fraction)
                inflight[w.process.remote({**shard.to_dict(), "control": control})] = (w, shard)

        for w in workers:
            submit(w)
        watch = _Watchdog(res.shard_timeout_s)
        last_write = time.monotonic()
        while inflight:
            ready, _ = ray.wait(list(inflight), num_returns=1, timeout=watch.poll_s)
            prog.hangs += watch.check(inflight, prog)
            if not ready:
                continue
            ref = ready[0]
            w, shard = inflight.pop(ref)
            try:
                out = ray.get(ref)
            except RayTaskError as exc:  # a Python error in the worker: deterministic, not retried
                raise JobError(f"shard {shard.index} ({shard.part}) failed: {_cause(exc)}") from None
            except (RayActorError, RayError) as exc:
                raise JobError(f"shard {shard.index} ({shard.part}) failed {res.max_retries + 1} times "
                               f"(resources.max_retries); last error: {_cause(exc)}") from None
            manifest["parts"][out["part"]] = {k: out[k] for k in PART_KEYS}
            if time.monotonic() - last_write > MANIFEST_EVERY_S:  # not per part: that is quadratic in parts
                storage.put(MANIFEST, json.dumps(manifest).encode())
                last_write = time.monotonic()
            prog.add(out)
            submit(w)
    finally:
        prog.close()
        for w in workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:
                pass
        for g in groups:
            if g is not None:
                ray.util.remove_placement_group(g.placement_group)
        if started:
            ray.shutdown()
    manifest["wall_s"] += time.perf_counter() - prog.t0
    storage.put(MANIFEST, json.dumps(manifest).encode())
    missing = [s.part for s in shards if s.part not in manifest["parts"]]
    if missing:
        raise JobError(f"parts missing after the run: {missing[:5]}")
    if spec.output.format == "openai_batch":  # a worker may have died between a part and its JSONL
        have = set(storage.list(OPENAI_DIR))
        for part in manifest["parts"]:
            if jsonl_name(part) not in have:
                commit_jsonl(storage, part, storage.read_bytes(part), spec.models.target.path)
    storage.put(SUCCESS, b"")
    return {**_summary(manifest, prog, resumed=done_rows, ran=prog.rows), "worker_logs": logs_dir}


def _placement(spec: JobSpec, gpus: float):
    """For a tensor-parallel target: a placement group of one bundle per rank ({CPU: cpus_per_worker, GPU:
    gpus_per_worker}), packed on one node, and the strategy that puts the worker (rank 0) in bundle 0.
    None for a target in one process."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    ranks = spec.models.target.tensor_parallel
    if ranks == 1:
        return None
    bundle = {"CPU": spec.resources.cpus_per_worker, **({"GPU": gpus} if gpus else {})}
    group = placement_group([bundle] * ranks, strategy="STRICT_PACK", name="")
    return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)


def _wait_for_groups(groups: list, spec: JobSpec) -> None:
    """Say so when the placement groups are not all placed within 30 s (the cluster has no node with room for a
    whole group yet: an autoscaler may be adding one); the workers start when they are."""
    import ray

    placed = [g.placement_group for g in groups if g is not None]
    if not placed:
        return
    ready, _ = ray.wait([g.ready() for g in placed], num_returns=len(placed), timeout=30)
    if len(ready) < len(placed):
        ranks, bundle = spec.models.target.tensor_parallel, placed[0].bundle_specs[0]
        print(f"specbatch: {len(placed) - len(ready)} of {len(placed)} workers wait for a node with room for "
              f"{ranks} x {bundle} (models.target.tensor_parallel {ranks}; cluster: {ray.cluster_resources()})...",
              file=sys.stderr, flush=True)


def describe_group(layout: list[dict]) -> str:
    """'2 tensor-parallel ranks on node 10.0.0.5: rank 0 GPU 0 (1.2 GiB of weights), ...'."""
    nodes = sorted({r["node"] for r in layout})
    ranks = ", ".join(f"rank {r['rank']} {'GPU ' + ','.join(r['gpus']) if r['gpus'] else 'CPU'} "
                      f"({r['weight_bytes'] / (1 << 30):.2f} GiB of weights)" for r in layout)
    return f"{len(layout)} tensor-parallel ranks on node {', '.join(nodes)}: {ranks}"


class _Watchdog:
    """Kills a worker that reports no progress (no round's tokens, no shard started) for `timeout_s`, or that
    has not answered at all for 4 x `timeout_s` (a process hung inside native code; a restarting worker,
    still loading its models, does not answer either): Ray then restarts it and retries its shard."""

    def __init__(self, timeout_s: float | None):
        self.timeout_s = timeout_s
        self.poll_s = min(30.0, timeout_s / 4) if timeout_s else None
        self.last_check = time.monotonic()
        self.answered: dict[int, float] = {}  # worker -> when it last answered

    def check(self, inflight: dict, prog: _Progress) -> int:
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
                prog.bar.write(f"specbatch: a worker {why} on shard {shard.index} (resources.shard_timeout_s); "
                               "restarting it, the shard is retried")
                ray.kill(w, no_restart=False)
                self.answered[key] = now
                killed += 1
        return killed


def _cause(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    tail = [t for t in text if t.strip()][-1:] or [type(exc).__name__]
    return tail[0][:300]


def _summary(manifest: dict, prog: _Progress, resumed: int, ran: int) -> dict:
    dt = time.perf_counter() - prog.t0
    return {
        "rows_total": manifest["input"]["rows"],
        "rows_committed": sum(p["rows"] for p in manifest["parts"].values()),
        "rows_from_earlier_runs": resumed,
        "rows_this_run": ran,
        "rows_failed_this_run": sum(prog.errors.values()),
        "errors_by_reason": error_counts(manifest),
        "worker_processes": len(prog.workers),
        "workers_killed_for_no_progress": prog.hangs,
        "generated_tokens": prog.tokens,
        "tokens_per_s": prog.tokens / dt if dt > 0 else 0.0,
        "mean_accepted_length": prog.tokens / prog.rounds if prog.rounds else None,
        "acceptance_rate": prog.accepted / prog.drafted if prog.drafted else None,
        "wall_s": dt,
        "parts": len(manifest["parts"]),
        "step_path": ",".join(sorted(prog.paths)) or None,
        "peak_gpu_gib_per_worker": {w: round(b / (1 << 30), 2) for w, b in sorted(prog.peaks.items())},
    }
