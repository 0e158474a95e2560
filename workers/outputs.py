"""Output parts: the Parquet schema, the columns a user keeps from the input, and the OpenAI Batch JSONL
of each part (`output.format: openai_batch`: `_openai_batch/part-NNNNN.jsonl`).

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
from pydantic import Field, field_validator

from specdec.config import Config, SampleResult

from .requests import openai_response

_TYPES = {"token_ids": pa.list_(pa.int32()), "prompt_tokens": pa.int32(), "generated_tokens": pa.int32(),
          "finish_reason": pa.string(), "error": pa.string(), "rounds": pa.int32(), "draft_forwards": pa.int32(),
          "drafted_tokens": pa.int32(), "accepted_tokens": pa.int32(), "draft_lengths": pa.list_(pa.int16()),
          "accept_lengths": pa.list_(pa.int16()), "acceptance_rate": pa.float64(),
          "mean_accepted_length": pa.float64(), "verification": pa.string(), "wall_s": pa.float64(),
          "sample_index": pa.int32(), "forced_tokens": pa.int32(), "logprobs": pa.list_(pa.float32()),
          "top_logprobs": pa.list_(pa.list_(pa.struct([("token_id", pa.int32()), ("logprob", pa.float32())])))}
SCHEMA = pa.schema([("id", pa.string()), ("completion", pa.string())]
                   + [(name, _TYPES[name]) for name in SampleResult.COLUMNS]
                   + [("warnings", pa.string()), ("chat", pa.bool_()), ("control", pa.bool_())])


class OutputSpec(Config):
    path: str = Field(description="local folder or `s3://bucket/prefix/`; `{date}` in it becomes the run's UTC date "
                                  "(YYYY-MM-DD; `--date` or `SPECBATCH_DATE` name another day, as for `status`): one "
                                  "folder per scheduled run (no other placeholder)")
    format: Literal["parquet", "openai_batch"] = Field("parquet", description="`openai_batch`: also one OpenAI Batch "
                                                       "API output JSONL per part (`part-NNNNN.jsonl`)")
    keep_columns: list[str] = Field([], description="input columns copied into the output rows")

    @field_validator("keep_columns")
    @classmethod
    def _no_clash(cls, columns: list[str]) -> list[str]:
        clash = [c for c in columns if c in SCHEMA.names]
        if clash:
            raise ValueError(f"output.keep_columns: {clash} are output columns already")
        return columns


def _cell(name: str, value):
    if name == "top_logprobs" and value is not None:  # (id, logprob) pairs -> structs
        return [[{"token_id": t, "logprob": p} for t, p in top] for top in value]
    return value


def parquet_bytes(rows: list[dict], keep: list[str]) -> bytes:
    """A part's Parquet bytes: the schema's columns, then the kept input columns (types as pyarrow infers)."""
    table = pa.Table.from_pylist([{k: _cell(k, r[k]) for k in SCHEMA.names} for r in rows], schema=SCHEMA)
    for name in keep:
        table = table.append_column(name, pa.array([r.get(name) for r in rows]))
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return buf.getvalue()


OPENAI_DIR = "_openai_batch/"  # beside the parts; readers of the Parquet dataset skip "_" names


def jsonl_name(part: str) -> str:
    return OPENAI_DIR + part.rsplit(".", 1)[0] + ".jsonl"


def openai_jsonl(parquet: bytes, model: str) -> bytes:
    """The OpenAI Batch output lines of a committed part, in its row order."""
    rows = pq.read_table(io.BytesIO(parquet)).to_pylist()
    return "".join(json.dumps(openai_response(r, bool(r["chat"]), model)) + "\n" for r in rows).encode()


def commit_jsonl(storage, part: str, parquet: bytes, model: str) -> None:
    """Write the part's OpenAI JSONL unless it is there already."""
    storage.put_if_absent(jsonl_name(part), openai_jsonl(parquet, model))


COUNTS = ("prompt_tokens", "generated_tokens", "drafted_tokens", "accepted_tokens", "rounds")


def part_entry(data: bytes) -> dict:
    """A committed part's manifest entry, from its bytes: rows, sha256, error rows by reason, and the token
    counts of its good rows (`COUNTS`)."""
    t = pq.read_table(io.BytesIO(data), columns=["error", *COUNTS]).to_pydict()
    ok = [i for i, e in enumerate(t["error"]) if not e]
    return {"rows": len(t["error"]), "sha256": hashlib.sha256(data).hexdigest(),
            "errors": dict(Counter(e.split(":", 1)[0] for e in t["error"] if e)),
            **{k: sum(t[k][i] or 0 for i in ok) for k in COUNTS}}
