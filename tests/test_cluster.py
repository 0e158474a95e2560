"""Jobs on a real multi-node Ray cluster on this machine (ray.cluster_utils: a head and worker nodes, each its own
raylet), joined with `--address` or submitted with `ray job submit` to the head's job server: worker nodes
removed without warning mid-job (raylet and all its processes killed), with and without a replacement; a node
added mid-job; a submitted job stopped mid-job and submitted again. Every row comes out exactly once, with the
tokens of an uninterrupted run, and only specbatch's own lines reach the console.

Each worker node has one CPU and the head none, so each node holds exactly one worker (cpus_per_worker 1).
Workers stop at a gate (workers/faults.py) with a shard generated but not committed until the test releases
them, so "mid-job" is a fixed point of the job, not a moment that depends on the machine's speed."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time

import psutil
import pytest

from job_helpers import config, free_port, read_out, rows_of, run_cli

ROWS = 24


@pytest.fixture(scope="module")
def cluster():
    """A head (no CPU: the drivers' node, with Ray's job server) and two worker nodes of one CPU each; GCS notices
    a dead node in ~1.5s."""
    from ray.cluster_utils import Cluster

    # the head's agent (the job server's) on a port of its own: every Ray's agent defaults to the same one
    c = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=0, include_dashboard=True, dashboard_port=0, dashboard_agent_listen_port=free_port(),
        _system_config={"health_check_period_ms": 500, "health_check_failure_threshold": 3,
                        "health_check_initial_delay_ms": 0}))
    for _ in range(2):
        c.add_node(num_cpus=1)
    c.wait_for_nodes()
    yield c
    c.shutdown()
    import ray
    from ray.experimental import internal_kv

    if ray.is_initialized():  # shutdown resets this process's key-value client, which the session's Ray still needs
        internal_kv._initialize_internal_kv(ray._private.worker.global_worker.gcs_client)


def job(tmp_path, tiny_pair, **over):
    over = {"resources__num_workers": {"min": 1, "max": 3}, "resources__cpus_per_worker": 1, **over}
    return config(tmp_path, tiny_pair, rows_of(ROWS), generation__max_new_tokens=16, resources__shard_size=3, **over)


def quiet(log: str) -> None:
    """Only specbatch's own lines (and the --json summary) on the console: Ray's go to the logs folder."""
    noise = [line for line in log.splitlines() if not line.startswith(("specbatch:", "{"))]
    assert not noise, noise


def summary_of(log: str) -> dict:
    """The summary the CLI prints with --json (its last line that is a JSON object)."""
    return json.loads([line for line in log.splitlines() if line.startswith("{")][-1])


def parts_nodes(out) -> dict[str, str]:
    manifest = json.loads((out / "_manifest.json").read_text())
    return {name: p.get("node") for name, p in manifest["parts"].items()}


@pytest.fixture(scope="module")
def reference(cluster, tiny_pair, tmp_path_factory):
    """An uninterrupted run by address with `num_workers: auto`, its workers held at the gate until one is
    running on each worker node: id -> tokens, the nodes that took parts, and the summary."""
    tmp = tmp_path_factory.mktemp("cluster-reference")
    path, _ = job(tmp, tiny_pair, resources__num_workers="auto")
    with pytest.MonkeyPatch.context() as mp:
        gate = Gate(tmp / "gate", mp)
        proc = run_cli(path, "--address", cluster.address, "--json")
        try:
            gate.wait(lambda s: len(set(s.values())) == 2, proc)
        finally:
            gate.open()
        log = proc.communicate(timeout=400)[0]
    assert proc.returncode == 0, log
    out, table = read_out(tmp / "out")
    assert table.num_rows == ROWS
    return {k: r["token_ids"] for k, r in out.items()}, set(parts_nodes(tmp / "out").values()), summary_of(log)


def check(out, reference, summary: dict | None = None, **nodes: int):
    """Every row exactly once, with the uninterrupted run's tokens; prints the run's figures (`pytest -rP`)."""
    rows, table = read_out(out)
    lost, twice = len(set(reference[0]) - set(rows)), table.num_rows - len(rows)
    figures = {**nodes, "rows": ROWS, "rows_lost": lost, "rows_duplicated": twice}
    if summary:
        figures |= {k: summary[k] for k in ("workers_started", "workers_added_mid_job", "nodes_lost",
                                            "shards_retried", "rows_from_earlier_runs")}
    print("figures:", json.dumps(figures))
    assert table.num_rows == ROWS and len(rows) == ROWS and not lost  # none lost, none twice
    assert {k: r["token_ids"] for k, r in rows.items()} == reference[0]
    assert (out / "_SUCCESS").exists()


def test_a_job_by_address_with_auto_workers_uses_every_worker_node(cluster, reference):
    """`auto` starts as many workers as the cluster's free CPUs fit: one per worker node (1 CPU each), none on
    the head (no CPU), and no more (none left waiting for room); both commit parts."""
    worker_nodes = {n.node_id for n in cluster.worker_nodes}
    assert reference[1] == worker_nodes
    assert reference[2]["workers_started"] == 2 and reference[2]["nodes_lost"] == 0, reference[2]


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
    out, summary = tmp_path / "out", summary_of(log)
    check(out, reference, summary, nodes_removed=1, nodes_added=int(replace))
    nodes = set(parts_nodes(out).values())
    assert removed not in nodes  # its uncommitted shard was committed by another worker
    if added:
        assert added in nodes  # the worker added mid-job took shards
    assert summary["nodes_lost"] == 1 and summary["shards_retried"] >= 1, summary
    assert summary["workers_added_mid_job"] >= (1 if replace else 0), summary
    quiet(log)  # Ray's "(raylet) ... failed ... retries left" lines went to the logs folder


class Submitted:
    """A job submitted to the cluster's job server, looked at as Gate.wait looks at a CLI process."""

    def __init__(self, cluster, submission_id: str):
        from ray.job_submission import JobSubmissionClient

        self.client, self.id = JobSubmissionClient("http://" + cluster.head_node.webui_url), submission_id

    def poll(self):
        """None while the job is pending or running, else its final status."""
        status = self.client.get_job_status(self.id)
        return status.value if status.is_terminal() else None

    def communicate(self, timeout: float = 300) -> tuple[str, None]:
        """Wait for the job to end; its driver's output."""
        t0 = time.monotonic()
        while self.poll() is None and time.monotonic() - t0 < timeout:
            time.sleep(0.2)
        return self.client.get_job_logs(self.id), None


def ray_job(cluster, *args: str) -> str:
    """`ray job ARGS` (Ray's CLI) against the cluster's job server; its output."""
    env = dict(os.environ, RAY_ADDRESS="http://" + cluster.head_node.webui_url)
    done = subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "job", *args], env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
    assert done.returncode == 0, done.stdout
    return done.stdout


def submit(cluster, name: str, path: str) -> Submitted:
    """`ray job submit --no-wait -- python -m jobs.cli run PATH`: the driver runs on the cluster (the job server
    gives it RAY_ADDRESS); its environment (this checkout, the test hook) comes from the job's runtime env."""
    env = {k: v for k, v in os.environ.items() if k.startswith("SPECBATCH_") or k == "PYTHONPATH"}
    ray_job(cluster, "submit", "--no-wait", "--submission-id", name, "--runtime-env-json",
            json.dumps({"env_vars": env}), "--", sys.executable, "-m", "jobs.cli", "run", path, "--no-progress",
            "--json")
    return Submitted(cluster, name)


def test_ray_job_submit_stopped_mid_job_then_resubmitted_resumes(cluster, tiny_pair, reference, tmp_path,
                                                                  monkeypatch):
    """A job submitted with `ray job submit` runs on both worker nodes; `ray job stop` kills its driver once
    one part is committed (another worker holding an uncommitted shard), and its workers go with it; the same
    job submitted again commits only the missing parts: every row once, the clean run's tokens."""
    gate = Gate(tmp_path / "gate", monkeypatch)
    path, _ = job(tmp_path, tiny_pair)
    out = tmp_path / "out"
    first = submit(cluster, f"{tmp_path.name}-first", path)
    try:
        stopped = gate.wait(lambda s: len(set(s.values())) == 2, first)  # a worker on each worker node
        (gate.folder / f"{min(stopped)}.process").unlink()  # one worker commits its part, the other stays held
        gate.wait(lambda s: any(out.glob("part-*.parquet")), first)
        ray_job(cluster, "stop", first.id)  # SIGTERM to the driver (SIGKILL if it lingers); waits for the end
        assert first.poll() == "STOPPED"
        with contextlib.suppress(psutil.NoSuchProcess):  # Ray ends a dead driver's workers: the held one too
            psutil.Process(max(stopped)).wait(timeout=60)
    finally:
        gate.open()
    committed = len(list(out.glob("part-*.parquet")))
    assert 0 < committed < ROWS // 3 and not (out / "_SUCCESS").exists()
    second = submit(cluster, f"{tmp_path.name}-second", path)
    log = second.communicate(timeout=400)[0]
    assert second.poll() == "SUCCEEDED", log
    summary = summary_of(log)
    assert summary["rows_from_earlier_runs"] == 3 * committed and summary["parts"] == ROWS // 3, summary
    check(out, reference, summary, drivers_stopped=1)
    quiet("\n".join(line for line in log.splitlines() if "job_manager.py" not in line
                    and not line.startswith("Running entrypoint")))  # the job server's own two lines


def test_workers_grow_with_the_cluster(cluster, tiny_pair, reference, tmp_path, monkeypatch):
    """`num_workers: {min: 1, max: 3}` on a cluster with room for two: the job runs with two (the third waits
    for room: demand an autoscaler sees); a node that joins mid-job gets the third, which takes shards. Nothing
    lost, nothing retried."""
    gate = Gate(tmp_path / "gate", monkeypatch)
    path, _ = job(tmp_path, tiny_pair)
    proc = run_cli(path, "--address", cluster.address, "--json")
    added = None
    try:
        gate.wait(lambda s: len(set(s.values())) == 2, proc)  # both nodes' workers hold a shard
        added = cluster.add_node(num_cpus=1).node_id
        gate.wait(lambda s: added in s.values(), proc)  # the new node's worker holds one too
        gate.open()
        log = proc.communicate(timeout=400)[0]
    finally:
        gate.open()
        if proc.poll() is None:
            proc.kill()
        if added:  # the next test gets two worker nodes again
            cluster.remove_node(node_of(cluster, added))
    assert proc.returncode == 0, log
    summary = summary_of(log)
    check(tmp_path / "out", reference, summary, nodes_added=1)
    assert added in set(parts_nodes(tmp_path / "out").values())  # the worker added mid-job committed parts
    assert summary["workers_added_mid_job"] >= 1 and summary["workers_started"] == 3, summary
    assert summary["nodes_lost"] == 0 and summary["shards_retried"] == 0, summary
    quiet(log)


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
        quiet(log)


def test_the_progress_bar_shows_the_live_workers(capsys):
    from jobs.progress import Progress

    prog = Progress(total=ROWS, done=0, enabled=True)
    prog.cluster(live=3, nodes_lost=0, started=3, added=1)
    prog.cluster(live=2, nodes_lost=1, started=3, added=1)
    prog.close()
    bar = capsys.readouterr().err
    assert "workers=3" in bar and bar.rindex("workers=2") > bar.index("workers=3"), bar


def test_rays_error_lines_go_to_the_log_file_and_the_console_gets_them_back_after(tmp_path, capsys):
    """What Ray's error listener prints ("(raylet) ...": a node gone, a task retried) goes to the run's Ray log
    while the run lasts, not the console; afterwards Ray's own printer is back."""
    from ray._private import worker as ray_worker

    from jobs.ray_session import ray_log_to

    printer, path = ray_worker.print_to_stdstream, tmp_path / "_logs" / "driver-ray.log"
    with ray_log_to(str(path)):
        ray_worker.print_to_stdstream({"lines": ["Task GenerationWorker.ready failed. 3 retries left."],
                                       "pid": "raylet", "is_err": False}, ignore_prefix=False)
    assert ray_worker.print_to_stdstream is printer
    assert "(raylet) Task GenerationWorker.ready failed. 3 retries left." in path.read_text()
    assert "retries left" not in capsys.readouterr().out
