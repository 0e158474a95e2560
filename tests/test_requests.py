"""Inputs and outputs people already have: OpenAI Batch files in and out, per-row settings, stop strings,
kept columns, and status figures, through real jobs on the tiny pair."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from job_helpers import TEXTS, config, write_jsonl
from jobs.driver import run_job
from jobs.spec import ConfigError, load_spec
from specdec.sched.stops import StopStrings


def parts(folder) -> dict:
    rows = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".parquet"):
            rows += pq.read_table(os.path.join(folder, name)).to_pylist()
    return {r["id"]: r for r in rows}


def openai_lines(folder) -> dict:
    sub = os.path.join(folder, "_openai_batch")
    lines = []
    for name in sorted(os.listdir(sub)):
        with open(os.path.join(sub, name)) as f:
            lines += [json.loads(line) for line in f]
    return {line["custom_id"]: line for line in lines}


def requests():
    """Request lines written as the OpenAI Batch API documents them."""
    chat = [{"custom_id": f"chat-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "any", "messages": [{"role": "system", "content": "be brief"},
                                                   {"role": "user", "content": TEXTS[i]}],
                      "max_tokens": 4 + i}} for i in range(4)]
    text = [{"custom_id": "text-0", "method": "POST", "url": "/v1/completions",
             "body": {"model": "any", "prompt": TEXTS[4], "max_tokens": 6, "temperature": 0.8, "seed": 3,
                      "logprobs": 2, "n": 1, "frequency_penalty": 0.5}}]
    bad = [{"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
           {"custom_id": "bad-temp", "method": "POST", "url": "/v1/completions",
            "body": {"prompt": "the water", "temperature": -1}}]
    return chat + text + bad


def test_openai_batch_in_and_out(tmp_path, tiny_pair, ray_session):
    path, _ = config(tmp_path, tiny_pair, [], input__format="openai_batch", output__format="openai_batch",
                     generation__max_new_tokens=12)
    spec = load_spec(path)
    inp = write_jsonl(tmp_path / "batch.jsonl", requests())
    spec = spec.model_copy(update={"input": spec.input.model_copy(update={"path": inp})})
    run_job(spec, progress=False)
    out, lines = parts(tmp_path / "out"), openai_lines(tmp_path / "out")
    assert set(out) == set(lines) == {r["custom_id"] for r in requests()}  # every request answered once
    for i in range(4):
        row, line = out[f"chat-{i}"], lines[f"chat-{i}"]
        assert row["generated_tokens"] <= 4 + i and row["chat"]  # the request's own max_tokens
        body = line["response"]["body"]
        assert line["response"]["status_code"] == 200 and line["error"] is None
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"] == {"role": "assistant", "content": row["completion"]}
        assert body["choices"][0]["finish_reason"] == row["finish_reason"]
        assert body["usage"] == {"prompt_tokens": row["prompt_tokens"], "completion_tokens": row["generated_tokens"],
                                 "total_tokens": row["prompt_tokens"] + row["generated_tokens"],
                                 "prompt_tokens_details": {"cached_tokens": row["cached_prompt_tokens"]}}
    text = lines["text-0"]["response"]["body"]
    assert text["object"] == "text_completion" and text["choices"][0]["text"] == out["text-0"]["completion"]
    assert out["text-0"]["warnings"] == "ignored request keys: frequency_penalty"  # reported, not silently dropped
    assert len(out["text-0"]["logprobs"]) == out["text-0"]["generated_tokens"]  # completions' logprobs: 2 is top 2
    assert all(len(top) == 2 for top in out["text-0"]["top_logprobs"])
    assert len(text["choices"][0]["logprobs"]["content"]) == out["text-0"]["generated_tokens"]
    assert lines["bad-url"]["response"] is None and lines["bad-url"]["error"]["code"] == "bad_request"
    assert out["bad-temp"]["error"].startswith("bad_sampling: temperature")


def test_row_settings_stop_strings_kept_columns_and_status(tmp_path, tiny_pair, ray_session):
    rows = [{"id": f"r{i}", "prompt": TEXTS[i % len(TEXTS)], "topic": f"t{i}", "max_new_tokens": 3 + i % 3}
            for i in range(9)]
    path, _ = config(tmp_path, tiny_pair, rows, input__sampling_columns=["max_new_tokens"],
                     output__keep_columns=["topic"], generation__max_new_tokens=20)
    run_job(load_spec(path), progress=False)
    out = parts(tmp_path / "out")
    for r in rows:
        assert out[r["id"]]["topic"] == r["topic"]  # carried through
        assert out[r["id"]]["generated_tokens"] <= r["max_new_tokens"]
    # stop strings: rerun one row with a stop string taken from the middle of its completion
    long_path, _ = config(tmp_path, tiny_pair, [{"id": "x", "prompt": TEXTS[4]}], generation__max_new_tokens=20,
                          output__path=str(tmp_path / "long"))
    run_job(load_spec(long_path), progress=False)
    full = parts(tmp_path / "long")["x"]
    words = full["completion"].split(" ")
    assert len(words) >= 4, full["completion"]
    stop = " ".join(words[2:4])  # spans tokens (word-level tokenizer)
    stop_path, _ = config(tmp_path, tiny_pair, [{"id": "x", "prompt": TEXTS[4]}], generation__max_new_tokens=20,
                          generation__stop=[stop], output__path=str(tmp_path / "stopped"))
    run_job(load_spec(stop_path), progress=False)
    cut = parts(tmp_path / "stopped")["x"]
    assert cut["finish_reason"] == "stop" and cut["completion"] == full["completion"][: full["completion"].find(stop)]
    assert cut["token_ids"] == full["token_ids"][: len(cut["token_ids"])] < full["token_ids"]
    # status from the manifest: rows, tokens in and out, tokens per target call
    proc = subprocess.run([sys.executable, "-m", "jobs.cli", "status", str(tmp_path / "out"), "--json"],
                          capture_output=True, text=True, check=True)
    status = json.loads(proc.stdout)
    good = [r for r in out.values() if not r["error"]]
    assert status["rows_committed"] == 9 and status["finished"]
    assert status["generated_tokens"] == sum(r["generated_tokens"] for r in good)
    assert status["prompt_tokens"] == sum(r["prompt_tokens"] for r in good)
    assert status["tokens_per_target_call"] == pytest.approx(
        sum(r["generated_tokens"] for r in good) / sum(r["rounds"] for r in good))


def test_stop_strings_end_inside_a_drafted_run_and_across_tokens():
    class Letters:  # token i decodes to the i-th letter (a tokenizer whose pieces are single characters)
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(ord("a") + i) for i in ids)

    stops = StopStrings(Letters())
    # "cd" completed by the 2nd token of this round's run, spanning the previous round's last token
    assert stops.find([0, 1, 2], [3, 4, 5], ("cd",)) == (1, "cd")
    assert stops.find([0, 1], [2, 3, 4, 5], ("de", "zz")) == (3, "de")  # ends inside the drafted run
    assert stops.find([0, 1], [2, 3], ("ab",)) is None  # already before this round: not a new match
    assert stops.find([], [7, 8], ("x",)) is None


def test_row_setting_columns_and_kept_columns_are_checked(tmp_path, tiny_pair):
    path, _ = config(tmp_path, tiny_pair, [{"id": "a", "prompt": "the"}], input__sampling_columns=["temprature"])
    with pytest.raises(ConfigError, match="input.sampling_columns"):
        load_spec(path)
    path, _ = config(tmp_path, tiny_pair, [{"id": "a", "prompt": "the"}], output__keep_columns=["completion"])
    with pytest.raises(ConfigError, match="output.keep_columns"):
        load_spec(path)
