"""Dataset synthesis through real jobs (local Ray, a tiny pair with a byte-level BPE tokenizer, llguidance):
prompts built from columns, per-row output formats, `n` samples as rows, logprobs, `parsed` and its columns,
the OpenAI Batch output, and the same samples on a rerun and after a resume."""

from __future__ import annotations

import json
import os
import re

import jsonschema
import pyarrow.parquet as pq
import pytest

from job_helpers import write_jsonl
from jobs.driver import run_job
from jobs.spec import ConfigError, parse_spec
from test_requests import openai_lines
from test_synthesis import PERSON, bpe_models

TOPICS = [{"id": f"t{i}", "topic": topic, "level": level} for i, (topic, level) in
          enumerate([("the fox", "first"), ("a dog", "second"), ("red", "third"), ("blue", "fourth"),
                     ("green", "fifth")])]
TEMPLATE = "Write a person about {topic} for a {level} reader."


@pytest.fixture(scope="module")
def bpe_pair(tmp_path_factory):
    """{'target', 'draft'}: HF folders of tiny Llamas over a byte-level BPE tokenizer with a chat template."""
    return bpe_models(tmp_path_factory.mktemp("bpe-models"))


def synthesis_spec(tmp_path, pair, rows, out="out", **sections):
    data = {
        "name": "synth",
        "input": {"path": write_jsonl(tmp_path / f"{out}.jsonl", rows), "prompt_template": TEMPLATE,
                  "system_prompt": "Answer in JSON.", "chat_template": True,
                  "sampling_columns": ["n", "response_format"]},
        "output": {"path": str(tmp_path / out), "format": "openai_batch", "parsed_columns": ["name", "age", "ok"]},
        "models": {"target": {"path": pair["target"], "dtype": "float32"},
                   "draft": {"path": pair["draft"], "dtype": "float32"}},
        "generation": {"max_new_tokens": 40, "temperature": 0.8, "seed": 7, "n": 2, "logprobs": True,
                       "top_logprobs": 3,
                       "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}},
        "speculation": {"method": "draft_model", "num_draft_tokens": 3},
        "resources": {"num_workers": 1, "batch_size": 8, "shard_size": 3},
    }
    for key, value in sections.items():
        section, _, name = key.partition("__")
        data[section][name] = value
    return parse_spec(data)


def rows_of(folder) -> list[dict]:
    out = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".parquet"):
            out += pq.read_table(os.path.join(folder, name)).to_pylist()
    return out


def synthesis_rows():
    regex = {"type": "regex", "regex": "20[0-9]{2}-(0[1-9]|1[0-2])"}
    bad = {"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}}
    return TOPICS + [
        {"id": "three", "topic": "the dog", "level": "sixth", "n": 3},
        {"id": "date", "topic": "a date", "level": "last", "response_format": json.dumps(regex)},  # JSON text
        {"id": "no-level", "topic": "the fox"},
        {"id": "bad-schema", "topic": "x", "level": "y", "response_format": bad},
    ]


def test_a_synthesis_job_end_to_end(tmp_path, bpe_pair, ray_session):
    run_job(synthesis_spec(tmp_path, bpe_pair, synthesis_rows()), progress=False)
    rows = rows_of(tmp_path / "out")
    by_id: dict[str, list[dict]] = {}
    for r in rows:
        by_id.setdefault(r["id"], []).append(r)
    assert [r["sample_index"] for r in by_id["t0"]] == [0, 1] and len(by_id["three"]) == 3  # n samples, as rows
    assert by_id["no-level"][0]["error"] == "missing_column: the row has no 'level' (input.prompt_template)"
    bad = by_id["bad-schema"]  # one error row for the input row, not one per sample
    assert len(bad) == 1 and bad[0]["error"].startswith("bad_response_format:") and "nope" in bad[0]["error"]
    people = [r for t in [*TOPICS, {"id": "three"}] for r in by_id[t["id"]]]
    assert all(r["error"] is None for r in people)
    stopped = [r for r in people if r["finish_reason"] == "stop"]
    assert len(stopped) >= len(people) // 2  # the schema was completed, not just cut at max_new_tokens
    for r in stopped:
        obj = json.loads(r["completion"])
        jsonschema.validate(obj, PERSON)
        assert json.loads(r["parsed"]) == obj and (r["name"], r["age"], r["ok"]) == (obj["name"], obj["age"], obj["ok"])
    assert all(r["parsed"] is None and r["name"] is None for r in people if r["finish_reason"] == "length")
    assert sum(r["forced_tokens"] for r in people) >= 8 * len(stopped)  # keys and punctuation: jump-forward
    for key in ("t0", "t1", "t2", "three"):  # a prompt's samples are distinct draws
        assert len({tuple(r["token_ids"]) for r in by_id[key]}) > 1
    date = by_id["date"]
    assert all(r["parsed"] is None for r in date)
    assert [r for r in date if r["finish_reason"] == "stop"] and all(
        r["completion"][:2] == "20" and len(r["completion"]) == 7 for r in date if r["finish_reason"] == "stop")
    for r in people + date:  # a logprob and the top 3 per generated token, the token among them where it ranks
        assert len(r["logprobs"]) == len(r["tokens"]) == len(r["top_logprobs"]) == r["generated_tokens"]
        for t, lp, top in zip(r["token_ids"], r["logprobs"], r["top_logprobs"]):
            assert 1 <= len(top) <= 3 and lp <= 0 and top[0]["logprob"] >= lp - 1e-5
            assert t not in {x["token_id"] for x in top} or lp == pytest.approx(
                next(x["logprob"] for x in top if x["token_id"] == t), abs=1e-5)

    lines = openai_lines(tmp_path / "out")
    assert set(lines) == set(by_id)  # one line per input row
    body = lines["three"]["response"]["body"]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["usage"]["completion_tokens"] == sum(r["generated_tokens"] for r in by_id["three"])
    for choice, r in zip(body["choices"], by_id["three"]):
        assert choice["message"]["content"] == r["completion"]
        content = choice["logprobs"]["content"]
        assert [c["token"] for c in content] == r["tokens"] and [c["logprob"] for c in content] == pytest.approx(
            r["logprobs"])
        assert all(bytes(c["bytes"]).decode() == c["token"] and len(c["top_logprobs"]) <= 3 for c in content)
    assert lines["bad-schema"]["error"]["code"] == "bad_response_format"
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    assert sum(p["rows"] for p in manifest["parts"].values()) == len(synthesis_rows())  # input rows, not samples


def test_samples_are_the_same_on_a_rerun_and_after_a_resume(tmp_path, bpe_pair, ray_session):
    rows = TOPICS[:4]
    # coupled sampling: the tokens do not depend on the draft lengths goodput chooses from measured times
    spec = synthesis_spec(tmp_path, bpe_pair, rows, out="first", generation__n=3, input__sampling_columns=[],
                          speculation__sampling="coupled")
    run_job(spec, progress=False)
    first = {(r["id"], r["sample_index"]): r["token_ids"] for r in rows_of(tmp_path / "first")}
    assert len(first) == 12
    again = synthesis_spec(tmp_path, bpe_pair, rows, out="again", generation__n=3, input__sampling_columns=[],
                           speculation__sampling="coupled", speculation__draft_length="fixed",
                           speculation__num_draft_tokens=1)  # other draft lengths: the same samples
    run_job(again, progress=False)
    assert {(r["id"], r["sample_index"]): r["token_ids"] for r in rows_of(tmp_path / "again")} == first
    os.remove(tmp_path / "first" / "part-00000.parquet")  # as if the job had died before this part
    os.remove(tmp_path / "first" / "_SUCCESS")
    run_job(spec, progress=False)  # resumed: only that part is generated again
    resumed = {(r["id"], r["sample_index"]): r["token_ids"] for r in rows_of(tmp_path / "first")}
    assert resumed == first


@pytest.mark.parametrize("section,value,message", [
    ("input", {"prompt_template": "about {topic.x}"}, "input.prompt_template: {topic.x} is not a column name"),
    ("input", {"prompt_template": "about {", "chat_template": True}, "input.prompt_template"),
    ("input", {"system_prompt": "be brief"}, "input.system_prompt needs input.chat_template"),
    ("input", {"prompt_template": "{a}", "messages_column": "m"}, "does not go with input.messages_column"),
    ("output", {"parsed_columns": ["completion"]}, "output.parsed_columns: ['completion'] are output columns"),
    ("generation", {"response_format": {"type": "regex"}}, "response_format type regex needs response_format.regex"),
    ("input", {"sampling_columns": ["n", "best_of"]}, "['best_of'] are not settings"),
])
def test_synthesis_settings_are_checked(tmp_path, section, value, message):
    data = {"name": "x", "input": {"path": "in.jsonl"}, "output": {"path": str(tmp_path)},
            "models": {"target": {"path": "t"}}, "speculation": {"method": "none"}}
    data[section] = {**data.get(section, {}), **value}
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_spec(data)


def test_openai_batch_requests_carry_formats_samples_and_logprobs(tmp_path, bpe_pair, ray_session):
    """Chat requests as the OpenAI Batch API writes them: `response_format`, `n`, `logprobs` and `top_logprobs`
    in the body come back as `n` choices that follow the format, with their logprobs; a schema the engine cannot
    compile answers its own request with an error and the others go on."""
    person = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    bad = {"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {"a": {"$ref": "#/x"}}}}}

    def request(cid, text, **body):
        return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "any", "messages": [{"role": "user", "content": text}], "max_tokens": 40,
                         "temperature": 0.8, "seed": 5, **body}}

    requests = [request(f"p{i}", f"Describe person {i}", response_format=person, n=2, logprobs=True, top_logprobs=2)
                for i in range(3)]
    requests += [request("obj", "Any object", response_format={"type": "json_object"}, n=1),
                 request("free", "the fox", n=2), request("bad", "x", response_format=bad, n=2)]
    spec = synthesis_spec(tmp_path, bpe_pair, [], input__prompt_template=None, input__system_prompt=None,
                          input__sampling_columns=[], input__format="openai_batch",
                          input__path=write_jsonl(tmp_path / "batch.jsonl", requests), output__parsed_columns=[],
                          generation__n=1, generation__logprobs=False, generation__top_logprobs=0,
                          generation__response_format=None)
    run_job(spec, progress=False)
    lines, rows = openai_lines(tmp_path / "out"), rows_of(tmp_path / "out")
    assert set(lines) == {r["custom_id"] for r in requests}
    assert lines["bad"]["response"] is None and lines["bad"]["error"]["code"] == "bad_response_format"
    assert "'/x'" in lines["bad"]["error"]["message"]  # the engine's own message
    completed = 0
    for i in range(3):
        choices = lines[f"p{i}"]["response"]["body"]["choices"]
        assert [c["index"] for c in choices] == [0, 1]
        assert choices[0]["message"]["content"] != choices[1]["message"]["content"] or \
            choices[0]["logprobs"] != choices[1]["logprobs"]  # two draws
        for c in choices:
            content = c["logprobs"]["content"]
            assert content and all(len(t["top_logprobs"]) <= 2 and t["logprob"] <= 0 for t in content)
            if c["finish_reason"] == "stop":
                jsonschema.validate(json.loads(c["message"]["content"]), PERSON)
                completed += 1
    assert completed >= 3  # most samples complete the small schema within 40 tokens
    obj = lines["obj"]["response"]["body"]["choices"][0]
    assert obj["logprobs"] is None and (obj["finish_reason"] != "stop" or isinstance(
        json.loads(obj["message"]["content"]), dict))
    assert len(lines["free"]["response"]["body"]["choices"]) == 2
    assert all(r["parsed"] is not None for r in rows if r["id"].startswith("p") and r["finish_reason"] == "stop")
