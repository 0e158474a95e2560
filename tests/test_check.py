"""`specbatch check` on a local Ray with tiny models: every check passes (GPU-only ones say n/a), one
process and a tensor-parallel group; a missing model and an unwritable output (moto S3) fail, named."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from job_helpers import config, moto_s3, rows_of
from jobs.check import failures, run_check, table
from jobs.cli import main as cli
from jobs.spec import load_spec


def by_check(rows):
    return {r["check"]: r for r in rows}


@pytest.mark.parametrize("ranks", [1, 2])
def test_check_passes_on_tiny_models(tmp_path, tiny_pair, ray_session, ranks):
    over = {"models__target": {"path": tiny_pair["target"], "dtype": "float32", "tensor_parallel": ranks}}
    path, _ = config(tmp_path, tiny_pair, rows_of(2), resources__num_workers=1, **over)
    rows = run_check(load_spec(path))
    assert failures(rows) == [], table(rows)
    got = by_check(rows)
    assert got["ray"]["ok"] and got["devices"]["result"].startswith("cpu: ")
    assert got["model models.target.path"]["ok"] and got["model models.draft.path"]["ok"]
    assert got["worker devices"]["result"].startswith(f"{ranks} x cpu: ")
    assert got["dtype"]["result"] == "float32"
    assert got["memory plan"] == {"where": got["memory plan"]["where"], "check": "memory plan",
                                  "result": "n/a (no GPU)", "ok": None}
    if ranks == 1:
        assert got["step: eager"]["ok"] is True
        assert got["step: compiled"]["result"] == got["step: graph"]["result"] == "n/a (no GPU)"
    else:
        assert got["lock-step call (2 ranks)"]["ok"] is True
        assert got["all-reduce"]["ok"] is True and "GB/s bus bandwidth" in got["all-reduce"]["result"]
    assert got["storage"]["ok"] is True and "ranged GET" in got["storage"]["result"]
    assert not os.path.exists(tmp_path / "out") or os.listdir(tmp_path / "out") == []  # the probe deleted, no logs
    assert "status" in table(rows).splitlines()[0]


def test_check_names_a_missing_model(tmp_path, tiny_pair, capsys):
    path, _ = config(tmp_path, tiny_pair, rows_of(2), models__draft={"path": str(tmp_path / "nowhere")})
    assert cli(["check", path]) == 1
    captured = capsys.readouterr()
    assert "FAIL" in captured.out
    assert "check failed" in captured.err and "models.draft.path" in captured.err and "nowhere" in captured.err


@pytest.fixture(scope="module")
def s3_server():
    yield from moto_s3("SECRET-check-3c1d")


def test_check_against_s3_passes_and_names_an_unwritable_output(tmp_path, tiny_pair, s3_server):
    """Through the CLI, on its own embedded Ray: the probe's create-only PUT, refused overwrite and ranged
    GET on moto's S3 pass; an output in a bucket that does not exist fails, named. The console holds the table
    and specbatch's own lines (workers' loading stages, failures), none of Ray's (they go to the log folder)."""
    for bucket, code in (("bucket", 0), ("no-such-bucket", 1)):
        path, _ = config(tmp_path, tiny_pair, rows_of(2), output__path=f"s3://{bucket}/out",
                         resources__num_workers=1)
        proc = subprocess.run([sys.executable, "-m", "jobs.cli", "check", path, "--json"], capture_output=True,
                              text=True, timeout=600, env=dict(os.environ))
        assert proc.returncode == code, proc.stdout + proc.stderr
        assert len(proc.stdout.strip().splitlines()) == 1  # the JSON rows alone
        assert all(line.startswith("specbatch: ") for line in proc.stderr.splitlines()), proc.stderr  # no Ray lines
        storage = by_check(json.loads(proc.stdout.strip().splitlines()[-1]))["storage"]
        assert storage["ok"] is (code == 0) and f"s3://{bucket}/out" in storage["result"]
        if code:
            assert "storage" in proc.stderr and "no-such-bucket" in proc.stderr
    import boto3
    assert "Contents" not in boto3.client("s3").list_objects_v2(Bucket="bucket", Prefix="out/_check")  # nothing left behind
