"""Reading input rows: .jsonl / .parquet files or folders, local or S3, always streamed.

Every record of the input becomes exactly one output row: a jsonl line that is not JSON, or not an
object, is a record with an error (it becomes an error row); only blank lines are not records. A record
whose id is missing or unusable (not a non-empty string or an integer) gets one derived from its file
and line: `<file>:<line>` (the file's path inside the input, the 1-based line number; for Parquet the
1-based row number).

Shards are fixed runs of `shard_size` records inside one file, numbered in file order, so the same
input always gives the same shards (resume depends on it). The driver's one scan records where each
shard starts (jsonl: the byte offset and length of its lines; Parquet: its first row group and the rows
to skip in it), so a worker reads its shard alone: a seek and a read locally, a ranged GET on S3,
whatever the shard's position in the file. The scan keeps only an 8-byte hash per record to refuse
duplicate ids.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np
from pydantic import Field, field_validator, model_validator

from specdec.config import Config

from .storage import input_files, is_s3, open_input


class InputSpec(Config):
    path: str = Field(description="`.jsonl`/`.parquet` file or folder, local or `s3://bucket/key-or-prefix`")
    id_column: str = Field("id", description="unique per row (duplicates are refused before anything runs); a "
                                             "row without a usable one gets `<file>:<line>`")
    prompt_column: str | None = Field("prompt", description="raw text, tokenized as is")
    messages_column: str | None = Field(None, description="list of `{role, content}`, rendered with the target's "
                                                          "chat template")
    chat_template: bool = Field(False, description="wrap `prompt_column` text as one user message")
    prompt_template: str | None = Field(None, description="the prompt text built from the row's columns, `{name}` "
                                        "standing for a column's value (`{{`/`}}`: a brace), e.g. `Write a question "
                                        "about {topic}.`; used instead of `prompt_column`; a row without one of "
                                        "its columns is a `missing_column` error row")
    system_prompt: str | None = Field(None, description="a system message put before each row's messages (unless "
                                      "they start with one); needs a chat template (`chat_template` or "
                                      "`messages_column`)")
    truncate: Literal["error", "left"] = Field("error", description="a prompt longer than the target's context: "
                                              "an error row, or `left`: keep its last tokens")
    format: Literal["rows", "openai_batch"] = Field("rows", description="`rows`: the columns above; "
                                                    "`openai_batch`: OpenAI Batch API request lines (`custom_id` is "
                                                    "the id; `body.messages` or `body.prompt`; body sampling keys "
                                                    "are the row's settings)")
    sampling_columns: list[str] = Field([], description="columns holding a row's own settings, each named as the "
                                        "setting: `max_new_tokens`, `temperature`, `top_p`, `top_k`, `seed`, `stop` "
                                        "(strings), `stop_token_ids`, `n`, `logprobs`, `top_logprobs`, "
                                        "`response_format` (an object, or its JSON text); null or absent: the job's "
                                        "`generation`")

    @field_validator("sampling_columns")
    @classmethod
    def _known_settings(cls, columns: list[str]) -> list[str]:
        from .requests import SETTINGS

        unknown = [c for c in columns if c not in SETTINGS]
        if unknown:
            raise ValueError(f"input.sampling_columns: {unknown} are not settings; allowed: {list(SETTINGS)}")
        return columns

    @field_validator("prompt_template")
    @classmethod
    def _template_names(cls, template: str | None) -> str | None:
        if template is not None:
            template_columns(template)
        return template

    @model_validator(mode="after")
    def _consistent(self):
        if self.prompt_template is not None and (self.messages_column or self.format == "openai_batch"):
            raise ValueError("input.prompt_template builds a prompt text: it does not go with "
                             + ("input.messages_column" if self.messages_column else "input.format openai_batch"))
        if self.system_prompt is not None and not (self.chat_template or self.messages_column):
            raise ValueError("input.system_prompt needs input.chat_template: true or input.messages_column")
        return self

    @property
    def key_column(self) -> str:
        """The column holding row ids."""
        return "custom_id" if self.format == "openai_batch" else self.id_column

    def columns(self, keep: list[str] = ()) -> list[str]:
        """The columns a worker reads."""
        if self.format == "openai_batch":
            wanted = ["custom_id", "method", "url", "body"]
        else:
            text = template_columns(self.prompt_template) if self.prompt_template else [self.prompt_column]
            wanted = [self.id_column, *text, self.messages_column, *self.sampling_columns]
        return list(dict.fromkeys(c for c in [*wanted, *keep] if c))


def template_columns(template: str) -> list[str]:
    """The columns a prompt template names; ValueError for one that is not plain `{column}` fields."""
    import string

    try:
        fields = [(name, spec, conv) for _, name, spec, conv in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:
        raise ValueError(f"input.prompt_template: {exc}") from None
    bad = [name for name, spec, conv in fields
           if not name or name.isdigit() or spec or conv or any(c in name for c in ".[]")]
    if bad:
        raise ValueError(f"input.prompt_template: {{{bad[0]}}} is not a column name (write {{column}}; "
                         "{{ and }} for braces)")
    return list(dict.fromkeys(name for name, _, _ in fields))


def render_template(template: str, row: dict) -> str:
    """The template with each `{column}` replaced by the row's value (strings as they are, others as JSON)."""
    missing = [c for c in template_columns(template) if row.get(c) is None]
    if missing:
        raise ValueError(f"missing_column: the row has no {missing[0]!r} (input.prompt_template)")
    return template.format_map({c: v if isinstance(v := row[c], str) else json.dumps(v, ensure_ascii=False)
                                for c in template_columns(template)})


class InputError(ValueError):
    """The input cannot be used as a whole (duplicate ids, no rows, an unreadable file)."""


@dataclass(frozen=True)
class Shard:
    index: int
    file: str
    name: str  # the file's path inside the input (derived ids)
    start: int  # first record inside the file
    end: int  # one past the last
    offset: int  # jsonl: byte offset of the first record's line; Parquet: the row group holding it
    line: int  # jsonl: line number of the first record (1-based, blank lines counted); Parquet: start + 1
    nbytes: int = -1  # jsonl: bytes from `offset` to the end of the shard's last line
    skip: int = 0  # Parquet: rows of the first row group before the shard's first
    control: bool = False  # run without speculation (speculation.control_fraction)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def part(self) -> str:
        if not (isinstance(self.index, int) and 0 <= self.index < 10**9):
            raise ValueError(f"shard index {self.index!r}")
        return f"part-{self.index:05d}.parquet"


@dataclass
class Record:
    id: str
    row: dict  # the parsed row ({} when it could not be)
    error: str | None = None  # why it cannot be generated ("reason: detail")


def usable_id(value) -> str | None:
    """An id value as a string (a non-empty string, or an integer), else None."""
    if isinstance(value, str) and value.strip():
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return None


def record_id(value, name: str, line: int) -> str:
    """The row's id as a string, or `<file>:<line>` when it has no usable one."""
    usable = usable_id(value)
    return f"{name}:{line}" if usable is None else usable


def _parse_line(raw: bytes, name: str, line: int, id_column: str) -> Record:
    try:
        row = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return Record(f"{name}:{line}", {}, f"invalid_json: line {line} is not valid JSON ({exc})")
    if not isinstance(row, dict):
        return Record(f"{name}:{line}", {}, f"not_an_object: line {line} is a JSON {type(row).__name__}, "
                                            "not an object")
    return Record(record_id(row.get(id_column), name, line), row)


def _jsonl_lines(f, first_line: int = 1) -> Iterator[tuple[int, int, bytes]]:
    """(line number, byte offset, line) of every non-blank line from the reader's position."""
    pos, line = f.tell(), first_line - 1
    for raw in f:
        line += 1
        start, pos = pos, pos + len(raw)
        if raw.strip():
            yield line, start, raw


def _scan_jsonl(uri: str, name: str, id_column: str, shard_size: int, hashes: list[np.ndarray]) -> list[dict]:
    shards, chunk, n = [], [], 0
    with open_input(uri) as f:
        end = 0
        for line, start, raw in _jsonl_lines(f):
            if n % shard_size == 0:
                if shards:
                    shards[-1]["nbytes"] = start - shards[-1]["offset"]
                shards.append({"start": n, "offset": start, "line": line})
            chunk.append(_hash(_parse_line(raw, name, line, id_column).id))
            n += 1
            end = start + len(raw)
            if len(chunk) == 65536:
                hashes.append(np.array(chunk, dtype=np.int64))
                chunk = []
        if shards:
            shards[-1]["nbytes"] = end - shards[-1]["offset"]
    hashes.append(np.array(chunk, dtype=np.int64))
    for s in shards:
        s["end"] = min(n, s["start"] + shard_size)
    return shards


def _scan_parquet(uri: str, name: str, id_column: str, shard_size: int, hashes: list[np.ndarray]) -> list[dict]:
    import pyarrow.parquet as pq

    with open_input(uri) as f:
        pf = pq.ParquetFile(f)
        has_id = id_column in pf.schema_arrow.names
        first = 0  # first row of the current row group
        shards: list[dict] = []
        for g in range(pf.num_row_groups):
            rows = pf.metadata.row_group(g).num_rows
            ids = pf.read_row_group(g, columns=[id_column]).column(0).to_pylist() if has_id else [None] * rows
            hashes.append(np.array([_hash(record_id(v, name, first + i + 1)) for i, v in enumerate(ids)],
                                   dtype=np.int64))
            for r in range(-(-first // shard_size) * shard_size, first + rows, shard_size):
                shards.append({"start": r, "offset": g, "skip": r - first, "line": r + 1})
            first += rows
    for s in shards:
        s["end"] = min(first, s["start"] + shard_size)
    return shards


def read_shard(shard: Shard, id_column: str, columns: list[str]) -> list[Record]:
    """The shard's records, read from where the scan said it starts (never from the file's start)."""
    out: list[Record] = []
    want = shard.end - shard.start
    # reads sized to the shard: one ranged GET of its bytes on S3 (jsonl), no 8 MB read-ahead (Parquet)
    with open_input(shard.file, block=max(shard.nbytes, 1 << 16) if shard.nbytes > 0 else 1 << 20) as f:
        if shard.file.endswith(".parquet"):
            import pyarrow.parquet as pq

            pf = pq.ParquetFile(f)
            cols = [c for c in columns if c in pf.schema_arrow.names] or None
            skip = shard.skip
            for g in range(shard.offset, pf.num_row_groups):
                rows = pf.read_row_group(g, columns=cols).to_pylist()[skip:]
                skip = 0
                for row in rows[: want - len(out)]:
                    line = shard.line + len(out)
                    out.append(Record(record_id(row.get(id_column), shard.name, line), row))
                if len(out) == want:
                    break
        else:
            f.seek(shard.offset)
            for line, _, raw in _jsonl_lines(io.BytesIO(f.read(shard.nbytes)), shard.line):
                out.append(_parse_line(raw, shard.name, line, id_column))
    if len(out) != want:
        raise InputError(f"{shard.file}: shard {shard.index} holds {len(out)} rows, the scan found {want}: "
                         "did the input change since the job started?")
    return out


def iter_rows(uri: str, columns: list[str] | None = None) -> Iterator[dict]:
    """Rows of one input file, in order (records that cannot be parsed are left out)."""
    if uri.endswith(".parquet"):
        import pyarrow.parquet as pq

        with open_input(uri) as f:
            pf = pq.ParquetFile(f)
            cols = [c for c in columns if c in pf.schema_arrow.names] if columns else None
            for batch in pf.iter_batches(batch_size=1024, columns=cols):
                yield from batch.to_pylist()
        return
    with open_input(uri) as f:
        for line, _, raw in _jsonl_lines(f):
            rec = _parse_line(raw, "", line, "")
            if rec.error is None:
                yield rec.row


def _hash(value) -> int:
    return int.from_bytes(hashlib.blake2b(str(value).encode(), digest_size=8).digest(), "little", signed=True)


def _name(root: str, uri: str) -> str:
    """A file's path inside the input (its own name when the input is that file)."""
    root = root.rstrip("/") if is_s3(root) else os.path.abspath(root)
    if uri == root or (not is_s3(root) and not uri.startswith(root + "/")):
        return uri.rsplit("/", 1)[-1]
    return uri[len(root) + 1:]


class Shards(list):
    """The scan's shards, with `files`: the input files they were read from, each with its size and ETag or
    mtime_ns (`storage.input_files`, listed before reading), which the output manifest keeps to tell a changed
    input from the one its parts were made of."""

    def __init__(self, files: list[dict]):
        super().__init__()
        self.files = files


def scan(path: str, id_column: str, shard_size: int) -> tuple[Shards, int]:
    """One streaming pass: shard descriptions (where each starts; `.files`: the input's files) and the record
    count. Refuses duplicate ids."""
    listed = input_files(path)
    files = [f["path"] for f in listed]
    if not files:
        raise InputError(f"no .jsonl or .parquet input under {path}")
    shards = Shards(listed)
    hashes: list[np.ndarray] = []
    total = 0
    for f in files:
        name = _name(path, f)
        found = (_scan_parquet if f.endswith(".parquet") else _scan_jsonl)(f, name, id_column, shard_size, hashes)
        for s in found:
            shards.append(Shard(index=len(shards), file=f, name=name, **s))
        total += sum(s["end"] - s["start"] for s in found)
    if total == 0:
        raise InputError(f"input {path} has no rows")
    all_h = np.sort(np.concatenate(hashes))
    dup_h = np.unique(all_h[1:][all_h[1:] == all_h[:-1]])
    if dup_h.size:
        _name_duplicates(shards, id_column, set(dup_h.tolist()))
    return shards, total


def _name_duplicates(shards: list[Shard], id_column: str, suspect: set[int]) -> None:
    """Second pass over the records whose hash collided: name the real duplicates (or pass on a collision)."""
    seen: dict[str, int] = {}
    for shard in shards:
        for rec in read_shard(shard, id_column, [id_column]):
            if _hash(rec.id) in suspect:
                seen[rec.id] = seen.get(rec.id, 0) + 1
    dups = sorted(k for k, c in seen.items() if c > 1)
    if dups:
        shown = ", ".join(repr(d) for d in dups[:5])
        more = f" and {len(dups) - 5} more" if len(dups) > 5 else ""
        raise InputError(f"duplicate ids in input ({id_column!r}): {shown}{more}; ids must be unique")


def render_prompt(row: dict, tokenizer, input_spec: InputSpec) -> list[int]:
    """Token ids for one row, or raises ValueError("reason: detail"), which becomes the row's error."""
    system = [{"role": "system", "content": input_spec.system_prompt}] if input_spec.system_prompt else []
    if input_spec.messages_column:
        messages = row.get(input_spec.messages_column)
        if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        ):
            raise ValueError(f"bad_messages: {input_spec.messages_column!r} must be a non-empty list of "
                             "{role, content} strings")
        if messages[0]["role"] == "system":
            system = []
        return _chat(tokenizer, system + [{"role": m["role"], "content": m["content"]} for m in messages])
    column = input_spec.prompt_column
    if input_spec.prompt_template:
        text, column = render_template(input_spec.prompt_template, row), "input.prompt_template"
    elif column not in row:
        raise ValueError(f"missing_prompt: the row has no {column!r} (input.prompt_column)")
    else:
        text = row[column]
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"empty_prompt: {column!r} is {'empty' if isinstance(text, str) else repr(text)}, not a "
                         "non-empty string")
    if input_spec.chat_template:
        return _chat(tokenizer, system + [{"role": "user", "content": text}])
    return _tokenize(lambda: tokenizer(text, add_special_tokens=False)["input_ids"])


def _chat(tokenizer, messages) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("tokenizer: the target tokenizer has no chat template")
    return _tokenize(lambda: tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                           return_dict=False))


def _tokenize(fn) -> list[int]:
    try:
        return list(fn())
    except Exception as exc:  # a template or tokenizer that fails on this row fails this row only
        raise ValueError(f"tokenizer: {type(exc).__name__}: {exc}") from None
