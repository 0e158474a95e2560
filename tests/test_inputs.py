"""Inputs at scale and bad input: shards read from where the scan says they start; every input line
becomes exactly one output row, an error row with a reason where it cannot be generated."""

from __future__ import annotations

import json
import os
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from job_helpers import config, read_out, rows_of
from jobs.cli import main as cli
from jobs.spec import ConfigError, load_spec
from workers import inputs
from workers.inputs import read_shard, scan


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


class CountingFile:
    """A file that counts the bytes read through it."""

    def __init__(self, f, counter):
        self.f, self.counter = f, counter

    def read(self, n=-1):
        data = self.f.read(n)
        self.counter.append(len(data))
        return data

    def __iter__(self):
        for line in self.f:
            self.counter.append(len(line))
            yield line

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def test_jsonl_shards_read_only_their_own_bytes(tmp_path, monkeypatch):
    lines = []
    for i in range(1000):
        lines.append(json.dumps({"id": f"r{i}", "prompt": "x" * (i % 17)}))
        if i % 97 == 0:
            lines.append("   ")  # blank lines are not records
    path = write_lines(tmp_path / "in.jsonl", lines)
    shards, total = scan(path, "id", 64)
    assert total == 1000 and len(shards) == 16
    every = [rec for s in shards for rec in read_shard(s, "id", ["id", "prompt"])]
    assert [r.id for r in every] == [f"r{i}" for i in range(1000)]
    counted: list[int] = []
    real_open = inputs.open_input
    monkeypatch.setattr(inputs, "open_input", lambda uri, **kw: CountingFile(real_open(uri, **kw), counted))
    last = read_shard(shards[-1], "id", ["id", "prompt"])
    assert [r.id for r in last] == [f"r{i}" for i in range(960, 1000)]
    assert sum(counted) == shards[-1].nbytes < os.path.getsize(path) / 10  # its own bytes, not the file's prefix


def test_parquet_shards_start_inside_row_groups(tmp_path):
    table = pa.table({"id": [f"p{i}" for i in range(1000)], "prompt": ["hi"] * 1000})
    path = str(tmp_path / "in.parquet")
    pq.write_table(table, path, row_group_size=150)  # shard boundaries fall inside row groups
    shards, total = scan(path, "id", 64)
    assert total == 1000 and {s.offset for s in shards} == set(range(7))
    assert any(s.skip for s in shards)
    every = [rec.id for s in shards for rec in read_shard(s, "id", ["id", "prompt"])]
    assert every == [f"p{i}" for i in range(1000)]


@pytest.fixture(scope="module")
def nan_target(tiny_pair, tmp_path_factory):
    """The tiny target with NaN weights in the embedding of "sound": rows whose prompt holds it get NaN logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder = tmp_path_factory.mktemp("nan") / "target"
    shutil.copytree(tiny_pair["target"], folder)
    tok = AutoTokenizer.from_pretrained(tiny_pair["target"])
    model = AutoModelForCausalLM.from_pretrained(tiny_pair["target"])
    with torch.no_grad():
        model.get_input_embeddings().weight[tok.convert_tokens_to_ids("sound")] = float("nan")
    model.save_pretrained(folder)
    return str(folder)


def test_every_line_becomes_a_row_with_a_reason(tmp_path, tiny_pair, nan_target, ray_session, capsys):
    good = rows_of(4)
    lines = [json.dumps(r) for r in good] + [
        "{not json",  # line 5
        "[1, 2, 3]",  # line 6: not an object
        json.dumps({"id": "empty", "prompt": ""}),
        json.dumps({"id": "null", "prompt": None}),
        json.dumps({"id": "nocolumn", "text": "the day"}),
        json.dumps({"prompt": "a row with no id"}),  # line 10
        json.dumps({"id": None, "prompt": "a row with a null id"}),  # line 11
        json.dumps({"id": "long", "prompt": " ".join(["the"] * 600)}),
        json.dumps({"id": "nan", "prompt": "what sound is that"}),
        "",  # a blank line is not a record
    ]
    path, cfg = config(tmp_path, tiny_pair, [])
    write_lines(tmp_path / "in.jsonl", lines)
    args = ["--set", f"models.target.path={nan_target}", "--set", "speculation.method=none"]
    assert cli(["run", path, "--no-progress", *args]) == 0  # error rows are data: exit 0 by default
    out, table = read_out(tmp_path / "out")
    assert table.num_rows == 13  # every non-blank line, exactly once
    reason = {k: (r["error"] or "").split(":")[0] for k, r in out.items()}
    assert {k: v for k, v in reason.items() if v} == {
        "in.jsonl:5": "invalid_json", "in.jsonl:6": "not_an_object", "empty": "empty_prompt",
        "null": "empty_prompt", "nocolumn": "missing_prompt", "long": "prompt_too_long",
        "nan": "non_finite_logits"}
    assert out["in.jsonl:10"]["error"] is None and out["in.jsonl:11"]["error"] is None  # ids from file and line
    assert all(out[r["id"]]["finish_reason"] in ("stop", "length") for r in good)
    printed = capsys.readouterr().out
    assert "error rows by reason: empty_prompt 2, invalid_json 1, missing_prompt 1, non_finite_logits 1, " \
           "not_an_object 1, prompt_too_long 1" in printed
    assert cli(["status", path]) == 0
    assert "error rows: empty_prompt 2, invalid_json 1" in capsys.readouterr().out
    assert cli(["run", path, "--no-progress", "--fail-on-row-errors", *args]) == 3  # a finished job, still errors
    # input.truncate: left keeps the long prompt's last tokens instead
    assert cli(["run", path, "--no-progress", "--overwrite", "--set", "input.truncate=left", *args]) == 0
    out, _ = read_out(tmp_path / "out")
    assert out["long"]["error"] is None and out["long"]["prompt_tokens"] < 600


def test_tokenizer_and_message_failures_are_row_errors(tmp_path, tiny_pair, ray_session):
    rows = [{"id": "ok", "msgs": [{"role": "user", "content": "the water is hot"}]},
            {"id": "role", "msgs": [{"role": "bad", "content": "the day"}]},  # the chat template raises
            {"id": "shape", "msgs": [{"role": "user"}]}]
    path, _ = config(tmp_path, tiny_pair, rows, input__messages_column="msgs", input__prompt_column=None)
    assert cli(["run", path, "--no-progress"]) == 0
    out, _ = read_out(tmp_path / "out")
    assert out["ok"]["error"] is None
    assert out["role"]["error"].startswith("tokenizer: ") and "unknown role" in out["role"]["error"]
    assert out["shape"]["error"].startswith("bad_messages: ")


def test_bad_configs_name_the_key_and_the_allowed_values(tmp_path, tiny_pair):
    path, _ = config(tmp_path, tiny_pair, rows_of(2))
    with pytest.raises(ConfigError, match=r"speculation\.method: Input should be 'none', 'draft_model' or "
                                          r"'prompt_lookup'"):
        load_spec(path, ["speculation.method=magic"])
    with pytest.raises(ConfigError, match=r"input\.truncate: Input should be 'error' or 'left'"):
        load_spec(path, ["input.truncate=right"])
