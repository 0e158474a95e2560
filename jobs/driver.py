"""The job driver: scan the input, hand shards to long-lived worker actors, commit, resume, report.

Exactly-once: a shard's rows are fixed by the input, its part is committed create-only under a name
made from the shard number, and a re-run skips every part already present. A worker that dies costs
its shard a retry on a fresh worker (bounded by resources.max_retries), never a row.
"""

from __future__ import annotations

import io
import json
import logging
import os
import sys
import time
from collections import deque

import pyarrow.parquet as pq

from workers.inputs import Shard, scan
from workers.storage import is_s3, open_storage

from .spec import JobSpec, changed_keys

log = logging.getLogger("specbatch")

MANIFEST, SUCCESS = "_manifest.json", "_SUCCESS"


class JobError(RuntimeError):
    """The job cannot go on (conflicting output, a shard out of retries, workers that cannot start)."""


def _absolute(spec: JobSpec) -> JobSpec:
    """Local paths made absolute, so workers in other folders find them."""
    data = spec.model_dump(mode="json")

    def fix(section: dict, key: str):
        v = section.get(key)
        if v and not is_s3(v) and not v.startswith("pypi:") and os.path.exists(v):
            section[key] = os.path.abspath(v)

    fix(data["input"], "path")
    if not is_s3(data["output"]["path"]):
        data["output"]["path"] = os.path.abspath(data["output"]["path"])
    fix(data["models"]["target"], "path")
    if data["models"].get("draft"):
        fix(data["models"]["draft"], "path")
    head = data["speculation"].get("acceptance_head")
    if head:
        fix(head, "path")
    return JobSpec.model_validate(data)


def _part_info(storage, name: str) -> dict:
    import hashlib

    data = storage.read_bytes(name)
    return {"rows": pq.ParquetFile(io.BytesIO(data)).metadata.num_rows, "sha256": hashlib.sha256(data).hexdigest()}


def _clear(storage) -> None:
    for name in storage.list():
        if name in (MANIFEST, SUCCESS) or (name.startswith("part-") and name.endswith(".parquet")):
            storage.delete(name)


def prepare_output(spec: JobSpec, storage, shards: list[Shard], total: int, overwrite: bool) -> dict:
    """The manifest for this run: refuses an output holding a different job unless overwrite."""
    raw = storage.read_bytes(MANIFEST)
    if raw is not None:
        old = json.loads(raw)
        if overwrite:
            _clear(storage)
        elif old.get("fingerprint") != spec.fingerprint():
            changed = changed_keys(old.get("spec", {}), spec.model_dump(mode="json"))
            raise JobError(
                f"{storage.uri('')} holds the outputs of a different job config (changed: {', '.join(changed) or '?'}); "
                "re-run with --overwrite to discard them, or choose another output.path")
    elif overwrite:
        _clear(storage)
    parts = {}
    committed = {n for n in storage.list("part-") if n.endswith(".parquet")}
    if raw is not None and not overwrite:
        parts = {k: v for k, v in json.loads(raw).get("parts", {}).items() if k in committed}
    for name in sorted(committed - set(parts)):  # committed after the last manifest update
        parts[name] = _part_info(storage, name)
    return {
        "name": spec.name,
        "fingerprint": spec.fingerprint(),
        "spec": spec.model_dump(mode="json"),
        "input": {"rows": total, "files": sorted({s.file for s in shards})},
        "num_shards": len(shards),
        "parts": parts,
    }


def _init_ray(address: str | None) -> bool:
    """Join a cluster (address or RAY_ADDRESS) or start an embedded local one; True if we started it."""
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or None
    kwargs = dict(include_dashboard=False, logging_level=logging.WARNING, log_to_driver=True)
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
        self.tokens = self.rounds = self.drafted = self.accepted = self.rows = self.failed = 0
        self.peaks: dict[str, int] = {}  # peak GPU memory per worker
        self.paths: set[str] = set()  # how workers ran their steps

    def add(self, res: dict) -> None:
        self.rows += res["rows"]
        self.paths.add(res["step_path"])
        if res["peak_gpu_bytes"] is not None:
            self.peaks[res["worker"]] = max(self.peaks.get(res["worker"], 0), res["peak_gpu_bytes"])
        self.failed += res["failed"]
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


def run_job(spec: JobSpec, address: str | None = None, overwrite: bool = False, progress: bool = True) -> dict:
    """Run (or resume) a job to completion; returns the summary."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayError

    from workers.worker import GenerationWorker

    spec = _absolute(spec)
    storage = open_storage(spec.output.path)
    shards, total = scan(spec.input.path, spec.input.id_column, spec.resources.shard_size)
    manifest = prepare_output(spec, storage, shards, total, overwrite)
    storage.put(MANIFEST, json.dumps(manifest, indent=2).encode())
    todo = deque(s for s in shards if s.part not in manifest["parts"])
    done_rows = sum(p["rows"] for p in manifest["parts"].values())
    prog = _Progress(total, done_rows, progress)
    if not todo:
        prog.close()
        storage.put(SUCCESS, b"")
        return _summary(manifest, prog, resumed=done_rows, ran=0)

    started = _init_ray(address)
    res = spec.resources
    gpus = spec.gpus_per_worker(ray.cluster_resources().get("GPU", 0))
    actor_cls = ray.remote(GenerationWorker).options(num_cpus=res.cpus_per_worker, num_gpus=gpus,
                                                     max_restarts=0, max_concurrency=1)
    fault = os.environ.get("SPECBATCH_FAULT_EXIT_ONCE")  # test hook: a worker dies mid-shard once
    spec_data = spec.worker_spec(gpus).model_dump(mode="json")

    def new_worker():
        return actor_cls.remote(spec_data, fault)

    attempts: dict[int, int] = {}
    workers = [new_worker() for _ in range(min(res.num_workers, len(todo)))]
    try:
        for w in workers:  # fail fast, with the cause, when workers cannot even start
            try:
                ray.get(w.ready.remote())
            except RayError as exc:
                raise JobError(f"a worker failed to start: {_cause(exc)}") from None
        inflight = {}
        for w in workers:
            if todo:
                s = todo.popleft()
                inflight[w.process.remote(s.to_dict())] = (w, s)
        while inflight:
            ready, _ = ray.wait(list(inflight), num_returns=1)
            ref = ready[0]
            w, shard = inflight.pop(ref)
            try:
                out = ray.get(ref)
            except (RayActorError, RayError, GetTimeoutError) as exc:
                attempts[shard.index] = attempts.get(shard.index, 0) + 1
                if attempts[shard.index] > res.max_retries:
                    raise JobError(f"shard {shard.index} ({shard.part}) failed {attempts[shard.index]} times; "
                                   f"last error: {_cause(exc)}") from None
                prog.bar.write(f"specbatch: shard {shard.index} failed ({_cause(exc)}); retrying "
                               f"({attempts[shard.index]}/{res.max_retries})")
                todo.appendleft(shard)
                if isinstance(exc, RayActorError):  # the worker is gone: replace it
                    ray.kill(w, no_restart=True)
                    w = new_worker()
                    workers.append(w)
            else:
                manifest["parts"][out["part"]] = {"rows": out["rows"], "sha256": out["sha256"]}
                storage.put(MANIFEST, json.dumps(manifest, indent=2).encode())
                prog.add(out)
            if todo:
                s = todo.popleft()
                inflight[w.process.remote(s.to_dict())] = (w, s)
    finally:
        prog.close()
        for w in workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:
                pass
        if started:
            ray.shutdown()
    missing = [s.part for s in shards if not storage.exists(s.part)]
    if missing:
        raise JobError(f"parts missing after the run: {missing[:5]}")
    storage.put(SUCCESS, b"")
    return _summary(manifest, prog, resumed=done_rows, ran=prog.rows)


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
        "rows_failed_this_run": prog.failed,
        "generated_tokens": prog.tokens,
        "tokens_per_s": prog.tokens / dt if dt > 0 else 0.0,
        "mean_accepted_length": prog.tokens / prog.rounds if prog.rounds else None,
        "acceptance_rate": prog.accepted / prog.drafted if prog.drafted else None,
        "wall_s": dt,
        "parts": len(manifest["parts"]),
        "step_path": ",".join(sorted(prog.paths)) or None,
        "peak_gpu_gib_per_worker": {w: round(b / (1 << 30), 2) for w, b in sorted(prog.peaks.items())},
    }
