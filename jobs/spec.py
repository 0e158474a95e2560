"""The job config: the YAML of ARCHITECTURE.md as pydantic models. Its `models`, `generation` and
`speculation` sections are the engine's own config types (specdec/config.py), `input` the worker's
(workers/inputs.py); this module adds the job's name, output and resources. Unknown keys are refused,
naming the key; `--set dotted.key=value` overrides are applied before validation.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import types
import typing
from typing import Any

import yaml
from pydantic import BaseModel, Field, ValidationError, ValidationInfo, model_validator

from specdec.config import Config, ModelsConfig, SamplingParams, SpecConfig
from workers.inputs import InputSpec
from workers.outputs import OutputSpec
from workers.worker import WorkerSpec

# keys that change how fast a job runs, not what it writes: changing them keeps an output resumable
OUTPUT_NEUTRAL = ("name", "resources.num_workers", "resources.gpus_per_worker", "resources.cpus_per_worker",
                  "resources.batch_size", "resources.max_retries", "resources.gpu_memory_fraction",
                  "resources.shard_timeout_s", "speculation.verify_padding")


class ConfigError(ValueError):
    """A config the job refuses; the message names the key."""


DATE_ENV = "SPECBATCH_DATE"  # the date `{date}` stands for, when not today's (UTC)


def run_date(date: str | None = None) -> str:
    """The date `{date}` in output.path stands for: `date` (`--date`), else $SPECBATCH_DATE, else today (UTC)."""
    for value, source in ((date, "--date"), (os.environ.get(DATE_ENV), DATE_ENV)):
        if value:
            try:
                if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", value):
                    raise ValueError
                return datetime.date.fromisoformat(value).isoformat()
            except ValueError:
                raise ConfigError(f"{source} {value!r} is not a date as YYYY-MM-DD (what {{date}} in output.path "
                                  "stands for)") from None
    return datetime.datetime.now(datetime.timezone.utc).date().isoformat()


def resolve_output_path(path: str, date: str | None = None) -> str:
    """An output path with `{date}` replaced by the run's date (`run_date`); any other placeholder is refused."""
    def sub(m: re.Match) -> str:
        if m.group(1) != "date":
            raise ConfigError(f"output.path: unknown placeholder {m.group(0)} in {path!r}; the one allowed is {{date}} "
                              "(the run's UTC date, YYYY-MM-DD)")
        return run_date(date)

    out = re.sub(r"\{([^{}]*)\}", sub, path)
    if "{" in out or "}" in out:
        raise ConfigError(f"output.path: unmatched brace in {path!r}; the one placeholder allowed is {{date}}")
    return out


class ResourcesSpec(Config):
    num_workers: int = Field(1, ge=1, description="worker actors")
    gpus_per_worker: float | None = Field(None, ge=0, description="Ray GPUs per worker (a worker with one runs on "
                                          "it); null: 1 where the Ray cluster has GPUs, else 0")
    cpus_per_worker: float = Field(1, gt=0, description="Ray CPUs per worker")
    batch_size: int = Field(16, ge=1, description="rows decoded together by a worker (continuous batching)")
    gpu_memory_fraction: float = Field(
        0.9, gt=0.0, le=1.0, description="share of a worker's GPU its weights, KV caches and steps may use: a batch "
        "that does not fit runs with fewer rows, a prompt that cannot fit one row becomes an error row, a config "
        "that cannot fit one row of `max_new_tokens` stops the worker at start, with the figures")
    shard_size: int = Field(256, ge=1, description="rows per part")
    max_retries: int = Field(3, ge=0, description="retries of a shard whose worker process died (Ray restarts the "
                                                    "worker and runs the shard again)")
    shard_timeout_s: float | None = Field(1800.0, gt=0, description="a worker that makes no progress (no tokens) "
                                          "for this long is killed and its shard retried; null: never")


class JobSpec(Config):
    name: str = Field(description="job name (in the manifest)")
    input: InputSpec = Field(description="the rows")
    output: OutputSpec = Field(description="where parts go")
    models: ModelsConfig = Field(description="the pair")
    generation: SamplingParams = Field(default_factory=SamplingParams, description="token selection")
    speculation: SpecConfig = Field(default_factory=SpecConfig, description="drafting and verification")
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec, description="workers and batching")

    @model_validator(mode="before")
    @classmethod
    def _dated_output(cls, data: Any, info: ValidationInfo) -> Any:
        """`{date}` in output.path becomes the run's date (the validation context's `date`, else $SPECBATCH_DATE,
        else today, UTC): the spec, its fingerprint and the manifest hold the resolved path."""
        out = data.get("output") if isinstance(data, dict) else None
        if isinstance(out, dict) and isinstance(out.get("path"), str):
            date = (info.context or {}).get("date")
            data = {**data, "output": {**out, "path": resolve_output_path(out["path"], date)}}
        return data

    @model_validator(mode="after")
    def _consistent(self):
        if self.speculation.method == "draft_model" and self.models.draft is None:
            raise ValueError("speculation.method draft_model needs models.draft")
        if not self.input.prompt_column and not self.input.messages_column:
            raise ValueError("input needs prompt_column or messages_column")
        return self

    def gpus_per_worker(self, cluster_gpus: float) -> float:
        """GPUs each worker asks Ray for: as set, else one where the cluster has any."""
        gpus = self.resources.gpus_per_worker
        return gpus if gpus is not None else (1.0 if cluster_gpus >= 1 else 0.0)

    def worker_spec(self, gpus: float = 0.0) -> WorkerSpec:
        models = self.models
        if self.speculation.method != "draft_model":
            models = models.model_copy(update={"draft": None})  # no second model to load
        return WorkerSpec(models=models, generation=self.generation, speculation=self.speculation, input=self.input,
                          output=self.output, batch_size=self.resources.batch_size,
                          gpu_memory_fraction=self.resources.gpu_memory_fraction,
                          use_gpu=gpus > 0, cpus_per_rank=self.resources.cpus_per_worker, gpus_per_rank=gpus,
                          group_timeout_s=self.resources.shard_timeout_s or 1800.0)

    def fingerprint(self) -> str:
        """Hash of everything that changes output rows (not the OUTPUT_NEUTRAL keys)."""
        data = self.model_dump(mode="json")
        for key in OUTPUT_NEUTRAL:
            *path, last = key.split(".")
            node = data
            for k in path:
                node = node[k]
            node.pop(last, None)
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def changed_keys(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two dumped specs, output-neutral ones left out."""
    out = []
    for k in sorted(set(old) | set(new)):
        x, y = old.get(k), new.get(k)
        if isinstance(x, dict) and isinstance(y, dict):
            out += changed_keys(x, y, f"{prefix}{k}.")
        elif x != y:
            out.append(prefix + k)
    return [k for k in out if k not in OUTPUT_NEUTRAL]


def _set(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        if node.get(k) is None:
            node[k] = {}
        node = node[k]
        if not isinstance(node, dict):
            raise ConfigError(f"--set {dotted}: {k} is not a section")
    node[keys[-1]] = value


def _format(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        elif msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        lines.append(f"{key}: {msg}" if key else msg)
    return "; ".join(lines)


def parse_spec(data: dict, overrides: list[str] | tuple[str, ...] = (), date: str | None = None) -> JobSpec:
    """A validated spec; `date` (YYYY-MM-DD) is what `{date}` in output.path stands for (default: run_date())."""
    data = json.loads(json.dumps(data or {}))  # a deep copy
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: write dotted.key=value")
        _set(data, key.strip(), yaml.safe_load(raw))
    try:
        return JobSpec.model_validate(data, context={"date": date})
    except ValidationError as exc:
        raise ConfigError(f"config error: {_format(exc)}") from None


def load_spec(path: str, overrides: list[str] | tuple[str, ...] = (), date: str | None = None) -> JobSpec:
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config {path} must be a mapping of sections")
    return parse_spec(data, overrides, date)


def _section(annotation) -> type[BaseModel] | None:
    """The config model a field holds (unwrapping `X | None`), if it is one."""
    args = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    return next((a for a in args if isinstance(a, type) and issubclass(a, BaseModel)), None)


def _default(field) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "null"
    if isinstance(value, str):
        return f"`{value}`"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (tuple, list)):
        return "[]" if not value else str(list(value))
    return str(value)


def config_reference(model: type[BaseModel] = JobSpec, prefix: str = "") -> list[str]:
    """The README's config reference: one markdown row per leaf key (a section that may be null, such as
    models.draft, gets its own row too), from the models' fields and descriptions."""
    rows = []
    for name, field in model.model_fields.items():
        key = prefix + name
        sub = _section(field.annotation)
        optional = not field.is_required() and field.get_default(call_default_factory=True) is None
        if sub is None or optional:
            rows.append(f"| `{key}` | {_default(field)} | {field.description} |")
        if sub is not None:
            rows += config_reference(sub, key + ".")
    return rows
