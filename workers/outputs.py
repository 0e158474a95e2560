"""Output parts: the Parquet schema, the output row of a sample, the columns a user keeps from the input or
asks for from a JSON output, and the OpenAI Batch JSONL of each part (`output.format: openai_batch`:
`_openai_batch/part-NNNNN.jsonl`).

An input row asking for `n` samples gives `n` output rows, one after another, with the same `id` and
`sample_index` 0..n-1 (a row that cannot run gives one error row); its OpenAI Batch line has `n` choices.

A part is committed by its Parquet file (create-only); the JSONL is derived from the committed Parquet
(so that both always hold the same rows, whichever attempt won) and written create-only after it. The
driver writes any JSONL a dead worker left missing before it marks the job done (jobs/driver.py).
"""

from __future__ import annotations

import hashlib
import io
import json
from collections import Counter
from typing import Literal

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import Field, model_validator

from specdec.config import Config, SampleResult, SamplingParams
from specdec.sched.stops import cut_at_stop

from .requests import openai_response

_TYPES = {"token_ids": pa.list_(pa.int32()), "prompt_tokens": pa.int32(), "cached_prompt_tokens": pa.int32(), "generated_tokens": pa.int32(),
          "finish_reason": pa.string(), "error": pa.string(), "rounds": pa.int32(), "draft_forwards": pa.int32(),
          "drafted_tokens": pa.int32(), "accepted_tokens": pa.int32(), "draft_lengths": pa.list_(pa.int16()),
          "accept_lengths": pa.list_(pa.int16()), "acceptance_rate": pa.float64(),
          "mean_accepted_length": pa.float64(), "verification": pa.string(), "wall_s": pa.float64(),
          "sample_index": pa.int32(), "forced_tokens": pa.int32(), "logprobs": pa.list_(pa.float32()),
          "top_logprobs": pa.list_(pa.list_(pa.struct([("token_id", pa.int32()), ("token", pa.string()),
                                                       ("logprob", pa.float32())])))}
SCHEMA = pa.schema([("id", pa.string()), ("completion", pa.string())]
                   + [(name, _TYPES[name]) for name in SampleResult.COLUMNS]
                   + [("tokens", pa.list_(pa.string())), ("parsed", pa.string()), ("warnings", pa.string()),
                      ("chat", pa.bool_()), ("control", pa.bool_())])


class OutputSpec(Config):
    path: str = Field(description="local folder or `s3://bucket/prefix/`; `{date}` in it becomes the run's UTC date "
                                  "(YYYY-MM-DD; `--date` or `SPECBATCH_DATE` name another day, as for `status`): one "
                                  "folder per scheduled run (no other placeholder)")
    format: Literal["parquet", "openai_batch"] = Field("parquet", description="`openai_batch`: also one OpenAI Batch "
                                                       "API output JSONL per part (`part-NNNNN.jsonl`)")
    keep_columns: list[str] = Field([], description="input columns copied into the output rows")
    parsed_columns: list[str] = Field([], description="top-level fields of a JSON output (`parsed`) made columns of "
                                      "their own (a string, number or boolean as it is, anything else as JSON text; "
                                      "null where the row has none)")

    @model_validator(mode="after")
    def _no_clash(self):
        for key in ("keep_columns", "parsed_columns"):
            clash = [c for c in getattr(self, key) if c in SCHEMA.names]
            if clash:
                raise ValueError(f"output.{key}: {clash} are output columns already")
        both = set(self.keep_columns) & set(self.parsed_columns)
        if both:
            raise ValueError(f"output.parsed_columns: {sorted(both)} are in output.keep_columns too")
        return self


def output_row(r: SampleResult, tokenizer, sp: SamplingParams | None) -> dict:
    """A sample's output columns but the input's: its completion (cut before a stop string), statistics, the text
    of each token (with logprobs) and, for a JSON output format, `parsed` (the completed output's JSON text)."""
    text = None if r.error else cut_at_stop(tokenizer.decode(r.token_ids, skip_special_tokens=True), r.stop_string)
    tokens, parsed = None, None
    if r.logprobs is not None:
        ids = sorted({t for top in r.top_logprobs or [] for t, _ in top} | set(r.token_ids))
        text_of = dict(zip(ids, tokenizer.batch_decode([[t] for t in ids])))
        tokens = [text_of[t] for t in r.token_ids]
        if r.top_logprobs is not None:
            r.top_logprobs = [[(t, text_of[t], p) for t, p in top] for top in r.top_logprobs]
    fmt = sp.grammar if sp is not None else None
    if text is not None and fmt is not None and fmt.type in ("json_object", "json_schema") and r.finish_reason == "stop":
        try:
            parsed = json.dumps(json.loads(text), ensure_ascii=False)
        except json.JSONDecodeError:  # cannot happen for a completed grammar; never a failed part
            parsed = None
    return {"completion": text, **r.stats(), "tokens": tokens, "parsed": parsed}


def _cell(name: str, value):
    if name == "top_logprobs" and value is not None:  # (id, text, logprob) triples -> structs
        return [[{"token_id": t, "token": s, "logprob": p} for t, s, p in top] for top in value]
    return value


_JSON_TYPES = {"string": pa.string(), "integer": pa.int64(), "number": pa.float64(), "boolean": pa.bool_()}


def parsed_types(names: list[str], fmt) -> dict[str, pa.DataType]:
    """The type of each parsed column, from the job's JSON schema (`generation.response_format`) where it gives
    the field one scalar type, else a string (JSON text): the same in every part, whatever its rows hold."""
    props = {}
    if fmt is not None and fmt.type == "json_schema":
        props = fmt.json_schema.schema_.get("properties") or {}
    return {n: _JSON_TYPES.get(str((props.get(n) or {}).get("type")), pa.string()) for n in names}


def _field(parsed: str | None, name: str, kind: pa.DataType):
    """A top-level field of a parsed output as a value of the column's type (null where it has none or another)."""
    value = json.loads(parsed).get(name) if parsed else None
    if value is None or kind == pa.string():
        return value if value is None or isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    if kind == pa.bool_():
        return value if isinstance(value, bool) else None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (kind != pa.int64() or
                                                                            float(value).is_integer())
    return (int(value) if kind == pa.int64() else float(value)) if ok else None


def output_table(rows: list[dict], keep: list[str], parsed: dict[str, pa.DataType] | None = None) -> pa.Table:
    """Output rows as a table: the schema's columns, the kept input columns (types as pyarrow infers), then the
    asked-for fields of `parsed` (name -> type: `parsed_types`)."""
    table = pa.Table.from_pylist([{k: _cell(k, r[k]) for k in SCHEMA.names} for r in rows], schema=SCHEMA)
    for name in keep:
        table = table.append_column(name, pa.array([r.get(name) for r in rows]))
    for name, kind in (parsed or {}).items():
        table = table.append_column(name, pa.array([_field(r["parsed"], name, kind) for r in rows], type=kind))
    return table


def parquet_bytes(rows: list[dict], keep: list[str], parsed: dict[str, pa.DataType] | None = None) -> bytes:
    """A part's Parquet bytes: `output_table`'s."""
    table = output_table(rows, keep, parsed)
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return buf.getvalue()


OPENAI_DIR = "_openai_batch/"  # beside the parts; readers of the Parquet dataset skip "_" names


def jsonl_name(part: str) -> str:
    return OPENAI_DIR + part.rsplit(".", 1)[0] + ".jsonl"


def openai_jsonl(parquet: bytes, model: str) -> bytes:
    """The OpenAI Batch output lines of a committed part, in its row order: one per input row (its samples are
    consecutive rows)."""
    rows = pq.read_table(io.BytesIO(parquet)).to_pylist()
    groups: list[list[dict]] = []
    for r in rows:
        if groups and groups[-1][0]["id"] == r["id"]:
            groups[-1].append(r)
        else:
            groups.append([r])
    return "".join(json.dumps(openai_response(g, bool(g[0]["chat"]), model)) + "\n" for g in groups).encode()


def commit_jsonl(storage, part: str, parquet: bytes, model: str) -> None:
    """Write the part's OpenAI JSONL unless it is there already."""
    storage.put_if_absent(jsonl_name(part), openai_jsonl(parquet, model))


COUNTS = ("prompt_tokens", "cached_prompt_tokens", "generated_tokens", "drafted_tokens", "accepted_tokens", "rounds")


def part_entry(data: bytes) -> dict:
    """A committed part's manifest entry, from its bytes: rows (input rows: their first samples), sha256, error
    rows by reason (samples), and the token counts of its good samples (`COUNTS`)."""
    f = pq.ParquetFile(io.BytesIO(data))
    counts = [k for k in COUNTS if k in f.schema_arrow.names]  # a part written before a count existed lacks it
    t = f.read(columns=["error", "sample_index", *counts]).to_pydict()
    ok = [i for i, e in enumerate(t["error"]) if not e]
    return {"rows": t["sample_index"].count(0), "sha256": hashlib.sha256(data).hexdigest(),
            "errors": dict(Counter(e.split(":", 1)[0] for e in t["error"] if e)),
            **{k: sum(t[k][i] or 0 for i in ok) for k in counts}}
