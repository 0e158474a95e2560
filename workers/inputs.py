"""Reading input rows: .jsonl / .parquet files or folders, local or S3, always streamed.

Shards are fixed runs of `shard_size` rows inside one file, numbered in file order, so the same
input always gives the same shards (resume depends on it). The driver scans ids once and keeps only
an 8-byte hash per row to refuse duplicates; workers read their own rows.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import numpy as np
from pydantic import Field

from specdec.config import Config

from .storage import list_input_files, open_input


class InputSpec(Config):
    path: str = Field(description="`.jsonl`/`.parquet` file or folder, local or `s3://bucket/key-or-prefix`")
    id_column: str = Field("id", description="unique per row; duplicates are refused before anything runs")
    prompt_column: str | None = Field("prompt", description="raw text, tokenized as is")
    messages_column: str | None = Field(None, description="list of `{role, content}`, rendered with the target's "
                                                          "chat template")
    chat_template: bool = Field(False, description="wrap `prompt_column` text as one user message")


class InputError(ValueError):
    """The input cannot be used as a whole (missing ids, duplicates, unreadable file)."""


@dataclass(frozen=True)
class Shard:
    index: int
    file: str
    start: int  # first row inside the file
    end: int  # one past the last row

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def part(self) -> str:
        return f"part-{self.index:05d}.parquet"


def _iter_jsonl(uri: str, columns: list[str] | None) -> Iterator[dict]:
    with open_input(uri) as raw:
        for lineno, line in enumerate(io.TextIOWrapper(raw, encoding="utf-8"), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                row = {"__error__": f"line {lineno} is not valid JSON: {exc.msg}"}
            if not isinstance(row, dict):
                row = {"__error__": f"line {lineno} is not a JSON object"}
            yield row


def _iter_parquet(uri: str, columns: list[str] | None) -> Iterator[dict]:
    import pyarrow.parquet as pq

    with open_input(uri) as f:
        pf = pq.ParquetFile(f)
        cols = [c for c in columns if c in pf.schema_arrow.names] if columns else None
        for batch in pf.iter_batches(batch_size=1024, columns=cols):
            yield from batch.to_pylist()


def iter_rows(uri: str, columns: list[str] | None = None) -> Iterator[dict]:
    """Rows of one input file, in order (blank jsonl lines are skipped, not counted)."""
    return (_iter_parquet if uri.endswith(".parquet") else _iter_jsonl)(uri, columns)


def read_shard(shard: Shard, columns: list[str]) -> list[dict]:
    out = []
    for i, row in enumerate(iter_rows(shard.file, columns)):
        if i >= shard.end:
            break
        if i >= shard.start:
            out.append(row)
    return out


def _hash(value) -> int:
    return int.from_bytes(hashlib.blake2b(str(value).encode(), digest_size=8).digest(), "little", signed=True)


def scan(path: str, id_column: str, shard_size: int) -> tuple[list[Shard], int]:
    """One streaming pass: shard descriptions and row count. Refuses missing and duplicate ids."""
    files = list_input_files(path)
    if not files:
        raise InputError(f"no .jsonl or .parquet input under {path}")
    shards: list[Shard] = []
    hashes = []
    total = 0
    for f in files:
        n = 0
        chunk = np.empty(65536, dtype=np.int64)
        filled = 0
        for row in iter_rows(f, [id_column]):
            if "__error__" in row:
                raise InputError(f"{f}: {row['__error__']}")
            rid = row.get(id_column)
            if rid is None:
                raise InputError(f"{f}: row {n} has no {id_column!r} (input.id_column); every row needs an id")
            chunk[filled] = _hash(rid)
            filled += 1
            n += 1
            if filled == len(chunk):
                hashes.append(chunk)
                chunk = np.empty(65536, dtype=np.int64)
                filled = 0
        hashes.append(chunk[:filled])
        for start in range(0, n, shard_size):
            shards.append(Shard(len(shards), f, start, min(n, start + shard_size)))
        total += n
    if total == 0:
        raise InputError(f"input {path} has no rows")
    all_h = np.sort(np.concatenate(hashes))
    dup_h = np.unique(all_h[1:][all_h[1:] == all_h[:-1]])
    if dup_h.size:
        _name_duplicates(files, id_column, set(dup_h.tolist()))
    return shards, total


def _name_duplicates(files: list[str], id_column: str, suspect: set[int]) -> None:
    """Second pass over the rows whose hash collided: name the real duplicates (or pass on a collision)."""
    seen: dict[str, int] = {}
    for f in files:
        for row in iter_rows(f, [id_column]):
            rid = row[id_column]
            if _hash(rid) in suspect:
                seen[str(rid)] = seen.get(str(rid), 0) + 1
    dups = sorted(k for k, c in seen.items() if c > 1)
    if dups:
        shown = ", ".join(repr(d) for d in dups[:5])
        more = f" and {len(dups) - 5} more" if len(dups) > 5 else ""
        raise InputError(f"duplicate ids in input ({id_column!r}): {shown}{more}; ids must be unique")


def render_prompt(row: dict, tokenizer, input_spec: InputSpec) -> list[int]:
    """Token ids for one row, or raises ValueError with the reason (which becomes the row's error)."""
    if "__error__" in row:
        raise ValueError(row["__error__"])
    if input_spec.messages_column:
        messages = row.get(input_spec.messages_column)
        if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        ):
            raise ValueError(f"{input_spec.messages_column!r} must be a non-empty list of {{role, content}} strings")
        return _chat(tokenizer, [{"role": m["role"], "content": m["content"]} for m in messages])
    text = row.get(input_spec.prompt_column)
    if not isinstance(text, str) or not text:
        raise ValueError(f"{input_spec.prompt_column!r} is missing or not a non-empty string")
    if input_spec.chat_template:
        return _chat(tokenizer, [{"role": "user", "content": text}])
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _chat(tokenizer, messages) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the target tokenizer has no chat template")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids)
