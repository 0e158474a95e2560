"""What a worker is given: the job's own config sections, as the job config holds them (jobs/spec.py embeds
the same types), and `resources`, the job's workers and batching, defined here so that workers need nothing
of jobs/.

A field that changes how fast a job runs but never its output rows is marked `NEUTRAL` where it is declared
(here, in jobs/spec.py and in specdec/config.py); a job's fingerprint leaves exactly those fields out.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from specdec.choices import METHODS
from specdec.config import Config, ModelsConfig, ModelSource, SamplingParams, SpecConfig

from .inputs import InputSpec
from .outputs import OutputSpec

NEUTRAL = {"output_neutral": True}  # json_schema_extra of an output-neutral field


class WorkerRange(Config):
    """`resources.num_workers: {min, max}`: start once `min` workers are placed, grow to `max`."""

    min: int
    max: int


class ResourcesSpec(Config):
    num_workers: int | Literal["auto"] | WorkerRange = Field(
        1, description="worker actors: N; `{min: N, max: M}`: the job starts once N are placed and adds workers up "
        "to M as nodes join (those not placed yet wait as demand an autoscaler can see), carrying on with fewer "
        "when nodes leave; `auto`: as many as the cluster's free CPUs/GPUs fit, rechecked as nodes come and go",
        json_schema_extra={**NEUTRAL, "one_row": True})
    gpus_per_worker: float | None = Field(None, ge=0, description="Ray GPUs per worker (a worker with one runs on "
                                          "it); null: 1 where the Ray cluster has GPUs, else 0",
                                          json_schema_extra=NEUTRAL)
    cpus_per_worker: float = Field(1, gt=0, description="Ray CPUs per worker", json_schema_extra=NEUTRAL)
    batch_size: int = Field(16, ge=1, description="rows decoded together by a worker (continuous batching)",
                            json_schema_extra=NEUTRAL)
    gpu_memory_fraction: float = Field(
        0.9, gt=0.0, le=1.0, description="share of a worker's GPU its weights, KV caches and steps may use: a batch "
        "that does not fit runs with fewer rows, a prompt that cannot fit one row becomes an error row, a config "
        "that cannot fit one row of `max_new_tokens` stops the worker at start, with the figures",
        json_schema_extra=NEUTRAL)
    prefix_caching: bool = Field(True, description="reuse the keys and values of prompt prefixes a worker has "
                                 "computed (a shared system prompt, few-shot examples, a prompt's samples, a retried "
                                 "shard's rows) instead of computing them again, admitting rows that share their "
                                 "first 128 tokens together: the same tokens either way",
                                 json_schema_extra=NEUTRAL)
    prefix_cache_gib: float = Field(1.0, ge=0, description="most memory the kept prefixes take on a worker's device "
                                    "(least recently used evicted first); on a GPU, within `gpu_memory_fraction`: "
                                    "what the batch's rows leave, and room held back from them for the prefixes "
                                    "they share (at most a quarter)", json_schema_extra=NEUTRAL)
    prefill_chunk: int | None = Field(2048, ge=1, description="most prompt tokens (rows x tokens) one prefill "
                                      "forward takes, so that admitting many long prompts neither spikes memory "
                                      "nor needs room for them all at once (the GPU memory plan counts one chunk); "
                                      "while rows decode, rows join within one chunk, computed in the round's "
                                      "forward beside the others' verification; null: each admission in one "
                                      "forward", json_schema_extra=NEUTRAL)
    kv_cache: Literal["dense", "paged"] = Field(
        "dense", description="how a worker holds keys and values: `dense` rows each of the batch's longest row's "
        "slots, or `paged`: 16-token blocks each row reserves for its prompt and `max_new_tokens` when it joins, so "
        "that rows of mixed lengths take their own tokens and more of them fit a GPU; rows share a prompt's "
        "samples' and a stored prefix's blocks by reference, so rows of one instruction reserve only what they "
        "write (rows join while blocks are free; attention reads the blocks gathered: one layer's 6.4× dense on an "
        "H200 at batch 64)", json_schema_extra=NEUTRAL)
    shard_size: int = Field(256, ge=1, description="rows per part")
    max_retries: int = Field(3, ge=0, description="retries of a shard whose worker process died (Ray restarts the "
                             "worker and runs the shard again)", json_schema_extra=NEUTRAL)
    shard_timeout_s: float | None = Field(1800.0, gt=0, description="a worker that makes no progress (no tokens) "
                                          "for this long is killed and its shard retried; null: never",
                                          json_schema_extra=NEUTRAL)
    group_timeout_s: float = Field(1800.0, gt=0, description="how long the ranks of a tensor-parallel worker wait "
                                   "for each other, to meet and in any call among them (torch.distributed's "
                                   "timeout), before the worker is restarted", json_schema_extra=NEUTRAL)

    @field_validator("num_workers", mode="before")
    @classmethod
    def _workers(cls, value):
        """One clear message for every bad form (pydantic would list one per form of the union)."""
        form = "write N (1 or more), auto, or {min: N, max: M} with 1 <= N <= M"
        if isinstance(value, dict):
            lo, hi = value.get("min"), value.get("max")
            if set(value) != {"min", "max"} or not all(type(v) is int for v in (lo, hi)) or not 1 <= lo <= hi:
                raise ValueError(f"{value!r} is not a range of workers: {form}")
        elif value != "auto" and (type(value) is not int or value < 1) and not isinstance(value, WorkerRange):
            raise ValueError(f"{value!r} is not a number of workers: {form}")
        return value

    def engine_settings(self) -> dict:
        """The engine's prefix caching, prefill and KV cache arguments (specdec.engine.SpecEngine)."""
        return {"prefix_caching": self.prefix_caching, "prefix_cache_bytes": int(self.prefix_cache_gib * (1 << 30)),
                "prefill_chunk": self.prefill_chunk, "kv_cache": self.kv_cache}

    def worker_limits(self) -> tuple[int, int | None]:
        """(min, max) of `num_workers`: N is (N, N), `auto` is (1, None): as many as fit."""
        n = self.num_workers
        if n == "auto":
            return 1, None
        if isinstance(n, WorkerRange):
            return n.min, n.max
        return n, n

    def gpus(self, cluster_gpus: float) -> float:
        """GPUs each worker asks Ray for: `gpus_per_worker` as set, else one where the cluster has any."""
        if self.gpus_per_worker is not None:
            return self.gpus_per_worker
        return 1.0 if cluster_gpus >= 1 else 0.0


class WorkerSpec(Config):
    """The job config's sections a worker runs by (jobs.spec.JobSpec.worker_spec), with
    `resources.gpus_per_worker` resolved against the cluster (never null here)."""

    models: ModelsConfig
    generation: SamplingParams
    speculation: SpecConfig
    input: InputSpec
    output: OutputSpec
    resources: ResourcesSpec

    @model_validator(mode="after")
    def _resolved(self):
        if self.resources.gpus_per_worker is None:
            raise ValueError("a worker needs resources.gpus_per_worker resolved (JobSpec.worker_spec does it)")
        return self

    @property
    def use_gpu(self) -> bool:
        return self.resources.gpus_per_worker > 0


def models_used(models: ModelsConfig, speculation: SpecConfig) -> dict[str, ModelSource]:
    """The models a worker loads, by config key: the target, and the draft where the method runs one."""
    used: dict[str, ModelSource] = {"models.target.path": models.target}
    if METHODS[speculation.method].draft_model and models.draft is not None:
        used["models.draft.path"] = models.draft
    return used
