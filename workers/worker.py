"""The generation worker: a Ray actor that owns one model pair for its whole life.

It builds the pair and the engine once, then turns shards into committed parts: read its rows,
render prompts (a bad row becomes an error row), generate, decode, write `part-NNNNN.parquet`
create-only. A row error is data ("reason: detail" in its `error` column); running out of memory
shrinks the batch; a process failure propagates, and Ray restarts the worker and retries the shard
(jobs/driver.py). The output columns are `id`, `completion` and `SampleResult.COLUMNS`.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time

from specdec.config import SampleResult, SamplingParams, SpecConfig

from . import faults, logs
from .fetch import cache_dir, localize, source_kind
from .inputs import Shard, read_shard
from .loading import Stages
from .outputs import commit_jsonl, parquet_bytes, parsed_types, part_entry
from .preflight import device_name
from .rows import free_memory, generate_fitting, generate_rows
from .spec import WorkerSpec, models_used
from .storage import open_storage


class GenerationWorker:
    """Runs in a Ray actor with two threads: `process` works on a shard while `progress` answers the driver's
    hang checks."""

    def __init__(self, spec: WorkerSpec, stage_key: str | None = None):
        """Load the pair and build the engine, telling the driver each stage under `stage_key` (workers/loading.py)."""
        import torch

        from specdec.engine import SpecEngine
        from specdec.exec.models import load_pair

        logs.to_file(os.environ.get("SPECBATCH_WORKER_LOGS"))  # quiet by default: our output goes to a log file
        logs.setup(os.environ.get("SPECBATCH_LOG_LEVEL", "warning"))  # the driver's --log-level
        stage = Stages(stage_key)
        stage("starting")
        if faults.once("EXIT_IN_INIT"):  # test hook: die while loading the models
            os._exit(1)
        self.spec = spec
        used = models_used(spec.models, spec.speculation)
        remote = [key for key, src in used.items() if source_kind(src.path) in ("pypi", "s3")]
        if remote:
            stage(f"fetching {' and '.join(remote)} (once per node)")
        target = localize(used["models.target.path"])
        tp, self.layout, batch_size = None, None, spec.resources.batch_size
        if target.tensor_parallel > 1:  # this actor is rank 0 of a group (workers/group.py)
            from . import group
            from .fetch import local_snapshot

            # every rank reads its slice of the safetensors files: a Hub id is downloaded here, once per node
            target = target.model_copy(update={"path": local_snapshot(target.path, key="models.target.path")})
            stage(f"starting {target.tensor_parallel} tensor-parallel ranks")
            tp, self.layout = group.start(target, spec.resources)  # binds this rank's GPU before CUDA starts
            batch_size = group.batch_size_after_oom(batch_size)
        device = ("cuda" if tp is None else str(tp.group.device)) if spec.use_gpu and torch.cuda.is_available() \
            else "cpu"
        draft = localize(used.get("models.draft.path"))
        stage(f"loading the models on {device}")
        self.pair = load_pair(target, draft, device, tp=tp, cache=str(cache_dir()))  # GGUF: dequantized once
        faults.gate("init")  # test hook: wait for a test to release or kill this process
        self.tokenizer = self.pair.tokenizer
        self.engine = SpecEngine(self.pair, spec.generation, spec.speculation, batch_size=batch_size,
                                 gpu_memory_fraction=spec.resources.gpu_memory_fraction,
                                 step_fault=faults.step_fault(), profile_cache=str(cache_dir() / "profiles"),
                                 **spec.resources.engine_settings())
        if self.engine.needs_costs:
            stage("measuring the pair's step costs (draft_length: goodput), or reading them if kept")
        with _group_guard():
            self.engine.measure_costs()  # goodput's cost profile: once, while the worker loads
        self.storage = open_storage(spec.output.path)
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        self.node = _node_id()
        self.device_name = device_name(self.engine.device)
        # the devices this worker holds, every rank's: what its seconds are charged for (a fraction of a GPU too)
        per_rank = spec.resources.gpus_per_worker if self.engine.device.type == "cuda" else 1
        self.devices = target.tensor_parallel * per_rank
        self._control = None
        self._last_progress = time.monotonic()

    def ready(self) -> dict:
        """Where this worker's process runs: its `name` (host:pid) and Ray `node` id."""
        return {"name": self.name, "node": self.node}

    def check(self) -> list[dict]:
        """Preflight (`specbatch check`): this worker's devices, its engine's checks, its output's storage."""
        from specdec.exec.preflight import engine_checks, row

        from .preflight import storage_probe
        return ([row("worker devices", f"{self.devices:g} x {self.device_name}", True)]
                + engine_checks(self.engine) + [storage_probe(self.spec.output.path)])

    def group_layout(self) -> list[dict] | None:
        """Where a tensor-parallel worker's ranks run (node, GPUs, weight bytes); None for one process."""
        return self.layout

    def progress(self) -> float:
        """Seconds since this worker last made progress (a round's tokens, or a shard started)."""
        return time.monotonic() - self._last_progress

    def _tick(self, tokens: int = 0) -> None:
        self._last_progress = time.monotonic()

    def process(self, shard_data: dict) -> dict:
        t0 = time.perf_counter()
        self._tick()
        if faults.once("HANG_ONCE"):  # test hook: a worker that stops making progress
            while True:
                time.sleep(60)
        shard = Shard(**shard_data)
        inp = self.spec.input
        keep = self.spec.output.keep_columns
        records = read_shard(shard, inp.key_column, inp.columns(keep))
        with _group_guard():
            engine = self.control_engine() if shard.control else self.engine
            rows, _ = generate_rows(records, inp, self.spec.generation, self.tokenizer,
                                    lambda p, k, s: self.generate(engine, p, k, s), keep, shard.control)
        if faults.once("EXIT_ONCE"):  # test hook: die mid-shard, before committing
            os._exit(1)
        faults.gate("process")  # test hook: wait for a test to release or kill this process
        data = parquet_bytes(rows, keep, parsed_types(self.spec.output.parsed_columns,
                                                      self.spec.generation.response_format))
        created = self.storage.put_if_absent(shard.part, data)
        if not created:  # another attempt committed it first: that part stands, ours is dropped
            data = self.storage.read_bytes(shard.part)
        if self.spec.output.format == "openai_batch":
            commit_jsonl(self.storage, shard.part, data, self.spec.models.target.path)
        return {
            **part_entry(data), "shard": shard.index, "part": shard.part, "created": created, "bytes": len(data),
            "control": shard.control, "device": self.device_name, "devices": self.devices,
            "wall_s": time.perf_counter() - t0,
            "worker": self.name, "node": self.node,
            "step_path": self.engine.step_path,
            "peak_gpu_bytes": self._peak_gpu_bytes(),
        }

    def control_engine(self):
        """The engine of control shards: the same pair and batch size, no speculation."""
        if self._control is None:
            from specdec.engine import SpecEngine

            self._control = SpecEngine(self.pair, self.spec.generation, SpecConfig(method="none"),
                                       batch_size=self.engine.batch_size,
                                       gpu_memory_fraction=self.spec.resources.gpu_memory_fraction,
                                       step_fault=faults.step_fault(), **self.spec.resources.engine_settings())
        return self._control

    def generate(self, engine, prompts: list[list[int]], keys: list[str],
                 params: list[SamplingParams]) -> list[SampleResult]:
        """engine.generate, in smaller batches where they run out of memory (workers/rows.py)."""
        return generate_fitting(engine, prompts, keys, params, self.spec.input.truncate, self._tick, free_memory)

    def _peak_gpu_bytes(self) -> int | None:
        import torch

        if self.engine.device.type != "cuda":
            return None
        return torch.cuda.max_memory_allocated(self.engine.device)


@contextlib.contextmanager
def _group_guard():
    """A tensor-parallel call that failed leaves the ranks out of step: end this process, so that Ray restarts
    the worker with a fresh group and retries its shard (workers/group.py)."""
    from specdec.exec.tp import GroupBroken

    try:
        yield
    except GroupBroken as exc:
        print(f"specbatch: {exc}; restarting the worker's whole group", file=sys.stderr, flush=True)
        os._exit(1)


def _node_id() -> str | None:
    """The Ray node this process runs on (None outside Ray)."""
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None

