"""specbatch as a Ray Data stage on the embedded Ray with the tiny pair: read_json -> SpecbatchStage ->
write_parquet gives every input row (samples, error rows) with the tokens `specbatch run` writes for it, and
every input column beside the output's; a batch in any format is read; a clashing column is refused."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from job_helpers import COLUMNS, config, read_out, rows_of
from jobs.driver import run_job
from jobs.spec import load_spec

SAME = ("token_ids", "completion", "finish_reason", "error", "prompt_tokens", "generated_tokens", "chat")


def job_rows():
    rows = [{**r, "topic": f"t{i}"} for i, r in enumerate(rows_of(7))]
    rows[2]["n"], rows[2]["temperature"] = 2, 0.9  # two coupled samples: the same draws whatever the batches
    rows[4]["max_new_tokens"] = 3
    return rows + [{"id": "empty", "prompt": "", "topic": "bad"}, {"id": "none", "prompt": None, "topic": "null"}]


@pytest.fixture(scope="module")
def job(tmp_path_factory, tiny_pair, ray_session):
    """A job over job_rows() run by `specbatch run`'s driver: (config path, its output rows by (id, sample))."""
    tmp = tmp_path_factory.mktemp("job")
    path, _ = config(tmp, tiny_pair, job_rows(), input__sampling_columns=["n", "temperature", "max_new_tokens"],
                     speculation__sampling="coupled")
    run_job(load_spec(path), progress=False)
    _, table = read_out(tmp / "out")
    return path, {(r["id"], r["sample_index"]): r for r in table.to_pylist()}


def test_read_json_stage_write_parquet_gives_a_jobs_rows(tmp_path, job, ray_session):
    import ray
    import ray.data

    from specbatch.ray_data import SpecbatchStage

    path, expected = job
    ray.data.DataContext.get_current().enable_progress_bars = False
    ds = ray.data.read_json(load_spec(path).input.path, lines=True)
    ds = ds.map_batches(SpecbatchStage, fn_constructor_kwargs={"config": path}, batch_size=4,
                        compute=ray.data.ActorPoolStrategy(min_size=1, max_size=2),
                        batch_format="pyarrow")
    ds.write_parquet(str(tmp_path / "rd"))
    # read_json infers each input block's types: a block whose rows all lack a column has it as null, which the
    # stage passes through as it came, so the files are read one by one and their types promoted
    files = sorted((tmp_path / "rd").glob("*.parquet"))
    table = pa.concat_tables([pq.read_table(f) for f in files], promote_options="permissive")
    rows = {(r["id"], r["sample_index"]): r for r in table.to_pylist()}

    assert table.column_names[:len(COLUMNS)] == COLUMNS  # the job's columns, then the input's but its id
    assert sorted(table.column_names[len(COLUMNS):]) == ["max_new_tokens", "n", "prompt", "temperature", "topic"]
    assert len(rows) == table.num_rows == len(expected) == 10  # every row once; r2's two samples
    assert sorted(rows) == sorted(expected)
    for key, r in rows.items():
        assert {k: r[k] for k in SAME} == {k: expected[key][k] for k in SAME}, key
    assert rows[("r2", 1)]["token_ids"] != rows[("r2", 0)]["token_ids"]  # two samples, each its own draw
    assert rows[("r4", 0)]["generated_tokens"] <= 3  # the row's own max_new_tokens
    assert rows[("empty", 0)]["error"].startswith("empty_prompt") and rows[("none", 0)]["error"].startswith(
        "empty_prompt")
    assert all(r["topic"] == f"t{int(i[1:])}" for (i, _), r in rows.items() if i.startswith("r"))


def test_the_stage_reads_any_batch_format_and_refuses_a_clashing_column(job):
    from specbatch.ray_data import SpecbatchStage

    path, expected = job
    stage = SpecbatchStage(path)
    for batch in ({"id": np.array(["r0", "r1"]), "prompt": np.array(["the water is hot ", "he said that the day was "
                                                                               "long the"])},
                  pa.table({"id": ["r0", "r1"], "prompt": ["the water is hot ", "he said that the day was long the"]})):
        out = stage(batch)
        assert out.column_names == COLUMNS + ["prompt"]
        got = out.to_pylist()
        assert [r["token_ids"] for r in got] == [expected[("r0", 0)]["token_ids"], expected[("r1", 0)]["token_ids"]]
    assert stage(pa.table({"id": pa.array([], pa.string()), "prompt": pa.array([], pa.string())})).num_rows == 0
    numbered = stage(pa.table({"id": [12], "prompt": ["the water is hot "]})).to_pylist()
    assert numbered[0]["id"] == "12" and numbered[0]["token_ids"] == expected[("r0", 0)]["token_ids"]
    with pytest.raises(ValueError, match=r"\['error'\] are output columns"):
        stage(pa.table({"id": ["a"], "prompt": ["the day"], "error": ["x"]}))
