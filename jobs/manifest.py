"""A job's output folder and its manifest (`_manifest.json`): what a run finds there, what it refuses, what a
part's entry holds, and what `status`, `report` and `estimate` read back (`read_output`, `throughput`).

The manifest holds the config and its fingerprint, the input files (path, size, ETag or mtime) and one
entry per committed part. A run against an existing output resumes it when both the config's output
keys and the input files are unchanged, and is refused otherwise (naming the key or the file) unless
`--overwrite`.
"""

from __future__ import annotations

import io
import json
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timezone

import pyarrow.parquet as pq

from workers.inputs import Shard
from workers.outputs import COUNTS, OPENAI_DIR, part_entry
from workers.storage import open_storage

from .spec import JobSpec, changed_keys, recorded_spec

MANIFEST, SUCCESS = "_manifest.json", "_SUCCESS"


class JobError(RuntimeError):
    """The job cannot go on (conflicting output, a shard out of retries, workers that cannot start)."""


class OutputError(ValueError):
    """A path holds no job output to read (no manifest, no committed parts)."""


def _clear(storage) -> None:
    for name in storage.list():
        if name in (MANIFEST, SUCCESS) or name.startswith(OPENAI_DIR) or (name.startswith("part-") and name.endswith(".parquet")):
            storage.delete(name)


def _version(key: str, value) -> str:
    if key == "mtime_ns" and isinstance(value, int):
        return datetime.fromtimestamp(value / 1e9, timezone.utc).isoformat(timespec="microseconds")
    return str(value)


def input_changes(old: list, new: list[dict]) -> list[str]:
    """How the input files differ from those an output was made of (the manifest's `input.files`: path, size,
    and ETag or mtime_ns): one line per file added, removed or changed. A manifest from before input files were
    fingerprinted (a list of paths) differs in nothing."""
    if not old or not all(isinstance(f, dict) and "path" in f for f in old):
        return []
    before, after = {f["path"]: f for f in old}, {f["path"]: f for f in new}
    out = []
    for path in sorted(before.keys() | after.keys()):
        a, b = before.get(path), after.get(path)
        if a is None:
            out.append(f"input file {path} was added")
        elif b is None:
            out.append(f"input file {path} was removed")
        else:
            diffs = [f"{label} {_version(key, a.get(key))} -> {_version(key, b.get(key))}"
                     for key, label in (("size", "size"), ("etag", "ETag"), ("mtime_ns", "modified"))
                     if a.get(key) != b.get(key)]
            if diffs:
                out.append(f"input file {path} changed ({', '.join(diffs)})")
    return out


def _same_rows(old: dict, spec: JobSpec) -> bool:
    """Whether an output's recorded config and code versions give this job's fingerprint under today's rules (a
    manifest written before a rule left a setting out of the fingerprint)."""
    before = recorded_spec(old)
    return before is not None and before.fingerprint(old.get("versions", {})) == spec.fingerprint()


def prepare_output(spec: JobSpec, storage, shards: list[Shard], total: int, files: list[dict],
                   overwrite: bool) -> dict:
    """The manifest for this run: refuses an output holding a different job, or made of other input files (size,
    ETag or mtime changed, a file added or removed), unless overwrite. `files`: the scan's input files
    (`Shards.files`, listed before the scan read them)."""
    raw = storage.read_bytes(MANIFEST)
    if raw is not None:
        old = json.loads(raw)
        if overwrite:
            _clear(storage)
        elif old.get("fingerprint") != spec.fingerprint() and not _same_rows(old, spec):
            before = recorded_spec(old)
            changed = changed_keys(old.get("spec", {}) if before is None else before.output_settings(),
                                   spec.output_settings())
            before = old.get("versions", {})
            changed += [f"{k} version {before.get(k, 'unrecorded')} -> {v}" for k, v in spec.versions().items()
                        if before.get(k) != v]
            raise JobError(
                f"{storage.uri('')} holds the outputs of a different job config (changed: {', '.join(changed) or '?'}); "
                "re-run with --overwrite to discard them, or choose another output.path")
        else:
            changes = input_changes(old.get("input", {}).get("files", []), files)
            if changes:
                also = f"; also: {'; '.join(changes[1:3])}" if len(changes) > 1 else ""
                also += f" and {len(changes) - 3} more" if len(changes) > 3 else ""
                raise JobError(
                    f"{changes[0]} since the output at {storage.uri('')} was written{also}; its parts are of the "
                    "old input: re-run with --overwrite to discard the output, or choose another output.path")
    elif overwrite:
        _clear(storage)
    parts, wall_s = {}, 0.0
    committed = {n for n in storage.list("part-") if n.endswith(".parquet")}
    if raw is not None and not overwrite:
        wall_s = json.loads(raw).get("wall_s", 0.0)  # earlier runs' wall time (a killed run's is lost)
    if raw is not None and not overwrite:
        parts = {k: v for k, v in json.loads(raw).get("parts", {}).items() if k in committed}
    for name in sorted(committed - set(parts)):  # committed after the last manifest update
        parts[name] = part_entry(storage.read_bytes(name))
    return {
        "name": spec.name,
        "fingerprint": spec.fingerprint(),
        "spec": spec.model_dump(mode="json"),
        "versions": spec.versions(),  # of the code the rows depend on (coupled sampling's noise)
        "input": {"rows": total, "files": files},  # [{path, size, etag | mtime_ns}]: a rerun checks them
        "num_shards": len(shards),
        "wall_s": wall_s,
        "parts": parts,
    }


PART_KEYS = ("rows", "sha256", "errors", *COUNTS, "control", "device", "devices", "worker", "node",
             "wall_s")  # a part's manifest entry


def error_counts(manifest: dict) -> dict[str, int]:
    """Error rows by reason over every committed part."""
    total: Counter[str] = Counter()
    for part in manifest["parts"].values():
        total.update(part.get("errors", {}))
    return dict(sorted(total.items()))


def rate(tokens: float, seconds: float) -> float | None:
    """tokens / seconds; None without seconds."""
    return tokens / seconds if seconds > 0 else None


def throughput(parts: list[dict], wall_s: float) -> dict[str, float | None]:
    """The job's two throughput figures from its parts' manifest entries and its recorded wall time (every
    run's, a killed run's up to its last manifest update): `job_tokens_per_s`, output tokens per second of wall
    clock; `worker_tokens_per_s`, output tokens per second workers spent on the parts that record it."""
    timed = [p for p in parts if "wall_s" in p]
    return {"job_tokens_per_s": rate(sum(p.get("generated_tokens", 0) for p in parts), wall_s),
            "worker_tokens_per_s": rate(sum(p.get("generated_tokens", 0) for p in timed),
                                        sum(p["wall_s"] for p in timed))}


@dataclass
class Output:
    """A job's output as it stands: its manifest, its committed parts (listed, and entered in the manifest) in
    order, and their rows as columns (`None` for a column an older part lacks)."""

    manifest: dict
    parts: list[str]
    columns: dict[str, list]

    def rows(self) -> list[dict]:
        names = list(self.columns)
        return [dict(zip(names, values)) for values in zip(*self.columns.values())]


def read_output(path: str, columns: list[str]) -> Output:
    """Read a job's output (local or S3) for `status`, `report` and `estimate`: `columns` of every row of its
    committed parts, `error` always among them. Raises OutputError where there is none."""
    st = open_storage(path)
    raw = st.read_bytes(MANIFEST)
    if raw is None:
        raise OutputError(f"{path}: no job output here ({MANIFEST} is missing)")
    manifest = json.loads(raw)
    parts = sorted(n for n in st.list("part-") if n.endswith(".parquet") and n in manifest["parts"])
    if not parts:
        raise OutputError(f"{path}: no committed parts yet")
    columns = list(dict.fromkeys(["error", *columns]))
    out: dict[str, list] = {c: [] for c in columns}
    for name in parts:
        # no Arrow thread pool: its threads can abort a short-lived process at exit (apache/arrow#34314)
        part = pq.ParquetFile(io.BytesIO(st.read_bytes(name)))
        table = part.read([c for c in columns if c in part.schema_arrow.names], use_threads=False)
        for c in columns:
            out[c] += table.column(c).to_pylist() if c in table.column_names else [None] * table.num_rows
    return Output(manifest, parts, out)
