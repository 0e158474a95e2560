"""Storage and jobs against a real S3-compatible server (moto in server mode) on loopback."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from job_helpers import moto_s3

SECRET = "SECRET-do-not-leak-7f3a9c"


@pytest.fixture(scope="module")
def s3_server():
    yield from moto_s3(SECRET)


def s3():
    import boto3

    return boto3.client("s3")


# ------------------------------------------------------------------------------------------ storage

@pytest.mark.parametrize("kind", ["local", "s3"])
def test_storage_semantics(kind, tmp_path, s3_server):
    from workers.storage import open_storage

    root = str(tmp_path / "st") if kind == "local" else f"s3://bucket/unit-{time.time_ns()}/"
    st = open_storage(root)
    assert st.read_bytes("a.txt") is None and not st.exists("a.txt")
    assert st.put_if_absent("a.txt", b"first") is True
    assert st.put_if_absent("a.txt", b"second") is False  # create-only: never overwritten
    assert st.read_bytes("a.txt") == b"first"
    st.put("m.json", b"1")
    st.put("m.json", b"2")
    assert st.read_bytes("m.json") == b"2"
    st.put_if_absent("sub/b.txt", b"x")
    assert st.list() == ["a.txt", "m.json", "sub/b.txt"] and st.list("sub/") == ["sub/b.txt"]
    st.delete("m.json")
    assert not st.exists("m.json")


def test_s3_inputs_stream_with_ranged_reads(s3_server):
    from workers.inputs import iter_rows
    from workers.storage import list_input_files, open_input

    table = pa.table({"id": [f"x{i}" for i in range(5000)], "prompt": ["the day"] * 5000})
    buf = io.BytesIO()
    pq.write_table(table, buf, row_group_size=1000)
    s3().put_object(Bucket="bucket", Key="in/a.parquet", Body=buf.getvalue())
    s3().put_object(Bucket="bucket", Key="in/b.jsonl", Body=b'{"id": "j1", "prompt": "hi"}\n{"id": "j2"}\n')
    s3().put_object(Bucket="bucket", Key="in/notes.txt", Body=b"ignored")
    files = list_input_files("s3://bucket/in/")
    assert files == ["s3://bucket/in/a.parquet", "s3://bucket/in/b.jsonl"]
    with open_input(files[0], block=4096) as f:  # small blocks: many ranged GETs, never the whole object
        pf = pq.ParquetFile(f)
        assert pf.metadata.num_rows == 5000 and pf.metadata.num_row_groups == 5
    assert [r["id"] for r in iter_rows(files[0], ["id"])][-1] == "x4999"
    assert [r["id"] for r in iter_rows(files[1])] == ["j1", "j2"]


def test_permanent_error_is_fast_and_names_bucket_and_operation(s3_server):
    from workers.storage import StorageError, open_storage

    t = time.time()
    with pytest.raises(StorageError, match=r"S3 PutObject s3://no-such-bucket/p/x: bucket 'no-such-bucket' does not exist"):
        open_storage("s3://no-such-bucket/p/").put("x", b"1")
    assert time.time() - t < 5  # not retried


def test_transient_errors_are_retried(s3_server, monkeypatch):
    import workers.storage as storage
    from workers import faults

    monkeypatch.setenv("SPECBATCH_STORAGE_FAULTS", "put:3,get:2")
    monkeypatch.setattr(faults, "_storage_left", None)  # read the variable again
    st = storage.open_storage("s3://bucket/flaky/")
    assert st.put_if_absent("p", b"data") is True
    assert st.read_bytes("p") == b"data"
    assert faults.storage_left() == {"put": 0, "get": 0}  # every injected fault was hit and survived
    monkeypatch.setenv("SPECBATCH_STORAGE_MAX_ATTEMPTS", "2")
    monkeypatch.setenv("SPECBATCH_STORAGE_FAULTS", "put:5")
    monkeypatch.setattr(faults, "_storage_left", None)
    with pytest.raises(storage.StorageError, match="ServiceUnavailable"):
        st.put("q", b"x")


# --------------------------------------------------------------------------------------------- jobs

def job_config(tmp_path, tiny_pair, prefix, n_rows=12, **extra_env):
    rows = "".join(json.dumps({"id": f"r{i}", "prompt": "the water is hot " + "the " * (i % 3)}) + "\n"
                   for i in range(n_rows))
    s3().put_object(Bucket="bucket", Key=f"{prefix}/input/rows.jsonl", Body=rows.encode())
    cfg = {
        "name": "s3job",
        "input": {"path": f"s3://bucket/{prefix}/input/", "chat_template": True},
        "output": {"path": f"s3://bucket/{prefix}/out/"},
        "models": {"target": {"path": tiny_pair["target"], "dtype": "float32"},
                   "draft": {"path": tiny_pair["draft"], "dtype": "float32"}},
        "generation": {"max_new_tokens": 24},
        "speculation": {"method": "draft_model", "num_draft_tokens": 3},
        "resources": {"num_workers": 1, "batch_size": 2, "shard_size": 2},
    }
    path = tmp_path / f"{prefix}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def cli(path, env_extra=None, wait=True, args=()):
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env_extra or {}))
    proc = subprocess.Popen([sys.executable, "-m", "jobs.cli", "run", path, *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if not wait:
        return proc
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out
    return out


def listing(prefix):
    objs = s3().list_objects_v2(Bucket="bucket", Prefix=prefix).get("Contents", [])
    return {o["Key"][len(prefix):]: (o["ETag"], o["LastModified"]) for o in objs}


def read_rows(prefix):
    rows = []
    for key in sorted(k for k in listing(prefix) if k.startswith("part-")):
        body = s3().get_object(Bucket="bucket", Key=prefix + key)["Body"].read()
        rows += pq.read_table(io.BytesIO(body)).to_pylist()
    return rows


def test_s3_job_rows_rerun_and_no_secret(tmp_path, tiny_pair, s3_server):
    path = job_config(tmp_path, tiny_pair, "j1")
    log = cli(path)
    out = "j1/out/"
    keys = listing(out)
    assert sorted(keys) == ["_SUCCESS", "_manifest.json"] + [f"part-{i:05d}.parquet" for i in range(6)]
    rows = read_rows(out)
    assert sorted(r["id"] for r in rows) == sorted(f"r{i}" for i in range(12))
    assert all(sum(r["accept_lengths"]) == r["accepted_tokens"] for r in rows)
    manifest = s3().get_object(Bucket="bucket", Key=out + "_manifest.json")["Body"].read()
    # the secret is nowhere: not in logs, not in the manifest, not in any output object
    assert SECRET not in log
    assert SECRET.encode() not in manifest
    for key in keys:
        assert SECRET.encode() not in s3().get_object(Bucket="bucket", Key=out + key)["Body"].read()
    # a re-run of a finished job changes no part
    log2 = cli(path)
    assert "0 this run" in log2 and SECRET not in log2
    after = listing(out)
    assert {k: v for k, v in after.items() if k.startswith("part-")} == \
        {k: v for k, v in keys.items() if k.startswith("part-")}


def test_s3_job_survives_transient_failures(tmp_path, tiny_pair, s3_server):
    path = job_config(tmp_path, tiny_pair, "j2", n_rows=4)
    log = cli(path, {"SPECBATCH_STORAGE_FAULTS": "put:2,get:1,list:1"})
    assert len(read_rows("j2/out/")) == 4 and "_SUCCESS" in listing("j2/out/")
    assert SECRET not in log


def test_s3_job_resume_after_sigkill(tmp_path, tiny_pair, s3_server):
    path = job_config(tmp_path, tiny_pair, "j3", n_rows=40)
    clean = job_config(tmp_path, tiny_pair, "j3clean", n_rows=40)
    proc = cli(path, wait=False)
    deadline = time.time() + 240
    while "part-00000.parquet" not in listing("j3/out/") and time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    assert "part-00000.parquet" in listing("j3/out/")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert "_SUCCESS" not in listing("j3/out/")
    log = cli(path)
    assert "from earlier runs" in log
    cli(clean)
    rows, ref = read_rows("j3/out/"), read_rows("j3clean/out/")
    assert len(rows) == 40 and len({r["id"] for r in rows}) == 40  # each row exactly once
    assert {r["id"]: r["token_ids"] for r in rows} == {r["id"]: r["token_ids"] for r in ref}


def test_no_credential_in_debug_logs_ray_logs_manifest_or_outputs(tmp_path, tiny_pair, s3_server):
    """With the driver's, the workers', the AWS SDK's and Ray's debug logging on, neither the secret key
    nor the key id appears in the job's output, Ray's session logs, the manifest or any output object."""
    path = job_config(tmp_path, tiny_pair, "debuglog", n_rows=4)
    log = cli(path, {"RAY_BACKEND_LOG_LEVEL": "debug"}, args=("--log-level", "debug", "--no-progress"))
    assert "botocore" in log and "DEBUG" in log  # the SDK's debug output was really on
    key_id = s3_server["AWS_ACCESS_KEY_ID"]
    assert SECRET not in log and key_id not in log
    assert "Credential=***" in log or "Authorization" not in log  # signed headers were logged, redacted
    worker_logs = re.search(r"the workers' own output \(model loading, Ray\) is in (\S+)", log).group(1)
    assert any(name.endswith(".log") for name in os.listdir(worker_logs))
    for root, _, files in [*os.walk("/tmp/ray/session_latest/logs"), *os.walk(worker_logs)]:
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                data = f.read()
            assert SECRET.encode() not in data and key_id.encode() not in data, name
    for key in listing("debuglog/out/"):
        body = s3().get_object(Bucket="bucket", Key="debuglog/out/" + key)["Body"].read()
        assert SECRET.encode() not in body and key_id.encode() not in body
