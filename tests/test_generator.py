"""`specbatch.Generator` in this process with tiny models: a job's rows token for token, prompts of every kind
with their own settings, error rows, output formats with `parsed` and kept columns, a config refused naming the
key, and a target whose tokenizer spells tokens otherwise than it decodes them, refused for constrained rows
before any token is spent."""

from __future__ import annotations

import json
import os

import jsonschema
import pytest

from conftest import make_model
from job_helpers import COLUMNS, config, read_out, rows_of
from jobs.driver import run_job
from jobs.spec import ConfigError, load_spec
from specbatch import Generator
from test_synthesis import PERSON, bpe_tokenizer

SAME = ("token_ids", "completion", "finish_reason", "error", "prompt_tokens", "generated_tokens", "chat", "warnings")


def tiny(tiny_pair, **sections):
    return Generator(models={"target": {"path": tiny_pair["target"], "dtype": "float32"},
                             "draft": {"path": tiny_pair["draft"], "dtype": "float32"}},
                     generation={"max_new_tokens": 8}, speculation={"num_draft_tokens": 3},
                     resources={"batch_size": 4}, **sections)


def test_a_generator_gives_a_jobs_rows_token_for_token(tmp_path, tiny_pair, ray_session):
    """The same config and rows through `specbatch run` and a Generator: the same rows, sampled ones included
    (coupled sampling draws the same whatever the draft lengths)."""
    rows = rows_of(7) + [{"id": "s", "prompt": "the day", "n": 3, "temperature": 1.0},
                         {"id": "few", "prompt": "he said", "max_new_tokens": 2},
                         {"id": "empty", "prompt": " "}, {"id": "none"}]
    path, _ = config(tmp_path, tiny_pair, rows, input__sampling_columns=["n", "temperature", "max_new_tokens"],
                     speculation__sampling="coupled")
    run_job(load_spec(path), progress=False)
    _, table = read_out(tmp_path / "out")
    expected = {(r["id"], r["sample_index"]): r for r in table.to_pylist()}

    got = Generator(path).generate(rows)
    assert list(got[0]) == COLUMNS
    samples = {"s": 3}  # an error row is one row
    assert [(r["id"], r["sample_index"]) for r in got] == [(r["id"], s) for r in rows
                                                           for s in range(samples.get(r["id"], 1))]
    for r in got:
        assert {k: r[k] for k in SAME} == {k: expected[(r["id"], r["sample_index"])][k] for k in SAME}, r["id"]
    assert len({tuple(r["token_ids"]) for r in got if r["id"] == "s"}) == 3  # three samples, each its own draw
    assert got[-2]["error"].startswith("empty_prompt") and got[-1]["error"].startswith("missing_prompt")


def test_prompts_of_every_kind_with_their_own_settings(tiny_pair):
    gen = tiny(tiny_pair)
    tok = gen.tokenizer
    messages = [{"role": "user", "content": "the water is hot"}]
    got = gen.generate(["the water is hot", messages,
                        {"id": "n3", "prompt": "how do you", "n": 3, "temperature": 0.8, "max_new_tokens": 4},
                        {"id": "chat", "messages": messages}, {"prompt": "no id"},
                        {"id": "bad", "messages": [{"role": "user"}]}, 7, {"id": "hot", "prompt": "a",
                                                                          "temperature": -1}])
    by = {}
    for r in got:
        by.setdefault(r["id"], []).append(r)
    assert list(by) == ["0", "1", "n3", "chat", "4", "bad", "6", "hot"]  # ids: the row's, else its position
    text, chat = by["0"][0], by["1"][0]
    assert text["prompt_tokens"] == len(tok("the water is hot", add_special_tokens=False)["input_ids"])
    assert chat["prompt_tokens"] == len(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                                return_dict=False))
    assert (text["chat"], chat["chat"]) == (False, True)
    assert {k: by["chat"][0][k] for k in SAME} == {k: chat[k] for k in SAME}  # a `messages` key reads the same
    assert [r["sample_index"] for r in by["n3"]] == [0, 1, 2] and all(r["generated_tokens"] <= 4 for r in by["n3"])
    assert all(r["error"] is None and r["generated_tokens"] == 8 or r["finish_reason"] == "stop"
               for r in got if r["id"] in ("0", "1", "4"))
    assert by["bad"][0]["error"].startswith("bad_messages") and by["6"][0]["error"].startswith("not_an_object")
    assert by["hot"][0]["error"].startswith("bad_sampling: temperature")
    assert all(r["finish_reason"] == "error" and r["token_ids"] == [] for k in ("bad", "6", "hot") for r in by[k])

    short = gen.generate("the water is hot", max_new_tokens=2)  # one prompt; a setting for the call
    assert len(short) == 1 and short[0]["token_ids"] == text["token_ids"][:2]
    with pytest.raises(ConfigError, match="'temprature' is not a setting .did you mean temperature"):
        gen.generate(["x"], temprature=0.5)
    with pytest.raises(ConfigError, match="generate: top_p"):
        gen.generate(["x"], top_p=2)


@pytest.mark.parametrize("sections, message", [
    ({"generation": {"max_new_token": 3}}, "generation.max_new_token: unknown key (did you mean "
                                           "generation.max_new_tokens?)"),
    ({"models": {"draft": None}}, "speculation.method draft_model needs models.draft"),
    ({"models": {"target": {"path": "/nowhere/target"}}, "speculation": {"method": "none"}},
     "models.target.path: '/nowhere/target' does not exist here"),
    ({"models": {"target": {"tensor_parallel": 2}}}, "models.target.tensor_parallel: a Generator runs the target "
                                                     "in one process"),
    ({"resources": {"gpus_per_worker": 1}}, "resources.gpus_per_worker: 1, but torch sees no CUDA device"),
    ({"resources": {"batch_size": 0}}, "resources.batch_size: Input should be greater than or equal to 1"),
])
def test_a_bad_config_is_refused_naming_the_key(tiny_pair, sections, message):
    import torch

    if "gpus_per_worker" in str(sections) and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    base = {"models": {"target": {"path": tiny_pair["target"]}, "draft": {"path": tiny_pair["draft"]}}}
    with pytest.raises(ConfigError) as err:
        Generator(base, **sections)  # sections merged over the config, key by key
    assert message in str(err.value)


@pytest.fixture(scope="module")
def bpe_folders(tmp_path_factory):
    """Tiny Llamas over a byte-level BPE tokenizer: {'good': (target, draft), 'mismatched': (target, draft)}, the
    mismatched pair's tokenizer.json holding a SentencePiece decoder (Replace "▁", ByteFallback, Fuse), as older
    GGUF conversions saved one for a byte-level BPE."""
    root = tmp_path_factory.mktemp("bpe-gen")
    out = {}
    for kind in ("good", "mismatched"):
        folders = []
        for name, layers, seed in (("target", 2, 3), ("draft", 1, 4)):
            folder = str(root / kind / name)
            tok = bpe_tokenizer()
            tok.save_pretrained(folder)
            if kind == "mismatched":
                file = os.path.join(folder, "tokenizer.json")
                data = json.load(open(file))
                data["decoder"] = {"type": "Sequence", "decoders": [
                    {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"},
                    {"type": "Fuse"}]}
                json.dump(data, open(file, "w"))
            make_model(folder, len(tok), layers, seed, tok.eos_token_id)
            folders.append(folder)
        out[kind] = tuple(folders)
    return out


def bpe_generator(folders, **sections):
    """A Generator over a tiny byte-level pair: a config dict, `sections` merged over it."""
    target, draft = folders
    return Generator({"models": {"target": {"path": target, "dtype": "float32"},
                                 "draft": {"path": draft, "dtype": "float32"}},
                      "generation": {"max_new_tokens": 48}, "speculation": {"num_draft_tokens": 3},
                      "resources": {"batch_size": 4}}, **sections)


def test_output_formats_parsed_and_kept_columns(bpe_folders):
    gen = bpe_generator(bpe_folders["good"], output={"keep_columns": ["topic"], "parsed_columns": ["name", "age"]},
                        generation={"max_new_tokens": 48, "logprobs": True, "top_logprobs": 2})
    person = {"type": "json_schema", "json_schema": {"schema": PERSON}}
    got = gen.generate([{"id": "p", "prompt": "Describe a person:", "response_format": person, "topic": "people"},
                        {"id": "c", "prompt": "A color", "response_format": {"type": "choice",
                                                                             "choice": ["red", "green", "blue"]}},
                        {"id": "t", "prompt": "the quick", "response_format": json.dumps(person)}])
    assert list(got[0]) == COLUMNS + ["topic", "name", "age"]
    p, c, t = got
    assert p["finish_reason"] == "stop" and p["error"] is None
    jsonschema.validate(json.loads(p["completion"]), PERSON)
    assert json.loads(p["parsed"]) == json.loads(p["completion"])
    assert p["topic"] == "people" and p["name"] == json.loads(p["parsed"])["name"]  # kept and parsed columns
    assert p["age"] is None or isinstance(p["age"], str)  # no job-wide schema: a parsed column is JSON text
    assert c["completion"] in ("red", "green", "blue") and c["parsed"] is None and c["topic"] is None
    assert t["error"] is None and json.loads(t["completion"]) == json.loads(t["parsed"])  # a format as JSON text
    assert len(p["logprobs"]) == len(p["token_ids"]) == len(p["tokens"])
    assert max(len(top) for top in p["top_logprobs"]) == 2  # fewer where the format allows fewer tokens
    assert set(p["top_logprobs"][0][0]) == {"token_id", "token", "logprob"}  # as the Parquet part holds them


def test_a_mismatched_tokenizer_is_refused_for_constrained_rows_before_any_token(bpe_folders):
    """A tokenizer whose decoder does not undo its byte-level pre-tokenizer: llguidance would find no token that
    spells a space. Every constrained row is one error naming the tokenizer file, with no model call spent; the
    other rows generate."""
    target = bpe_folders["mismatched"][0]
    gen = bpe_generator(bpe_folders["mismatched"])
    rows = [{"id": "free", "prompt": "the quick"},
            {"id": "json", "prompt": "Describe a person:", "response_format": {"type": "json_object"}},
            {"id": "color", "prompt": "A color", "n": 2,
             "response_format": {"type": "choice", "choice": ["red", "green"]}}]
    got = {r["id"]: r for r in gen.generate(rows)}
    assert list(got) == ["free", "json", "color"]  # one error row for the two samples of `color`
    assert got["free"]["error"] is None and got["free"]["generated_tokens"] > 0
    for key in ("json", "color"):
        r = got[key]
        assert r["finish_reason"] == "error" and r["token_ids"] == [] and r["rounds"] == 0
        assert r["error"].startswith(f"tokenizer: {os.path.join(target, 'tokenizer.json')}: it decodes its own "
                                     "tokens of")
        assert "Ġ" in r["error"] and 'needs {"type": "ByteLevel"}' in r["error"]
    assert got["json"]["error"] == got["color"]["error"]  # one error, the same for every constrained row

    good = bpe_generator(bpe_folders["good"]).generate(rows[2:])  # the same pair, its decoder right
    assert [r["completion"] in ("red", "green") and r["error"] is None for r in good] == [True, True]
