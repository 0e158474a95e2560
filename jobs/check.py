"""`specbatch check`: a preflight of a cluster (or this machine) for a job, before trusting it with one.

On every node, the job's model sources resolve; then workers of the job's shape (its resources, its
tensor-parallel group) start, up to one per node and `num_workers`, and each checks its device, dtype,
the weights' fit against the memory plan, one step on each path compared with eager (or, tensor-parallel,
one lock-step call and the all-reduce's bandwidth) and the output prefix's storage (specdec/exec/preflight.py,
workers/preflight.py). Checks that need a GPU say "n/a (no GPU)" on CPU. Nothing is written to the output
but a probe object, deleted after; the workers' own logs, and Ray's own lines in this process (its warnings),
go to the local cache folder.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections import deque

from specdec.exec.preflight import row

from .manifest import JobError
from .spec import ConfigError, JobSpec


def run_check(spec: JobSpec | None, address: str | None = None, log_level: str = "warning") -> list[dict]:
    """The checks' rows, each with `where` (a node, a worker, or the driver). Without a job's spec, only the
    cluster and its nodes' devices."""
    import ray

    from workers.fetch import cache_dir
    from workers.preflight import storage_probe

    from .driver import check_models, worker_logs_dir
    from .ray_session import init_ray, ray_log_to

    address = address or os.environ.get("RAY_ADDRESS") or None
    try:
        if spec is not None:
            check_models(spec, cluster=bool(address))
    except ConfigError as exc:
        return [{"where": "driver", **row("models", str(exc), False)},
                {"where": "driver", **storage_probe(spec.output.path)}]
    logs = worker_logs_dir(spec, in_output=False) if spec is not None else str(cache_dir() / "logs" / "check")
    with contextlib.ExitStack() as stack:
        stack.enter_context(ray_log_to(os.path.join(logs, "driver-ray.log")))
        if init_ray(address, log_level):
            stack.callback(ray.shutdown)
        return _checks(spec, address, log_level, logs)


def _checks(spec: JobSpec | None, address: str | None, log_level: str, logs: str) -> list[dict]:
    """The cluster's and its nodes' checks, then (with a spec) those of workers of the job's shape, on the Ray
    this process has joined; the workers' own output goes to `logs` (a check leaves the output as it found it)."""
    import ray

    from .driver import Job, launch

    nodes = [n for n in ray.nodes() if n["Alive"]]
    res = ray.cluster_resources()
    out = [{"where": "cluster", **row("ray", f"{len(nodes)} node(s), {res.get('CPU', 0):g} CPUs, "
                                      f"{res.get('GPU', 0):g} GPUs", True)}]
    out += _node_checks(spec, nodes)
    if spec is None or failures(out):
        return out
    most = spec.resources.worker_limits()[1]  # None: `auto`
    workers = min(most or len(nodes), len(nodes))
    job = Job(spec, None, {}, None, deque(range(workers)), 0, 0.0)
    job.worker_logs = logs
    try:  # the workers' loading stages go to stderr, the table to stdout
        with launch(job, address, log_level, say=lambda text: print(text, file=sys.stderr, flush=True)) as pool:
            for m in pool.wait_for(workers):
                out += [{"where": m.name, **r} for r in ray.get(m.actor.check.remote())]
    except JobError as exc:
        out.append({"where": "cluster", **row("worker start", str(exc), False)})
    return out


def _node_checks(spec: JobSpec | None, nodes: list[dict]) -> list[dict]:
    """Every node's devices and, with a spec, its model sources' resolution (a task pinned there, asking for no
    resources, seeing the node's every GPU)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from workers.preflight import node_checks

    task = ray.remote(node_checks)
    refs = {n["NodeManagerAddress"]: task.options(
        num_cpus=0, runtime_env={"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}},
        scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(
        spec.models if spec else None, spec.speculation if spec else None) for n in nodes}
    return [{"where": f"node {node}", **r} for node, ref in refs.items() for r in ray.get(ref)]


def failures(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["ok"] is False]


def table(rows: list[dict]) -> str:
    """The rows as a plain-text table: where, check, status (ok, FAIL, n/a), result."""
    status = {True: "ok", False: "FAIL", None: "n/a"}
    lines = [(r["where"], r["check"], status[r["ok"]], r["result"]) for r in rows]
    widths = [max(len(x[i]) for x in [("where", "check", "status", "")] + lines) for i in range(3)]
    head = ("where", "check", "status", "result")
    return "\n".join("  ".join(x[i].ljust(widths[i]) for i in range(3)) + "  " + x[3] for x in [head] + lines)
