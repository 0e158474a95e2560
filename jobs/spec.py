"""The job config: the job YAML (README, "Config reference") as pydantic models. Its `models`, `generation` and
`speculation` sections are the engine's own config types (specdec/config.py), `input`, `output` and
`resources` the workers' (workers/spec.py); this module adds the job's name, and hands a worker those
sections as they are (`JobSpec.worker_spec`). Unknown keys are refused, naming the key and the nearest
valid one; `--set dotted.key=value` overrides are applied before validation. Output-neutral keys are
the fields marked so where they are declared (`OUTPUT_NEUTRAL`).
"""

from __future__ import annotations

import datetime
import difflib
import hashlib
import json
import os
import re
import types
import typing
from typing import Any

import yaml
from pydantic import BaseModel, Field, ValidationError, ValidationInfo, model_validator

from specdec.choices import COUPLED_NOISE_VERSION, METHODS
from specdec.config import Config, ModelsConfig, SamplingParams, SpecConfig
from workers.inputs import InputSpec
from workers.outputs import OutputSpec
from workers.spec import NEUTRAL, ResourcesSpec, WorkerSpec
from workers.storage import is_s3


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


def check_sections(spec) -> None:
    """What a job's and a Generator's sections must agree on: a method that drafts with a model has one, a row has a
    prompt, and a paged cache has a target in one process."""
    if METHODS[spec.speculation.method].draft_model and spec.models.draft is None:
        raise ValueError(f"speculation.method {spec.speculation.method} needs models.draft")
    if not spec.input.prompt_column and not spec.input.messages_column:
        raise ValueError("input needs prompt_column or messages_column")
    if spec.resources.kv_cache == "paged" and spec.models.target.tensor_parallel > 1:
        raise ValueError("resources.kv_cache: paged does not run with models.target.tensor_parallel > 1 yet: use dense")


class JobSpec(Config):
    name: str = Field(description="job name (in the manifest)", json_schema_extra=NEUTRAL)
    input: InputSpec = Field(description="the rows")
    output: OutputSpec = Field(description="where parts go")
    models: ModelsConfig = Field(description="the pair")
    generation: SamplingParams = Field(default_factory=SamplingParams, description="token selection")
    speculation: SpecConfig = Field(default_factory=SpecConfig, description="drafting and verification")
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec, description="workers and batching")

    @model_validator(mode="before")
    @classmethod
    def _resolved_paths(cls, data: Any, info: ValidationInfo) -> Any:
        """`{date}` in output.path becomes the run's date (the validation context's `date`, else $SPECBATCH_DATE,
        else today, UTC); local paths become absolute, so that workers started in other folders find them: the
        output folder always, the input, models and acceptance head where they exist here (elsewhere the path
        may be a Hub id, or a folder of the cluster's nodes). The spec, its fingerprint and the manifest hold
        the resolved paths."""
        if not isinstance(data, dict):
            return data
        date = (info.context or {}).get("date")
        data = _edit(data, ("output", "path"), lambda p: _absolute(resolve_output_path(p, date), always=True))
        for keys in (("input", "path"), ("models", "target", "path"), ("models", "draft", "path"),
                     ("speculation", "acceptance_head", "path")):
            data = _edit(data, keys, _absolute)
        return data

    @model_validator(mode="after")
    def _consistent(self):
        check_sections(self)
        return self

    def worker_spec(self, cluster_gpus: float) -> WorkerSpec:
        """The sections a worker runs by, these very objects, with `resources.gpus_per_worker` resolved against
        the cluster's GPUs (`ResourcesSpec.gpus`)."""
        resources = self.resources.model_copy(update={"gpus_per_worker": self.resources.gpus(cluster_gpus)})
        return WorkerSpec(**{k: getattr(self, k) for k in WorkerSpec.model_fields if k != "resources"},
                          resources=resources)

    def versions(self) -> dict[str, int]:
        """The versions of the code this job's output rows depend on beyond its config: coupled sampling's noise
        (`specdec.choices.COUPLED_NOISE_VERSION`), whose values a new version changes. In the fingerprint and the
        manifest, so that a resume never mixes rows drawn with two versions."""
        return {"coupled_noise": COUPLED_NOISE_VERSION} if self.speculation.sampling == "coupled" else {}

    def output_settings(self) -> dict:
        """The dumped config as far as it decides output rows: without the OUTPUT_NEUTRAL keys, and with the
        speculation settings that its method and policy never read (`SpecConfig.ignored`) at their defaults."""
        data = self.model_dump(mode="json")
        defaults = SpecConfig().model_dump(mode="json")
        for key in self.speculation.ignored():
            data["speculation"][key] = defaults[key]
        for key in OUTPUT_NEUTRAL:
            *path, last = key.split(".")
            node = data
            for k in path:
                node = node.get(k) if isinstance(node, dict) else None
            if isinstance(node, dict):
                node.pop(last, None)
        return data

    def fingerprint(self, versions: dict[str, int] | None = None) -> str:
        """Hash of `output_settings` and the code's `versions` (another run's, where given)."""
        data = self.output_settings()
        versions = self.versions() if versions is None else versions
        if versions:  # a job without one keeps the fingerprint it had before versions were recorded
            data["versions"] = versions
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def recorded_spec(manifest: dict) -> JobSpec | None:
    """The config an output's manifest records, read under today's rules (None where it no longer validates)."""
    try:
        return JobSpec.model_validate(manifest.get("spec", {}))
    except ValidationError:
        return None


def _edit(tree: dict, keys: tuple[str, ...], fn) -> dict:
    """`tree` with the string at `keys` replaced by fn(it), copied along the way (the caller's dicts are left
    alone); `tree` itself where there is no string there."""
    head, *rest = keys
    value = tree.get(head)
    if rest:
        new = _edit(value, tuple(rest), fn) if isinstance(value, dict) else value
    else:
        new = fn(value) if isinstance(value, str) else value
    return tree if new is value else {**tree, head: new}


def _absolute(path: str, always: bool = False) -> str:
    """A local path made absolute where it exists here (or `always`); `s3://` and `pypi:` paths as they are."""
    if is_s3(path) or path.startswith("pypi:") or not (always or os.path.exists(path)):
        return path
    return os.path.abspath(path)


def _output_neutral(model: type[BaseModel], prefix: str = "") -> tuple[str, ...]:
    """The dotted keys of `model`'s fields marked output-neutral where they are declared (`NEUTRAL`)."""
    out: list[str] = []
    for name, field in model.model_fields.items():
        extra = field.json_schema_extra
        if isinstance(extra, dict) and extra.get("output_neutral"):
            out.append(prefix + name)
        sub = _section(field.annotation)
        if sub is not None:
            out += _output_neutral(sub, f"{prefix}{name}.")
    return tuple(out)


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


def _unknown_key(loc: tuple, root: type[BaseModel] = JobSpec) -> str:
    """"unknown key", and the key of that section nearest to it (what a typo meant), else the section's keys."""
    model: type[BaseModel] | None = root
    for part in loc[:-1]:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        model = _section(field.annotation) if field is not None else None
        if model is None:
            return "unknown key"
    keys = list(model.model_fields)
    section = ".".join(str(p) for p in loc[:-1])
    near = difflib.get_close_matches(str(loc[-1]), keys, n=1, cutoff=0.6)
    if near:
        return f"unknown key (did you mean {section + '.' if section else ''}{near[0]}?)"
    return f"unknown key ({section or 'the config'} has: {', '.join(keys)})"


def format_errors(err: ValidationError, root: type[BaseModel] = JobSpec) -> str:
    """A validation error of a `root` config as "key: what is wrong; ..." (a typo: the key meant)."""
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = _unknown_key(e["loc"], root)
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
        raise ConfigError(f"config error: {format_errors(exc)}") from None


def load_spec(path: str, overrides: list[str] | tuple[str, ...] = (), date: str | None = None) -> JobSpec:
    return parse_spec(read_config(path), overrides, date)


def read_config(path: str) -> dict:
    """A config file's mapping of sections; ConfigError for a file that cannot be read or is not one."""
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config {path} must be a mapping of sections")
    return data


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
    models.draft, gets its own row too; one whose description gives its whole shape, `one_row`, only that row),
    from the models' fields and descriptions."""
    rows = []
    for name, field in model.model_fields.items():
        key = prefix + name
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        sub = None if extra.get("one_row") else _section(field.annotation)
        optional = not field.is_required() and field.get_default(call_default_factory=True) is None
        if sub is None or optional:
            rows.append(f"| `{key}` | {_default(field)} | {field.description} |")
        if sub is not None:
            rows += config_reference(sub, key + ".")
    return rows


# keys that change how fast a job runs, not what it writes (marked where declared): changing them keeps an
# output resumable
OUTPUT_NEUTRAL = _output_neutral(JobSpec)
