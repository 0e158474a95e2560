"""Nightly runs: the manifest fingerprints the input files (size, and the S3 ETag or the local mtime), a rerun over
changed input is refused naming the file unless --overwrite, and `{date}` in output.path gives one folder per run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from datetime import datetime, timezone

import pytest
import yaml

from job_helpers import config, moto_s3, read_out, rows_of, write_jsonl
from jobs.cli import main as cli
from jobs.driver import JobError, run_job
from jobs.spec import ConfigError, load_spec


def manifest_of(folder) -> dict:
    return json.loads((folder / "_manifest.json").read_text())


def stamp(path: str) -> dict:
    st = os.stat(path)
    return {"path": path, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


# ------------------------------------------------------------------------------------------- local input

def test_changed_local_input_refused_unless_overwrite(tmp_path, tiny_pair, ray_session, capsys):
    path, cfg = config(tmp_path, tiny_pair, rows_of(4), resources__num_workers=1)
    inp, out = cfg["input"]["path"], tmp_path / "out"
    run_job(load_spec(path), progress=False)
    first = stamp(inp)
    assert manifest_of(out)["input"]["files"] == [first]

    again = run_job(load_spec(path), progress=False)  # the same input: resumes (nothing left to do)
    assert again["rows_this_run"] == 0 and again["rows_from_earlier_runs"] == 4

    write_jsonl(inp, rows_of(5))  # the next night's input
    size = os.stat(inp).st_size
    with pytest.raises(JobError, match=rf"input file {re.escape(inp)} changed \(size {first['size']} -> {size}, "
                                       r"modified .* -> .*\) since the output at .* was written.*--overwrite"):
        run_job(load_spec(path), progress=False)
    assert manifest_of(out)["input"]["files"] == [first]  # refused before anything was written
    capsys.readouterr()
    assert cli(["run", path, "--no-progress"]) == 1
    assert f"input file {inp} changed" in capsys.readouterr().err

    summary = run_job(load_spec(path), overwrite=True, progress=False)
    assert summary["rows_this_run"] == 5 and summary["rows_from_earlier_runs"] == 0
    rows, _ = read_out(out)
    assert sorted(rows) == sorted(f"r{i}" for i in range(5))
    assert manifest_of(out)["input"]["files"] == [stamp(inp)]

    # the same bytes written again: a local file is told apart by its size and mtime, so refused too
    now = os.stat(inp)
    os.utime(inp, ns=(now.st_atime_ns, now.st_mtime_ns + 5 * 10**9))
    with pytest.raises(JobError, match=rf"input file {re.escape(inp)} changed \(modified "):
        run_job(load_spec(path), progress=False)

    # an output written before input files were fingerprinted (a list of paths) still resumes, and is upgraded
    m = manifest_of(out)
    m["input"]["files"] = [inp]
    (out / "_manifest.json").write_text(json.dumps(m))
    resumed = run_job(load_spec(path), progress=False)
    assert resumed["rows_this_run"] == 0 and resumed["rows_from_earlier_runs"] == 5
    assert manifest_of(out)["input"]["files"] == [stamp(inp)]


def test_input_files_added_or_removed_refused(tmp_path, tiny_pair, ray_session):
    folder = tmp_path / "in"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", rows_of(3))
    path, _ = config(tmp_path, tiny_pair, [], input__path=str(folder), resources__num_workers=1)
    run_job(load_spec(path), progress=False)
    a, b = str(folder / "a.jsonl"), str(folder / "b.jsonl")

    write_jsonl(b, [{"id": "b0", "prompt": "the day"}])
    with pytest.raises(JobError, match=rf"input file {re.escape(b)} was added since"):
        run_job(load_spec(path), progress=False)
    os.rename(a, str(folder / "c.jsonl"))
    with pytest.raises(JobError, match=rf"input file {re.escape(a)} was removed since .*; also: input file "
                                       rf"{re.escape(b)} was added; input file .*c\.jsonl was added;"):
        run_job(load_spec(path), progress=False)
    os.rename(str(folder / "c.jsonl"), a)  # back as it was (a rename keeps the mtime)
    os.unlink(b)
    assert run_job(load_spec(path), progress=False)["rows_this_run"] == 0


# ---------------------------------------------------------------------------------------------- S3 input

@pytest.fixture(scope="module")
def s3_env():
    """A real S3-compatible server (moto) on loopback, in this process's environment (and so in the CLI's)."""
    import boto3

    for _ in moto_s3("nightly-secret", "AKIDNIGHTLY", bucket="nightly"):
        yield boto3.client("s3")


def test_s3_input_files_carry_size_and_etag(s3_env):
    from workers.storage import input_files

    s3_env.put_object(Bucket="nightly", Key="units/a.jsonl", Body=b'{"id": 1}\n')
    s3_env.put_object(Bucket="nightly", Key="units/notes.txt", Body=b"ignored")
    etag = s3_env.head_object(Bucket="nightly", Key="units/a.jsonl")["ETag"].strip('"')
    want = [{"path": "s3://nightly/units/a.jsonl", "size": 10, "etag": etag}]
    assert input_files("s3://nightly/units/") == want  # from the listing
    assert input_files("s3://nightly/units/a.jsonl") == want  # one object: a HEAD


def test_s3_input_reuploaded_refused(tmp_path, tiny_pair, s3_env):
    lines = "".join(json.dumps({"id": f"r{i}", "prompt": "the water is hot"}) + "\n" for i in range(2))
    s3_env.put_object(Bucket="nightly", Key="job/input/rows.jsonl", Body=lines.encode())
    cfg = {"name": "nightly", "input": {"path": "s3://nightly/job/input/", "chat_template": True},
           "output": {"path": "s3://nightly/job/out/{date}/"},
           "models": {"target": {"path": tiny_pair["target"], "dtype": "float32"},
                      "draft": {"path": tiny_pair["draft"], "dtype": "float32"}},
           "generation": {"max_new_tokens": 6}, "resources": {"batch_size": 2, "shard_size": 2}}
    path = tmp_path / "nightly.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, PYTHONUNBUFFERED="1", SPECBATCH_DATE="2001-02-03")
    proc = subprocess.run([sys.executable, "-m", "jobs.cli", "run", str(path), "--no-progress"], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout
    m = json.loads(s3_env.get_object(Bucket="nightly", Key="job/out/2001-02-03/_manifest.json")["Body"].read())
    etag = s3_env.head_object(Bucket="nightly", Key="job/input/rows.jsonl")["ETag"].strip('"')
    uri = "s3://nightly/job/input/rows.jsonl"
    assert m["input"]["files"] == [{"path": uri, "size": len(lines), "etag": etag}]
    assert m["spec"]["output"]["path"] == "s3://nightly/job/out/2001-02-03/"

    spec = load_spec(str(path), date="2001-02-03")  # the same day, the same input: resumes
    assert run_job(spec, progress=False)["rows_this_run"] == 0

    s3_env.put_object(Bucket="nightly", Key="job/input/rows.jsonl", Body=lines.replace("r1", "q1").encode())
    with pytest.raises(JobError, match=rf"input file {re.escape(uri)} changed \(ETag {etag} -> \w+\) since the "
                                       r"output at s3://nightly/job/out/2001-02-03/ was written"):
        run_job(spec, progress=False)  # same size, other bytes: the ETag tells them apart
    after = json.loads(s3_env.get_object(Bucket="nightly", Key="job/out/2001-02-03/_manifest.json")["Body"].read())
    assert after["input"] == m["input"] and after["parts"] == m["parts"]  # refused before anything was written


# --------------------------------------------------------------------------------------------- {date}

def test_date_placeholder_gives_one_folder_per_run(tmp_path, tiny_pair, ray_session, monkeypatch, capsys):
    monkeypatch.delenv("SPECBATCH_DATE", raising=False)
    template = str(tmp_path / "nightly" / "{date}")
    path, _ = config(tmp_path, tiny_pair, rows_of(2), output__path=template, resources__num_workers=1)
    today = datetime.now(timezone.utc).date().isoformat()
    assert load_spec(path).output.path == str(tmp_path / "nightly" / today)
    day = tmp_path / "nightly" / "2001-02-03"

    assert cli(["run", path, "--no-progress", "--date", "2001-02-03"]) == 0
    assert (day / "_SUCCESS").exists() and not (tmp_path / "nightly" / today).exists()
    assert manifest_of(day)["spec"]["output"]["path"] == str(day)

    monkeypatch.setenv("SPECBATCH_DATE", "2001-02-03")  # a rerun on the same date resumes
    capsys.readouterr()
    assert cli(["run", path, "--no-progress", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows_this_run"] == 0
    assert cli(["status", path]) == 0
    assert "1/1 parts, 2/2 rows, finished" in capsys.readouterr().out

    monkeypatch.delenv("SPECBATCH_DATE")
    assert cli(["status", path]) == 1  # today's folder: nothing yet
    assert cli(["status", path, "--date", "2001-02-03"]) == 0
    assert cli(["status", template, "--date", "2001-02-03", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows_committed"] == 2
    assert cli(["report", template, "--date", "2001-02-03", "--out", str(tmp_path / "rep"),
                "--cpu-hour-price", "0.1"]) == 0
    assert (tmp_path / "rep" / "report.md").exists()


def test_unknown_placeholder_and_bad_date_refused(tmp_path, tiny_pair, monkeypatch, capsys):
    monkeypatch.delenv("SPECBATCH_DATE", raising=False)
    path, _ = config(tmp_path, tiny_pair, rows_of(2), output__path=str(tmp_path / "out-{foo}"))
    with pytest.raises(ConfigError, match=r"output\.path: unknown placeholder \{foo\} .*the one allowed is \{date\}"):
        load_spec(path)
    assert cli(["run", path, "--no-progress"]) == 2
    assert "output.path: unknown placeholder {foo}" in capsys.readouterr().err
    assert not any(p.name.startswith("out") for p in tmp_path.iterdir())

    path, _ = config(tmp_path, tiny_pair, rows_of(2), output__path=str(tmp_path / "out-{date}"))
    with pytest.raises(ConfigError, match=r"--date '2001-02-30' is not a date as YYYY-MM-DD"):
        load_spec(path, date="2001-02-30")
    monkeypatch.setenv("SPECBATCH_DATE", "yesterday")
    with pytest.raises(ConfigError, match=r"SPECBATCH_DATE 'yesterday' is not a date"):
        load_spec(path)
    assert load_spec(path, date="2001-02-03").output.path == str(tmp_path / "out-2001-02-03")  # --date wins
    with pytest.raises(ConfigError, match=r"output\.path: unknown placeholder \{day\}"):
        load_spec(path, ["output.path=out/{day}"])
