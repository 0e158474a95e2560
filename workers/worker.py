"""The generation worker: a Ray actor that owns one model pair for its whole life.

It builds the pair and the engine once, then turns shards into committed parts: read its rows,
render prompts (a bad row becomes an error row), generate, decode, write `part-NNNNN.parquet`
create-only. A row error is data; an engine or process failure propagates so the driver retries the
shard on a fresh worker. The output columns are `id`, `completion` and `SampleResult.COLUMNS`.
"""

from __future__ import annotations

import hashlib
import io
import os
import socket
import time

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import Field

from specdec.config import Config, ModelsConfig, SampleResult, SamplingParams, SpecConfig

from .fetch import localize
from .inputs import InputSpec, Shard, read_shard, render_prompt
from .storage import open_storage

_TYPES = {"token_ids": pa.list_(pa.int32()), "prompt_tokens": pa.int32(), "generated_tokens": pa.int32(),
          "finish_reason": pa.string(), "error": pa.string(), "rounds": pa.int32(), "draft_forwards": pa.int32(),
          "drafted_tokens": pa.int32(), "accepted_tokens": pa.int32(), "draft_lengths": pa.list_(pa.int16()),
          "accept_lengths": pa.list_(pa.int16()), "acceptance_rate": pa.float64(),
          "mean_accepted_length": pa.float64(), "wall_s": pa.float64()}
SCHEMA = pa.schema([("id", pa.string()), ("completion", pa.string())]
                   + [(name, _TYPES[name]) for name in SampleResult.COLUMNS])


class WorkerSpec(Config):
    """What a worker needs of the job (jobs.spec.JobSpec.worker_spec)."""

    models: ModelsConfig
    generation: SamplingParams
    speculation: SpecConfig
    input: InputSpec
    output_path: str
    batch_size: int = Field(ge=1)
    gpu_memory_fraction: float = Field(gt=0.0, le=1.0)
    use_gpu: bool


class GenerationWorker:
    def __init__(self, spec_data: dict, fault_marker: str | None = None):
        import torch

        from specdec.engine import SpecEngine
        from specdec.models import load_pair

        self.spec = spec = WorkerSpec.model_validate(spec_data)
        device = "cuda" if torch.cuda.is_available() and spec.use_gpu else "cpu"
        self.pair = load_pair(localize(spec.models.target), localize(spec.models.draft), device)
        self.tokenizer = self.pair.tokenizer
        self.engine = SpecEngine(self.pair, spec.generation, spec.speculation, batch_size=spec.batch_size,
                                 gpu_memory_fraction=spec.gpu_memory_fraction)
        self.engine.measure_costs()  # goodput's cost profile: once, while the worker loads
        self.storage = open_storage(spec.output_path)
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        self.fault_marker = fault_marker

    def ready(self) -> bool:
        return True

    def process(self, shard_data: dict) -> dict:
        t0 = time.perf_counter()
        shard = Shard(**shard_data)
        inp = self.spec.input
        columns = [c for c in (inp.id_column, inp.prompt_column, inp.messages_column) if c]
        rows = read_shard(shard, columns)
        ids = [str(r.get(inp.id_column)) for r in rows]
        prompts, errors = [], {}
        for i, row in enumerate(rows):
            try:
                prompts.append(render_prompt(row, self.tokenizer, inp))
            except Exception as exc:  # a bad row is that row's error, never the job's
                prompts.append([])
                errors[i] = str(exc) or type(exc).__name__
        todo = [i for i in range(len(rows)) if i not in errors]
        results = dict(zip(todo, self.engine.generate([prompts[i] for i in todo], [ids[i] for i in todo])))
        if self.fault_marker and not os.path.exists(self.fault_marker):  # test hook: die mid-shard once
            open(self.fault_marker, "w").close()
            os._exit(1)
        records = []
        for i, rid in enumerate(ids):
            r = results[i] if i not in errors else SampleResult.failed(rid, 0, errors[i])
            text = None if r.error else self.tokenizer.decode(r.token_ids, skip_special_tokens=True)
            records.append({"id": rid, "completion": text, **r.stats()})
        buf = io.BytesIO()
        pq.write_table(pa.Table.from_pylist(records, schema=SCHEMA), buf, compression="zstd")
        data = buf.getvalue()
        created = self.storage.put_if_absent(shard.part, data)
        if not created:  # another attempt committed it first: that part stands, ours is dropped
            data = self.storage.read_bytes(shard.part)
        ok = [r for r in records if r["finish_reason"] != "error"]
        return {
            "shard": shard.index, "part": shard.part, "rows": len(records), "created": created,
            "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
            "failed": len(records) - len(ok),
            "generated_tokens": sum(r["generated_tokens"] for r in ok),
            "drafted_tokens": sum(r["drafted_tokens"] for r in ok),
            "accepted_tokens": sum(r["accepted_tokens"] for r in ok),
            "rounds": sum(r["rounds"] for r in ok),
            "wall_s": time.perf_counter() - t0,
            "worker": self.name,
            "step_path": self.engine.step_path,
            "peak_gpu_bytes": self._peak_gpu_bytes(),
        }

    def _peak_gpu_bytes(self) -> int | None:
        import torch

        if self.engine.device.type != "cuda":
            return None
        return torch.cuda.max_memory_allocated(self.engine.device)
