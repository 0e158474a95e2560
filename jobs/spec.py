"""The job config: pydantic models mirroring the YAML of ARCHITECTURE.md. Unknown keys are refused,
naming the key; `--set dotted.key=value` overrides are applied before validation."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from specdec.config import SamplingParams, SpecConfig
from specdec.models import DTYPE_NAMES, ModelSource


class ConfigError(ValueError):
    """A config the job refuses; the message names the key."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


DType = Literal[DTYPE_NAMES]  # the names specdec.models.resolve_dtype takes


class InputSpec(_Strict):
    path: str = Field(description="local file/folder or s3://bucket/key-or-prefix; .jsonl or .parquet")
    id_column: str = Field("id", description="unique per row; duplicates are refused before anything runs")
    prompt_column: str | None = Field("prompt", description="raw text, tokenized as is")
    messages_column: str | None = Field(None, description="list of {role, content}, rendered with the chat template")
    chat_template: bool = Field(False, description="wrap prompt_column text as one user message")


class OutputSpec(_Strict):
    path: str = Field(description="local folder or s3://bucket/prefix/")


class TargetSpec(_Strict):
    path: str = Field(description="HF folder, folder holding gguf_file, or pypi:NAME==VERSION")
    gguf_file: str | None = None
    dtype: DType = "auto"
    tensor_parallel: int = Field(1, ge=1, description="GPUs the target is split over (1 until TP lands)")


class DraftSpec(_Strict):
    path: str
    gguf_file: str | None = None
    dtype: DType = "auto"


class ModelsSpec(_Strict):
    target: TargetSpec
    draft: DraftSpec | None = None


class GenerationSpec(_Strict):
    max_new_tokens: int = Field(256, ge=1)
    temperature: float = Field(0.0, ge=0.0, description="0 = greedy")
    top_k: int = Field(0, ge=0, description="0 = off")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int = 0
    stop_token_ids: list[int] = Field(default_factory=list, description="besides the target's EOS ids")


class AcceptanceHeadSpec(_Strict):
    path: str
    threshold: float = Field(0.3, gt=0.0, lt=1.0)


class SpeculationSpec(_Strict):
    method: Literal["none", "draft_model", "prompt_lookup"] = "draft_model"
    num_draft_tokens: int = Field(4, ge=0, description="fixed length, and where heuristic starts")
    draft_length: Literal["fixed", "heuristic", "confidence", "acceptance_head", "goodput"] = "fixed"
    max_draft_tokens: int = Field(16, ge=1, le=64)
    verification: Literal["lossless", "fuzzy", "conditional"] = "lossless"
    confidence_threshold: float = Field(0.4, gt=0.0, lt=1.0)
    acceptance_head: AcceptanceHeadSpec | None = None
    draft_vocab: int = Field(0, ge=0, description="draft scores only the first N token ids (0 = all)")
    verify_padding: bool = Field(True, description="verify over a wider window when measured cheaper")
    prompt_lookup_max_ngram: int = Field(3, ge=1)
    prompt_lookup_min_ngram: int = Field(1, ge=1)


class ResourcesSpec(_Strict):
    num_workers: int = Field(1, ge=1)
    gpus_per_worker: float = Field(0, ge=0)
    cpus_per_worker: float = Field(1, gt=0)
    batch_size: int = Field(16, ge=1)
    gpu_memory_fraction: float = Field(0.9, gt=0.0, le=1.0,
                                       description="share of a GPU the worker's weights, KV caches and steps may use")
    shard_size: int = Field(256, ge=1)
    max_retries: int = Field(3, ge=0, description="attempts per shard after the first, when a worker dies")


class JobSpec(_Strict):
    name: str
    input: InputSpec
    output: OutputSpec
    models: ModelsSpec
    generation: GenerationSpec = Field(default_factory=GenerationSpec)
    speculation: SpeculationSpec = Field(default_factory=SpeculationSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)

    @model_validator(mode="after")
    def _consistent(self):
        sp = self.speculation
        if sp.method == "draft_model" and self.models.draft is None:
            raise ValueError("speculation.method draft_model needs models.draft")
        if sp.verification != "lossless":
            raise ValueError(f"speculation.verification {sp.verification!r} is not available yet; use lossless")
        if sp.num_draft_tokens > sp.max_draft_tokens:
            raise ValueError("speculation.num_draft_tokens must not exceed speculation.max_draft_tokens")
        if sp.draft_length == "acceptance_head" and sp.acceptance_head is None:
            raise ValueError("speculation.draft_length acceptance_head needs speculation.acceptance_head.path")
        if sp.prompt_lookup_min_ngram > sp.prompt_lookup_max_ngram:
            raise ValueError("speculation.prompt_lookup_min_ngram exceeds prompt_lookup_max_ngram")
        if not self.input.prompt_column and not self.input.messages_column:
            raise ValueError("input needs prompt_column or messages_column")
        if self.models.target.tensor_parallel != 1:
            raise ValueError("models.target.tensor_parallel > 1 is not available yet")
        return self

    # -- conversions for the engine ------------------------------------------------------------
    def sampling(self, stop_extra: tuple[int, ...] = ()) -> SamplingParams:
        g = self.generation
        return SamplingParams(max_new_tokens=g.max_new_tokens, temperature=g.temperature, top_k=g.top_k,
                              top_p=g.top_p, seed=g.seed, stop_token_ids=tuple(g.stop_token_ids) + stop_extra)

    def spec_config(self) -> SpecConfig:
        s = self.speculation
        head = s.acceptance_head
        return SpecConfig(method=s.method, num_draft_tokens=s.num_draft_tokens, draft_length=s.draft_length,
                          max_draft_tokens=s.max_draft_tokens, verification=s.verification,
                          confidence_threshold=s.confidence_threshold,
                          acceptance_head_path=head.path if head else None,
                          acceptance_head_threshold=head.threshold if head else 0.3,
                          draft_vocab=s.draft_vocab, verify_padding=s.verify_padding,
                          prompt_lookup_max_ngram=s.prompt_lookup_max_ngram,
                          prompt_lookup_min_ngram=s.prompt_lookup_min_ngram)

    def model_sources(self) -> tuple[ModelSource, ModelSource | None]:
        t, d = self.models.target, self.models.draft
        target = ModelSource(t.path, t.gguf_file, t.dtype)
        draft = ModelSource(d.path, d.gguf_file, d.dtype) if d and self.speculation.method == "draft_model" else None
        return target, draft

    def fingerprint(self) -> str:
        """Hash of everything that changes output rows (not worker count, batch size or retries)."""
        data = self.model_dump(mode="json")
        data.pop("name")
        for k in ("num_workers", "gpus_per_worker", "cpus_per_worker", "batch_size", "max_retries",
                  "gpu_memory_fraction"):
            data["resources"].pop(k)
        data["speculation"].pop("verify_padding")  # a speed setting: rows and their statistics are the same
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


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


def parse_spec(data: dict, overrides: list[str] | tuple[str, ...] = ()) -> JobSpec:
    data = json.loads(json.dumps(data or {}))  # a deep copy
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: write dotted.key=value")
        _set(data, key.strip(), yaml.safe_load(raw))
    try:
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"config error: {_format(exc)}") from None


def load_spec(path: str, overrides: list[str] | tuple[str, ...] = ()) -> JobSpec:
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config {path} must be a mapping of sections")
    return parse_spec(data, overrides)
