"""Jobs on a real multi-node Ray cluster on this machine (ray.cluster_utils: a head and worker nodes, each its own
raylet), joined with `--address`: worker nodes removed without warning mid-job (raylet and all its processes
killed), with and without a replacement, and a node added mid-job. Every row comes out exactly once, with the
tokens of an uninterrupted run.

Each worker node has one CPU and the head none, so each node holds exactly one worker (cpus_per_worker 1).
Workers stop at a gate (workers/faults.py) with a shard generated but not committed until the test releases
them, so "mid-job" is a fixed point of the job, not a moment that depends on the machine's speed."""

from __future__ import annotations

import json
import threading
import time

import psutil
import pytest

from job_helpers import config, read_out, rows_of, run_cli

ROWS = 24


@pytest.fixture(scope="module")
def cluster():
    """A head (no CPU: the drivers' node) and two worker nodes of one CPU each; GCS notices a dead node in ~1.5s."""
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=0, include_dashboard=False,
        _system_config={"health_check_period_ms": 500, "health_check_failure_threshold": 3,
                        "health_check_initial_delay_ms": 0}))
    for _ in range(2):
        c.add_node(num_cpus=1)
    c.wait_for_nodes()
    yield c
    c.shutdown()


def job(tmp_path, tiny_pair, **over):
    over = {"resources__num_workers": {"min": 1, "max": 3}, "resources__cpus_per_worker": 1, **over}
    return config(tmp_path, tiny_pair, rows_of(ROWS), generation__max_new_tokens=16, resources__shard_size=3, **over)


def run(path, address, *extra) -> dict:
    proc = run_cli(path, "--address", address, "--json", *extra)
    log = proc.communicate(timeout=500)[0]
    assert proc.returncode == 0, log
    return summary_of(log)


def summary_of(log: str) -> dict:
    """The summary the CLI prints with --json (its last line that is a JSON object)."""
    return json.loads([line for line in log.splitlines() if line.startswith("{")][-1])


def parts_nodes(out) -> dict[str, str]:
    manifest = json.loads((out / "_manifest.json").read_text())
    return {name: p.get("node") for name, p in manifest["parts"].items()}


@pytest.fixture(scope="module")
def reference(cluster, tiny_pair, tmp_path_factory):
    """An uninterrupted run by address on the two worker nodes: id -> tokens, and the nodes that took parts."""
    tmp = tmp_path_factory.mktemp("cluster-reference")
    path, _ = job(tmp, tiny_pair, resources__num_workers=2)  # both loaded before the first shard: both take parts
    run(path, cluster.address)
    out, table = read_out(tmp / "out")
    assert table.num_rows == ROWS
    return {k: r["token_ids"] for k, r in out.items()}, set(parts_nodes(tmp / "out").values())


def check(out, reference):
    rows, table = read_out(out)
    assert table.num_rows == ROWS and len(rows) == ROWS  # every row exactly once: none lost, none twice
    assert {k: r["token_ids"] for k, r in rows.items()} == reference[0]
    assert (out / "_SUCCESS").exists()


def test_a_job_by_address_uses_every_worker_node(cluster, reference):
    worker_nodes = {n.node_id for n in cluster.worker_nodes}
    assert reference[1] == worker_nodes  # both worker nodes' workers committed parts; the head (no CPU) none


class Gate:
    """The test's side of SPECBATCH_FAULT_GATE: workers stopped with a shard generated, not committed."""

    def __init__(self, folder, monkeypatch):
        self.folder = folder
        folder.mkdir()
        monkeypatch.setenv("SPECBATCH_FAULT_GATE", str(folder))

    def stopped(self, phase="process") -> dict:
        """pid -> node id of the workers stopped at `phase`; those stopped at any other phase are released."""
        found = {}
        for f in self.folder.iterdir():
            pid, _, ph = f.name.partition(".")
            if pid.isdigit() and ph == phase:
                found[int(pid)] = f.read_text()
            elif pid.isdigit() and not ph.endswith(".tmp"):
                f.unlink(missing_ok=True)
        return found

    def wait(self, test, proc, timeout=300) -> dict:
        """The stopped workers once `test` of them holds; the job (`proc`) must not end meanwhile."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            assert proc.poll() is None, proc.communicate()[0]
            now = self.stopped()
            if test(now):
                return now
            time.sleep(0.05)
        raise AssertionError(f"gate: still {self.stopped()} after {timeout}s")

    def open(self) -> None:
        (self.folder / "open").touch()


def node_of(cluster, node_id):
    return next(n for n in cluster.worker_nodes if n.node_id == node_id)


def remove_mid_job(cluster, gate, proc, replace: bool):
    """Once both workers hold a generated, uncommitted shard: kill one worker node outright (its shard is lost
    with it), optionally add a replacement, then let the job go on. Returns (removed node id, added node id)."""
    stopped = gate.wait(lambda s: len(set(s.values())) == 2, proc)
    victim = sorted(stopped.values())[0]
    pid = next(p for p, node in stopped.items() if node == victim)
    cluster.remove_node(node_of(cluster, victim), allow_graceful=False)
    psutil.Process(pid).wait(timeout=60)  # the node's worker process died with its raylet
    added = cluster.add_node(num_cpus=1).node_id if replace else None
    if replace:  # hold the survivor until the new node's worker holds a shard too: it must take work
        gate.wait(lambda s: added in s.values(), proc)
    gate.open()
    return victim, added


@pytest.mark.parametrize("replace", [False, True], ids=["not-replaced", "replaced"])
def test_a_worker_node_removed_mid_job(cluster, tiny_pair, reference, tmp_path, monkeypatch, replace):
    """Without a replacement, the lost worker's shard goes to the remaining worker (no wait for the dead node);
    with one, a worker starts on the new node and takes shards. Every row once, the uninterrupted run's tokens;
    the summary counts the node lost and the shard retried."""
    gate = Gate(tmp_path / "gate", monkeypatch)
    path, _ = job(tmp_path, tiny_pair)
    proc = run_cli(path, "--address", cluster.address, "--json")
    try:
        removed, added = remove_mid_job(cluster, gate, proc, replace)
        log = proc.communicate(timeout=400)[0]
    finally:
        gate.open()
        if proc.poll() is None:
            proc.kill()
        if len(cluster.worker_nodes) < 2:  # the next test gets two worker nodes again
            cluster.add_node(num_cpus=1)
            cluster.wait_for_nodes()
    assert proc.returncode == 0, log
    out = tmp_path / "out"
    check(out, reference)
    nodes = set(parts_nodes(out).values())
    assert removed not in nodes  # its uncommitted shard was committed by another worker
    if added:
        assert added in nodes  # the worker added mid-job took shards
    summary = summary_of(log)
    assert summary["nodes_lost"] == 1 and summary["shards_retried"] >= 1, summary
    assert summary["workers_added_mid_job"] >= (1 if replace else 0), summary


def test_the_driver_killed_then_rerun_resumes_from_committed_parts(cluster, tiny_pair, reference, tmp_path,
                                                                   monkeypatch):
    """The driver SIGKILLed once one part is committed (another worker holding an uncommitted shard): its
    workers go with it; the same command again commits only the missing parts."""
    gate = Gate(tmp_path / "gate", monkeypatch)
    path, _ = job(tmp_path, tiny_pair)
    out = tmp_path / "out"
    proc = run_cli(path, "--address", cluster.address)
    try:
        stopped = gate.wait(lambda s: len(s) == 2, proc)
        (gate.folder / f"{min(stopped)}.process").unlink()  # one worker commits its part, the other stays held
        gate.wait(lambda s: any(out.glob("part-*.parquet")), proc)
        proc.kill()
        proc.wait()
        psutil.Process(max(stopped)).wait(timeout=60)  # Ray ends a dead driver's workers: the held one too
    finally:
        gate.open()
    committed = len(list(out.glob("part-*.parquet")))
    assert 0 < committed < ROWS // 3 and not (out / "_SUCCESS").exists()
    summary = run(path, cluster.address)
    assert summary["rows_from_earlier_runs"] == 3 * committed and summary["parts"] == ROWS // 3, summary
    check(out, reference)


def test_a_job_that_fails_before_its_first_part_leaves_the_output_as_it_found_it(cluster, tiny_pair, tmp_path):
    bad = tmp_path / "not-a-model"
    bad.mkdir()
    (bad / "config.json").write_text("{}")
    path, _ = job(tmp_path, tiny_pair, models__target={"path": str(bad), "dtype": "float32"})
    proc = run_cli(path, "--address", cluster.address)
    log = proc.communicate(timeout=300)[0]
    assert proc.returncode != 0 and "a worker failed to start" in log, log
    assert not (tmp_path / "out").exists(), list((tmp_path / "out").rglob("*"))


def test_two_jobs_without_an_address_start_their_own_ray_and_both_finish(cluster, tiny_pair, reference, tmp_path,
                                                                          monkeypatch):
    """With this module's cluster running on the machine (a stranger's Ray), two jobs given no address each start
    an embedded Ray of their own, never that cluster, and both finish; Ray's own log lines stay off the console."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    runs = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        path, _ = job(tmp_path / name, tiny_pair, resources__num_workers=1)
        runs.append(run_cli(path, "--json"))
    logs = [p.communicate(timeout=400)[0] for p in runs]
    cluster_nodes = {n.node_id for n in cluster.worker_nodes} | {cluster.head_node.node_id}
    for name, proc, log in zip("ab", runs, logs):
        assert proc.returncode == 0, log
        check(tmp_path / name / "out", reference)
        assert not set(parts_nodes(tmp_path / name / "out").values()) & cluster_nodes  # not the stranger's nodes
        noise = [line for line in log.splitlines() if not line.startswith(("specbatch:", "{"))]
        assert not noise, noise  # only our own lines on the console
