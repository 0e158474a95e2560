"""End-to-end jobs on a local Ray with tiny models: rows, schema, stats, bad input, resume, retries."""

from __future__ import annotations

import json
import os

import pytest

from job_helpers import COLUMNS, config, read_out, rows_of
from jobs.cli import main as cli
from jobs.driver import JobError, run_job
from jobs.spec import ConfigError, load_spec, parse_spec
from workers.inputs import InputError

def test_job_end_to_end(tmp_path, tiny_pair, ray_session):
    path, cfg = config(tmp_path, tiny_pair, rows_of(10))
    summary = run_job(load_spec(path), progress=False)
    out = tmp_path / "out"
    names = sorted(os.listdir(out))
    assert names == ["_SUCCESS", "_logs", "_manifest.json"] + [f"part-{i:05d}.parquet" for i in range(4)]
    assert os.listdir(out / "_logs")  # the workers' own output went to their log files
    rows, table = read_out(out)
    assert table.column_names == COLUMNS
    assert table.num_rows == 10 and sorted(rows) == sorted(f"r{i}" for i in range(10))
    for r in rows.values():
        assert r["finish_reason"] in ("stop", "length") and r["error"] is None
        assert sum(r["accept_lengths"]) == r["accepted_tokens"]
        assert sum(r["draft_lengths"]) == r["drafted_tokens"]
        assert r["generated_tokens"] == len(r["token_ids"]) <= r["accepted_tokens"] + r["rounds"]
        assert isinstance(r["completion"], str)
        assert r["verification"] == "lossless"  # the rule that accepted the row's tokens
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["spec"]["speculation"]["verification"] == "lossless"
    assert manifest["input"]["rows"] == 10 and manifest["num_shards"] == 4
    assert sum(p["rows"] for p in manifest["parts"].values()) == 10
    assert summary["rows_committed"] == 10 and summary["rows_failed_this_run"] == 0
    assert summary["step_path"] == "lean"  # a Llama model on CPU: the lean forward, no GPU memory to report
    assert summary["peak_gpu_gib_per_worker"] == {}

    # greedy speculative job output == plain autoregressive job output, token for token
    path2, _ = config(tmp_path, tiny_pair, rows_of(10), output__path=str(tmp_path / "plain"),
                      speculation__method="none")
    run_job(load_spec(path2), progress=False)
    plain, _ = read_out(tmp_path / "plain")
    assert {k: r["token_ids"] for k, r in plain.items()} == {k: r["token_ids"] for k, r in rows.items()}

    # a re-run of a finished job changes nothing
    before = {n: (out / n).stat().st_mtime_ns for n in names if n.startswith("part-")}
    again = run_job(load_spec(path), progress=False)
    assert again["rows_this_run"] == 0 and again["rows_committed"] == 10
    assert {n: (out / n).stat().st_mtime_ns for n in before} == before


def test_bad_rows_become_error_rows(tmp_path, tiny_pair, ray_session):
    rows = rows_of(4) + [{"id": "empty", "prompt": ""}, {"id": "missing"}, {"id": "num", "prompt": 7},
                         {"id": 12, "messages": None, "prompt": "the day"}]
    path, _ = config(tmp_path, tiny_pair, rows)
    summary = run_job(load_spec(path), progress=False)
    out, _ = read_out(tmp_path / "out")
    assert len(out) == 8 and "12" in out  # ids are written as strings
    for rid in ("empty", "missing", "num"):
        assert out[rid]["finish_reason"] == "error" and "prompt" in out[rid]["error"]
        assert out[rid]["token_ids"] == [] and out[rid]["completion"] is None
    assert out["r0"]["error"] is None and out["12"]["error"] is None
    assert summary["rows_failed_this_run"] == 3


def test_messages_column(tmp_path, tiny_pair, ray_session):
    rows = [{"id": "a", "msgs": [{"role": "user", "content": "the water is hot"}]},
            {"id": "b", "msgs": [{"role": "user"}]}]
    path, _ = config(tmp_path, tiny_pair, rows, input__messages_column="msgs", input__prompt_column=None)
    run_job(load_spec(path), progress=False)
    out, _ = read_out(tmp_path / "out")
    assert out["a"]["error"] is None and out["a"]["prompt_tokens"] > 4
    assert out["b"]["finish_reason"] == "error" and "msgs" in out["b"]["error"]


def test_duplicate_ids_refused_and_nothing_written(tmp_path, tiny_pair):
    rows = rows_of(6) + [{"id": "r2", "prompt": "again"}, {"id": "r4", "prompt": "again"}]
    path, _ = config(tmp_path, tiny_pair, rows)
    with pytest.raises(InputError, match="duplicate ids.*'r2', 'r4'"):
        run_job(load_spec(path), progress=False)
    assert not (tmp_path / "out").exists()


def test_config_errors_name_the_key(tmp_path, tiny_pair, capsys):
    path, cfg = config(tmp_path, tiny_pair, rows_of(2))
    with pytest.raises(ConfigError, match=r"speculation\.num_draft_tokenz: unknown key"):
        load_spec(path, ["speculation.num_draft_tokenz=3"])
    with pytest.raises(ConfigError, match=r"generation\.temperature"):
        load_spec(path, ["generation.temperature=-1"])
    with pytest.raises(ConfigError, match=r"resources\.gpu_memory_fraction: Input should be less than or equal to 1"):
        load_spec(path, ["resources.gpu_memory_fraction=1.5"])
    with pytest.raises(ConfigError, match="needs models.draft"):
        parse_spec({**cfg, "models": {"target": cfg["models"]["target"]}})
    with pytest.raises(ConfigError, match=r"resources\.kv_cache: Input should be 'dense' or 'paged'"):
        load_spec(path, ["resources.kv_cache=pages"])
    with pytest.raises(ConfigError, match=r"resources\.kv_cache: paged does not run with models\.target\.tensor_par"):
        load_spec(path, ["resources.kv_cache=paged", "models.target.tensor_parallel=2"])
    assert load_spec(path, ["resources.kv_cache=paged"]).resources.engine_settings()["kv_cache"] == "paged"
    spec = load_spec(path, ["generation.max_new_tokens=5", "resources.num_workers=1"])
    assert spec.generation.max_new_tokens == 5 and spec.resources.num_workers == 1
    assert cli(["run", path, "--set", "input.bogus=1"]) == 2
    assert "input.bogus: unknown key (input has: path, id_column, prompt_column" in capsys.readouterr().err


def test_a_typo_names_the_key_meant(tmp_path, tiny_pair, capsys):
    """An unknown key names the nearest key of its section, in the YAML as under --set, at any depth."""
    path, cfg = config(tmp_path, tiny_pair, rows_of(2))
    with pytest.raises(ConfigError, match=r"generation\.max_new_token: unknown key \(did you mean "
                                          r"generation\.max_new_tokens\?\)"):
        load_spec(path, ["generation.max_new_token=5"])
    with pytest.raises(ConfigError, match=r"models\.draft\.dtpye: unknown key \(did you mean models\.draft\.dtype\?\)"):
        parse_spec({**cfg, "models": {**cfg["models"], "draft": {**cfg["models"]["draft"], "dtpye": "float32"}}})
    with pytest.raises(ConfigError, match=r"generatoin: unknown key \(did you mean generation\?\)"):
        parse_spec({**cfg, "generatoin": {"seed": 1}})
    assert cli(["run", path, "--set", "resources.shard_timeout=60"]) == 2
    assert "resources.shard_timeout: unknown key (did you mean resources.shard_timeout_s?)" in capsys.readouterr().err


def test_a_worker_gets_the_jobs_sections_whole(tmp_path, tiny_pair):
    """The worker's spec is the job's own section objects (no copy, no rename), with the GPUs it asks for resolved
    against the cluster; the tensor-parallel group's timeout is its own key, not a stand-in for a null."""
    import pickle

    from jobs.spec import JobSpec
    from workers.spec import WorkerSpec

    path, _ = config(tmp_path, tiny_pair, rows_of(2))
    spec = load_spec(path, ["resources.batch_size=3", "resources.shard_timeout_s=null"])
    worker = spec.worker_spec(cluster_gpus=0)
    for name, field in WorkerSpec.model_fields.items():
        assert JobSpec.model_fields[name].annotation == field.annotation, name
        if name != "resources":
            assert getattr(worker, name) is getattr(spec, name), name
    same = {"exclude": {"gpus_per_worker"}}
    assert worker.resources.model_dump(**same) == spec.resources.model_dump(**same)
    assert spec.resources.gpus_per_worker is None and worker.resources.gpus_per_worker == 0 and not worker.use_gpu
    assert spec.worker_spec(cluster_gpus=4).resources.gpus_per_worker == 1
    assert load_spec(path, ["resources.gpus_per_worker=0.5"]).worker_spec(4).resources.gpus_per_worker == 0.5
    assert worker.resources.shard_timeout_s is None and worker.resources.group_timeout_s == 1800
    assert load_spec(path, ["resources.group_timeout_s=90"]).worker_spec(0).resources.group_timeout_s == 90
    assert pickle.loads(pickle.dumps(worker)) == worker  # what Ray sends the actor
    with pytest.raises(ValueError, match="gpus_per_worker resolved"):
        WorkerSpec(**{k: getattr(spec, k) for k in WorkerSpec.model_fields})


def test_local_paths_become_absolute_as_the_config_is_read(tmp_path, tiny_pair, monkeypatch):
    """Workers run in other folders: local paths are made absolute by the config's own validation (output always;
    input, models and head where they exist here), while s3://, pypi: and Hub ids stay as written."""
    path, cfg = config(tmp_path, tiny_pair, rows_of(2))
    (tmp_path / "head").mkdir()
    monkeypatch.chdir(tmp_path)
    data = {**cfg, "input": {**cfg["input"], "path": "in.jsonl"}, "output": {"path": "out/{date}"},
            "models": {"target": {"path": "org/hub-model"}, "draft": {"path": "pypi:llm-x==1"}},
            "speculation": {**cfg["speculation"], "draft_length": "acceptance_head",
                            "acceptance_head": {"path": "head"}}}
    before = json.dumps(data)
    spec = parse_spec(data, date="2001-02-03")
    assert json.dumps(data) == before  # the caller's dict is left as it was
    assert spec.input.path == str(tmp_path / "in.jsonl")
    assert spec.output.path == str(tmp_path / "out" / "2001-02-03")
    assert spec.speculation.acceptance_head.path == str(tmp_path / "head")
    assert spec.models.target.path == "org/hub-model" and spec.models.draft.path == "pypi:llm-x==1"
    s3 = parse_spec({**data, "input": {**data["input"], "path": "s3://b/in/"}, "output": {"path": "s3://b/out/"}})
    assert (s3.input.path, s3.output.path) == ("s3://b/in/", "s3://b/out/")


def test_output_neutral_keys_keep_the_fingerprint(tmp_path, tiny_pair):
    """Speed settings (marked output-neutral where they are declared: jobs.spec.OUTPUT_NEUTRAL) may change
    between runs of a job; anything else that changes output rows changes the fingerprint and is named."""
    from jobs.spec import OUTPUT_NEUTRAL, changed_keys
    path, cfg = config(tmp_path, tiny_pair, rows_of(2))
    base = load_spec(path)
    other = {"name": "'renamed'", "resources.num_workers": 3, "resources.gpus_per_worker": 1,
             "resources.cpus_per_worker": 2, "resources.batch_size": 7, "resources.max_retries": 9,
             "resources.gpu_memory_fraction": 0.5, "resources.shard_timeout_s": 60,
             "resources.group_timeout_s": 90, "speculation.verify_padding": "false",
             "resources.prefix_caching": "false", "resources.prefix_cache_gib": 2,
             "resources.prefill_chunk": 64, "resources.kv_cache": "paged"}
    assert set(other) == set(OUTPUT_NEUTRAL)
    for key, value in other.items():
        changed = load_spec(path, [f"{key}={value}"])
        assert changed.fingerprint() == base.fingerprint(), key
        assert changed_keys(base.model_dump(mode="json"), changed.model_dump(mode="json")) == []
    seeded = load_spec(path, ["generation.seed=5", "speculation.max_draft_tokens=4"])
    assert seeded.fingerprint() != base.fingerprint()
    assert changed_keys(base.model_dump(mode="json"), seeded.model_dump(mode="json")) == \
        ["generation.seed", "speculation.max_draft_tokens"]


def test_settings_the_choices_ignore_keep_the_fingerprint(tmp_path, tiny_pair):
    """A setting that the config's method or policy never reads changes no row: goodput reads no
    num_draft_tokens, draft_model no prompt_lookup, method none no drafting setting. Changing one keeps the
    fingerprint, and an output recorded with another value (a manifest written before such settings were left
    out) resumes; under a policy that reads it, it is refused, named."""
    from jobs.manifest import MANIFEST, prepare_output
    from workers.storage import open_storage
    path, _ = config(tmp_path, tiny_pair, rows_of(2))
    base = load_spec(path, ["speculation.draft_length=goodput"])
    for key, value in (("speculation.num_draft_tokens", 5), ("speculation.confidence_threshold", 0.7),
                       ("speculation.prompt_lookup.max_ngram", 3)):
        assert load_spec(path, ["speculation.draft_length=goodput", f"{key}={value}"]).fingerprint() == \
            base.fingerprint(), key
    plain = ["speculation.method=none"]
    assert load_spec(path, plain + ["speculation.max_draft_tokens=3", "speculation.draft_length=fixed"]).fingerprint() \
        == load_spec(path, plain).fingerprint()
    fixed = load_spec(path, ["speculation.draft_length=fixed"])
    assert load_spec(path, ["speculation.draft_length=fixed", "speculation.num_draft_tokens=5"]).fingerprint() != \
        fixed.fingerprint()

    five = load_spec(path, ["speculation.draft_length=goodput", "speculation.num_draft_tokens=5"])
    storage = open_storage(five.output.path)
    manifest = prepare_output(five, storage, [], 0, [], overwrite=False)
    manifest["fingerprint"] = "of an older release, num_draft_tokens in it"
    storage.put(MANIFEST, json.dumps(manifest).encode())
    assert prepare_output(base, storage, [], 0, [], overwrite=False)["fingerprint"] == base.fingerprint()
    with pytest.raises(JobError, match=r"changed: speculation\.draft_length, speculation\.num_draft_tokens"):
        prepare_output(load_spec(path, ["speculation.draft_length=fixed", "speculation.num_draft_tokens=3"]),
                       storage, [], 0, [], overwrite=False)


def test_parsing_a_job_imports_no_torch(tmp_path, tiny_pair):
    """The config's choices (methods, policies) come from a module that imports nothing heavy: validating a job,
    its fingerprint included, loads no torch (in a fresh interpreter)."""
    import subprocess
    import sys
    path, _ = config(tmp_path, tiny_pair, rows_of(2))
    code = ("import sys, jobs.spec; s = jobs.spec.load_spec(sys.argv[1], ['speculation.method=prompt_lookup']); "
            "s.fingerprint(); jobs.spec.config_reference(); "
            "assert 'torch' not in sys.modules, [m for m in sys.modules if m.startswith(('specdec', 'workers'))]")
    subprocess.run([sys.executable, "-c", code, path], check=True, cwd=os.path.dirname(os.path.dirname(__file__)))


def test_coupled_jobs_fingerprint_their_noise_version(tmp_path, tiny_pair, monkeypatch):
    """Coupled sampling's samples change with its noise (specdec.choices.COUPLED_NOISE_VERSION): an output begun under
    another version, or before versions were recorded, is refused naming it; other jobs' fingerprints ignore it."""
    import jobs.spec
    from jobs.manifest import MANIFEST, prepare_output
    from workers.storage import open_storage
    path, _ = config(tmp_path, tiny_pair, rows_of(2))
    plain, coupled = load_spec(path), load_spec(path, ["speculation.sampling=coupled"])
    storage = open_storage(coupled.output.path)
    manifest = prepare_output(coupled, storage, [], 0, [], overwrite=False)
    assert manifest["versions"] == {"coupled_noise": jobs.spec.COUPLED_NOISE_VERSION}
    storage.put(MANIFEST, json.dumps(manifest).encode())
    assert prepare_output(coupled, storage, [], 0, [], overwrite=False)["fingerprint"] == manifest["fingerprint"]
    before = plain.fingerprint()
    monkeypatch.setattr(jobs.spec, "COUPLED_NOISE_VERSION", jobs.spec.COUPLED_NOISE_VERSION + 1)
    assert plain.fingerprint() == before and coupled.fingerprint() != manifest["fingerprint"]
    with pytest.raises(JobError, match=f"coupled_noise version {manifest['versions']['coupled_noise']} -> "):
        prepare_output(coupled, storage, [], 0, [], overwrite=False)
    older = {k: v for k, v in manifest.items() if k != "versions"}  # an output from before versions were recorded
    storage.put(MANIFEST, json.dumps(older).encode())
    with pytest.raises(JobError, match="coupled_noise version unrecorded -> "):
        prepare_output(coupled, storage, [], 0, [], overwrite=False)


def test_changed_config_refused_unless_overwrite(tmp_path, tiny_pair, ray_session):
    path, _ = config(tmp_path, tiny_pair, rows_of(3))
    run_job(load_spec(path), progress=False)
    with pytest.raises(JobError, match="generation.max_new_tokens"):
        run_job(load_spec(path, ["generation.max_new_tokens=5"]), progress=False)
    # worker count and batch size do not change rows: allowed
    run_job(load_spec(path, ["resources.num_workers=1", "resources.batch_size=2"]), progress=False)
    run_job(load_spec(path, ["generation.max_new_tokens=5"]), overwrite=True, progress=False)
    out, _ = read_out(tmp_path / "out")
    assert len(out) == 3 and all(r["generated_tokens"] <= 5 for r in out.values())


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_committed_files_follow_the_umask(tmp_path, umask):
    """Parts, the manifest and _SUCCESS are created as any file of the user's: 0666 less the umask (a temp file
    from mkstemp would make them 0600 whatever the umask)."""
    from workers.storage import LocalStorage

    old = os.umask(umask)
    try:
        st = LocalStorage(str(tmp_path / "out"))
        assert st.put_if_absent("part-00000.parquet", b"rows") is True
        st.put("_manifest.json", b"{}")
        st.put("_manifest.json", b"{}")  # replaced, still as the umask says
    finally:
        os.umask(old)
    for name in ("part-00000.parquet", "_manifest.json"):
        assert (tmp_path / "out" / name).stat().st_mode & 0o777 == 0o666 & ~umask, name
    assert not [n for n in os.listdir(tmp_path / "out") if n.startswith(".tmp-")]


def test_a_run_under_a_umask_writes_files_others_may_read(tmp_path, tiny_pair):
    """`specbatch run` in a process whose umask is 027 (its embedded Ray and workers inherit it): every file it
    commits is 0640, group-readable, as the user's other files are; and its summary names both throughputs."""
    import subprocess
    import sys

    path, _ = config(tmp_path, tiny_pair, rows_of(4), resources__num_workers=1)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, "-m", "jobs.cli", "run", path, "--no-progress", "--json"], env=env,
                          capture_output=True, text=True, timeout=600, preexec_fn=lambda: os.umask(0o027))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = tmp_path / "out"
    files = [p for p in out.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"part-00000.parquet", "part-00001.parquet", "_manifest.json", "_SUCCESS"}
    assert any(p.parent.name == "_logs" for p in files)  # the workers' own log files too
    assert {p.name: p.stat().st_mode & 0o777 for p in files} == {p.name: 0o640 for p in files}
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["generated_tokens"] > 0 and summary["worker_tokens_per_s"] > summary["job_tokens_per_s"] > 0
    assert "tokens/s for the job (wall clock)" in proc.stdout and "tokens/s per worker (on its parts)" in proc.stdout


def test_status(tmp_path, tiny_pair, ray_session, capsys):
    path, _ = config(tmp_path, tiny_pair, rows_of(4))
    assert cli(["status", path]) == 1
    run_job(load_spec(path), progress=False)
    capsys.readouterr()
    assert cli(["status", path]) == 0
    assert "2/2 parts, 4/4 rows, finished" in capsys.readouterr().out


def test_the_driver_says_what_a_loading_worker_does_and_what_an_unplaced_one_waits_for(tmp_path, tiny_pair,
                                                                                      ray_session):
    """A placed worker held while it loads its models (workers/faults.py's gate) is said to be loading, on its node,
    never to wait for room, however long it has taken; a worker asking for more CPUs than the cluster has is said
    to wait for a node with room."""
    import time

    from jobs.pool import Pool

    gate = tmp_path / "gate"
    gate.mkdir()
    path, _ = config(tmp_path, tiny_pair, rows_of(2), resources__num_workers=1)
    long_ago = time.monotonic() - 3600  # as if the workers had waited an hour
    said: list[str] = []
    pool = Pool(load_spec(path).worker_spec(0), {"SPECBATCH_FAULT_GATE": str(gate)}, say=said.append)
    try:
        pool.start(1)
        t0 = time.monotonic()
        while not list(gate.glob("*.init")):  # loaded its models, held before it is ready
            assert time.monotonic() - t0 < 300
            time.sleep(0.1)
        pid = next(gate.glob("*.init")).name.split(".")[0]
        from workers import loading
        while not (loading.read(pool.key) or {}):  # the stage it told, visible to the driver
            assert time.monotonic() - t0 < 300
            time.sleep(0.1)
        pool.say_waiting(long_ago)
        assert len(said) == 1 and said[0].startswith("specbatch: worker ") and f":{pid} on node " in said[0]
        assert said[0].endswith("s since it started)") and ": loading the models on cpu (" in said[0]
        pool.say_waiting(long_ago)
        assert len(said) == 1  # a stage is said once
        (gate / "open").touch()
        assert len(pool.wait_for(1)) == 1
    finally:
        pool.close()
    assert not any("wait for a node" in line for line in said)

    said.clear()
    big = load_spec(path).worker_spec(0).model_copy(update={"resources": load_spec(path).resources.model_copy(
        update={"cpus_per_worker": 64, "gpus_per_worker": 0})})
    pool = Pool(big, {}, say=said.append)
    try:
        pool.start(1)
        time.sleep(2)
        pool.say_waiting(long_ago)
    finally:
        pool.close()
    assert len(said) == 1 and said[0].startswith("specbatch: 1 of 1 workers wait for a node with room for "
                                                 "{'CPU': 64")
