"""The README is the user's door: its config reference is exactly the config's keys, defaults and
descriptions, it stays short, and it points to nothing a user does not have; the example job configs
validate."""

import glob
import json
import os

import pytest
import yaml

from jobs.spec import config_reference, load_spec
from workers.inputs import template_columns

ROOT = os.path.join(os.path.dirname(__file__), "..")
README = os.path.join(ROOT, "README.md")
JOB_CONFIGS = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "configs", "*.yaml"))
                     if "models" in yaml.safe_load(open(p)))  # not prices.yaml


def section(text: str, title: str) -> str:
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start: end if end > 0 else None]


def test_readme_config_reference_is_the_configs_own():
    text = open(README).read()
    rows = [line for line in section(text, "Config reference").splitlines() if line.startswith("| `")]
    assert rows == config_reference()


def test_every_config_key_is_described():
    for row in config_reference():
        key, default, meaning = (cell.strip() for cell in row.strip("|").split(" | "))
        assert meaning and meaning != "None", key


def test_readme_is_short_and_self_contained():
    text = open(README).read()
    assert len(text.splitlines()) <= 250
    assert "../shared" not in text  # the team's folder, not the user's


def test_the_example_job_configs_are_found():
    assert {"configs/demo.yaml", "configs/synthesis.yaml"} <= set(JOB_CONFIGS)


@pytest.mark.parametrize("path", JOB_CONFIGS)
def test_an_example_job_config_validates_and_its_input_is_there(path, monkeypatch):
    monkeypatch.chdir(ROOT)  # configs name their inputs from the repository root, as `specbatch run` is run there
    spec = load_spec(path)
    if not spec.input.path.startswith("s3://") and "{date}" not in spec.input.path:
        assert os.path.exists(spec.input.path), spec.input.path


def test_the_synthesis_config_has_every_column_its_template_names():
    spec = load_spec(os.path.join(ROOT, "configs", "synthesis.yaml"))
    assert spec.input.prompt_template and spec.generation.n > 1 and spec.generation.top_logprobs
    with open(os.path.join(ROOT, spec.input.path)) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    assert len(rows) >= 10 and len({r["id"] for r in rows}) == len(rows)
    assert all(set(template_columns(spec.input.prompt_template)) <= set(r) for r in rows)
    schema = spec.generation.response_format.json_schema.schema_
    assert set(spec.output.parsed_columns) <= set(schema["properties"])
