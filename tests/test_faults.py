"""Chaos on a local Ray with tiny models: worker processes killed while loading and at random moments,
the driver killed and rerun, out-of-memory batches, flaky storage, a hung worker. Every row comes out
exactly once, with the tokens of an uninterrupted run."""

from __future__ import annotations

import os
import random
import re
import signal
import threading
import time

import psutil
import pytest

from job_helpers import config, read_out, rows_of, run_cli
from jobs.driver import run_job
from jobs.spec import load_spec


def chaos_config(tmp_path, tiny_pair, n=240, **over):
    """The chaos tests' job: n rows in shards of 8, long enough answers that a job runs for tens of seconds."""
    return config(tmp_path, tiny_pair, rows_of(n), generation__max_new_tokens=40, resources__shard_size=8, **over)


@pytest.fixture(scope="module")
def reference(tiny_pair, tmp_path_factory, ray_session):
    """An uninterrupted run of the rows the chaos tests use: id -> tokens."""
    tmp = tmp_path_factory.mktemp("reference")
    path, _ = chaos_config(tmp, tiny_pair, 480)
    run_job(load_spec(path), progress=False)
    out, _ = read_out(tmp / "out")
    return {k: r["token_ids"] for k, r in out.items()}


def check(tmp_path, reference, n=240):
    out, table = read_out(tmp_path / "out")
    assert table.num_rows == n and len(out) == n  # every row exactly once: none lost, none twice
    assert {k: r["token_ids"] for k, r in out.items()} == {k: v for k, v in reference.items() if k in out}
    assert (tmp_path / "out" / "_SUCCESS").exists()


def worker_processes() -> list[psutil.Process]:
    """The job's worker actor processes (Ray titles them after the actor class)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any("GenerationWorker" in part for part in p.info["cmdline"] or []):
                found.append(p)
        except psutil.Error:
            continue
    return found


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def test_a_worker_killed_while_loading_is_replaced(tmp_path, tiny_pair, reference, ray_session, monkeypatch):
    marker = tmp_path / "died-loading"
    monkeypatch.setenv("SPECBATCH_FAULT_EXIT_IN_INIT", str(marker))
    path, _ = chaos_config(tmp_path, tiny_pair, 24)
    summary = run_job(load_spec(path), progress=False)
    assert marker.exists()  # a worker process really died in its constructor
    assert summary["rows_committed"] == 24
    check(tmp_path, reference, 24)


def test_a_worker_dying_mid_shard_costs_a_retry_not_a_row(tmp_path, tiny_pair, reference, ray_session, monkeypatch):
    marker = tmp_path / "died-mid-shard"
    monkeypatch.setenv("SPECBATCH_FAULT_EXIT_ONCE", str(marker))
    path, _ = chaos_config(tmp_path, tiny_pair, 24)
    run_job(load_spec(path), progress=False)
    assert marker.exists()
    check(tmp_path, reference, 24)


def test_workers_sigkilled_ten_times_during_a_job(tmp_path, tiny_pair, reference, ray_session, monkeypatch):
    """SIGKILL of a worker process ten times, alternately while it loads its models (loaded, not ready yet) and
    while it works on a shard (generated, not committed): Ray restarts it and retries its shard; the job
    completes with every row once. Workers wait at a gate (workers/faults.py) until this test has killed or
    released them, so the ten kills happen however fast the machine is."""
    gate = tmp_path / "gate"
    gate.mkdir()
    monkeypatch.setenv("SPECBATCH_FAULT_GATE", str(gate))
    path, _ = chaos_config(tmp_path, tiny_pair, 48, resources__max_retries=20)
    kills: list[str] = []  # the phase of each killed process
    done = threading.Event()

    def chaos():
        """At each worker stopped at the gate: kill it if it is in the phase whose turn it is, else release it."""
        try:
            while not done.is_set() and len(kills) < 10:
                for stop in sorted(gate.iterdir()):
                    pid, _, phase = stop.name.partition(".")
                    if not pid.isdigit() or phase not in ("init", "process"):
                        continue
                    proc = psutil.Process(int(pid))
                    if len(kills) < 10 and phase == ("init", "process")[len(kills) % 2]:
                        assert proc in worker_processes(), _cmdline(proc)  # a real worker process
                        proc.send_signal(signal.SIGKILL)
                        proc.wait(timeout=30)
                        kills.append(phase)
                    stop.unlink()
                time.sleep(0.01)
        finally:
            (gate / "open").touch()  # the workers left go on undisturbed

    thread = threading.Thread(target=chaos)
    thread.start()
    try:
        summary = run_job(load_spec(path), progress=False)
    finally:
        done.set()
        thread.join()
    assert kills == ["init", "process"] * 5
    assert summary["rows_committed"] == 48
    check(tmp_path, reference, 48)


def test_driver_sigkilled_five_times_then_rerun(tmp_path, tiny_pair, reference):
    """The driver killed at random points, five runs in a row, then run to the end: every row once, the same
    tokens as an uninterrupted run (committed parts are kept, the rest generated)."""
    path, _ = chaos_config(tmp_path, tiny_pair, resources__num_workers=1)
    rng = random.Random(1)
    out = tmp_path / "out"

    def committed() -> int:
        return len([n for n in os.listdir(out) if n.startswith("part-")]) if out.exists() else 0

    parts = []
    for _ in range(5):  # killed while starting (no new part yet), or after 1-3 new parts
        proc, before, wanted = run_cli(path), committed(), rng.choice([0, 1, 2, 3])
        deadline = time.time() + (rng.uniform(1.0, 6.0) if wanted == 0 else 240)
        while time.time() < deadline and committed() < before + max(wanted, 1) and proc.poll() is None:
            time.sleep(0.02)
        assert proc.poll() is None, "the run ended before it was killed"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        parts.append(committed())
    assert not (out / "_SUCCESS").exists() and 0 < parts[-1] < 30, parts
    final = run_cli(path)
    log = final.communicate(timeout=600)[0]
    assert final.returncode == 0, log
    assert int(re.search(r"(\d+) from earlier runs", log).group(1)) > 0
    check(tmp_path, reference)


def test_out_of_memory_splits_the_batch_before_failing_a_row(tmp_path, tiny_pair, reference, ray_session,
                                                              monkeypatch):
    monkeypatch.setenv("SPECBATCH_FAULT_OOM_ROWS", "1")  # any batch of more than one row runs out of memory
    path, _ = chaos_config(tmp_path, tiny_pair, 12, resources__batch_size=4)
    summary = run_job(load_spec(path), progress=False)
    assert summary["rows_failed_this_run"] == 0
    check(tmp_path, reference, 12)


@pytest.mark.parametrize("mode", ["raise", "nan"])
def test_a_failing_fast_path_falls_back_to_eager(tmp_path, tiny_pair, reference, ray_session, monkeypatch, mode):
    """Every shape's first fast step fails in every worker (capture raising, or non-finite logits): the job
    completes on the eager path with the uninterrupted run's tokens, and its summary says so."""
    monkeypatch.setenv("SPECBATCH_FAULT_FASTPATH", mode)
    path, _ = chaos_config(tmp_path, tiny_pair, 12)
    summary = run_job(load_spec(path), progress=False)
    assert summary["rows_failed_this_run"] == 0
    assert summary["step_path"] == "lean+eager-fallback"
    check(tmp_path, reference, 12)
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "out" / "_logs").rglob("*") if p.is_file())
    assert "the fast path failed" in logs and ("injected fault" in logs if mode == "raise" else "non-finite" in logs)


def test_transient_local_storage_errors_are_retried(tmp_path, tiny_pair, reference, ray_session, monkeypatch):
    import workers.storage as storage
    from workers import faults
    monkeypatch.setenv("SPECBATCH_STORAGE_FAULTS", "put:3,get:2")
    monkeypatch.setattr(faults, "_storage_left", None)
    st = storage.open_storage(str(tmp_path / "flaky"))
    assert st.put_if_absent("p", b"data") is True and st.read_bytes("p") == b"data"
    assert faults.storage_left() == {"put": 0, "get": 0}  # every injected fault was hit and survived
    monkeypatch.setenv("SPECBATCH_STORAGE_MAX_ATTEMPTS", "2")
    monkeypatch.setenv("SPECBATCH_STORAGE_FAULTS", "put:5")
    monkeypatch.setattr(faults, "_storage_left", None)
    with pytest.raises(storage.StorageError, match="injected fault"):
        st.put("q", b"x")
    monkeypatch.delenv("SPECBATCH_STORAGE_MAX_ATTEMPTS")
    monkeypatch.setenv("SPECBATCH_STORAGE_FAULTS", "put:2")  # in the driver and in every worker process
    path, _ = chaos_config(tmp_path, tiny_pair, 12)
    run_job(load_spec(path), progress=False)
    check(tmp_path, reference, 12)


def test_a_hung_worker_is_killed_and_its_shard_retried(tmp_path, tiny_pair, reference, ray_session, monkeypatch):
    marker = tmp_path / "hung"
    monkeypatch.setenv("SPECBATCH_FAULT_HANG_ONCE", str(marker))
    path, _ = chaos_config(tmp_path, tiny_pair, 24, resources__shard_timeout_s=3)
    summary = run_job(load_spec(path), progress=False)
    assert marker.exists() and summary["workers_killed_for_no_progress"] == 1
    check(tmp_path, reference, 24)


def test_local_output_names_stay_inside_the_output_folder(tmp_path):
    from workers.storage import LocalStorage, StorageError
    st = LocalStorage(str(tmp_path / "out"))
    st.put("part-00000.parquet", b"x")
    for name in ("../escape", "/etc/passwd", "a/../../escape"):
        with pytest.raises(StorageError, match="outside the output folder"):
            st.put(name, b"x")
    assert not (tmp_path / "escape").exists()
