"""Input rows to output rows: the one pipeline of a worker's shard and of an in-process Generator's call
(specbatch/generator.py), so that both give the same tokens.

Each record's prompt and settings (a bad row becomes an error row, "reason: detail"), one engine call for the
rows that can run (out of memory: smaller batches, then halves, `generate_fitting`), then each sample's output
columns (`outputs.output_row`), with the row's warnings and the kept input columns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from specdec.config import SampleResult, SamplingParams
from specdec.exec.memory import out_of_memory

from . import faults
from .inputs import InputSpec, Record, render_prompt
from .outputs import output_row
from .requests import interpret, settings

Generate = Callable[[list[list[int]], list[str], list[SamplingParams]], list[SampleResult]]


def generate_rows(records: Sequence[Record], inp: InputSpec, generation: SamplingParams, tokenizer,
                  generate: Generate, keep: Sequence[str] = (), control: bool = False,
                  views: Sequence[InputSpec | None] | None = None) -> tuple[list[dict], list[int]]:
    """(output rows, the record each came from): a record's `n` samples are consecutive rows; one that cannot
    run is one error row. `generate(prompts, ids, params)` runs the engine; `views[i]`, where given, is the
    InputSpec record i is read by instead of `inp`."""
    results: dict[int, list[SampleResult]] = {}  # per record: its samples (one error row if it cannot run)
    prompts: dict[int, list[int]] = {}
    params: dict[int, SamplingParams] = {}
    warnings: dict[int, str] = {}
    chat: dict[int, bool] = {}
    for i, rec in enumerate(records):
        if rec.error:
            results[i] = [SampleResult.failed(rec.id, 0, rec.error)]
            continue
        try:  # a bad row is that row's error, never the job's
            fields, view, overrides, unknown, chat[i] = interpret(rec.row, (views and views[i]) or inp)
            if unknown:
                warnings[i] = f"ignored request keys: {', '.join(unknown)}"
            params[i] = settings(generation, overrides)
            prompts[i] = render_prompt(fields, tokenizer, view)
        except ValueError as exc:
            results[i] = [SampleResult.failed(rec.id, 0, str(exc))]
    todo = list(prompts)
    samples = iter(generate([prompts[i] for i in todo], [records[i].id for i in todo], [params[i] for i in todo]))
    for i in todo:
        results[i] = [next(samples) for _ in range(params[i].n)]
        if all(r.error for r in results[i]):  # the prompt could not run: one error row, not n
            results[i] = results[i][:1]
    rows, sources = [], []
    for i, rec in enumerate(records):
        row = rec.row if rec.row is not None else {}
        for r in results[i]:
            rows.append({"id": rec.id, **output_row(r, tokenizer, params.get(i)), "warnings": warnings.get(i),
                         "chat": chat.get(i), "control": control, **{k: row.get(k) for k in keep}})
            sources.append(i)
    return rows, sources


def generate_fitting(engine, prompts: list[list[int]], keys: list[str], params: list[SamplingParams],
                     truncate: str = "error", on_round=None, on_oom: Callable[[], None] | None = None
                     ) -> list[SampleResult]:
    """engine.generate; out of memory, the batch is retried with half as many rows at a time (the engine keeps
    the smaller size), then the prompts in halves, and only a prompt that does not fit alone fails, as an
    error row. In a tensor-parallel group, whose ranks are then out of step, the error propagates (its worker
    restarts with half the batch size, workers/group.py). `on_oom` runs before each retry (free memory)."""
    try:
        inject = faults.oom_rows()  # test hook: batches above N rows run out of memory
        if inject and min(engine.batch_size, len(prompts)) > inject:
            raise RuntimeError(f"CUDA out of memory (injected: more than {inject} rows)")
        return engine.generate(prompts, keys, truncate=truncate, on_round=on_round, params=params)
    except Exception as exc:
        from specdec.exec.tp import GroupBroken

        if isinstance(exc, GroupBroken) and out_of_memory(exc):  # the group restarts, its batches halved
            from .group import note_oom

            note_oom()
        if isinstance(exc, GroupBroken) or not out_of_memory(exc):
            raise
    if on_oom is not None:
        on_oom()
    again = lambda p, k, s: generate_fitting(engine, p, k, s, truncate, on_round, on_oom)  # noqa: E731
    if engine.batch_size > 1 and len(prompts) > 1:
        engine.batch_size = max(1, min(engine.batch_size, len(prompts)) // 2)
        return again(prompts, keys, params)
    if len(prompts) > 1:
        mid = len(prompts) // 2
        return again(prompts[:mid], keys[:mid], params[:mid]) + again(prompts[mid:], keys[mid:], params[mid:])
    return [SampleResult.failed(keys[0], len(prompts[0]), "out_of_memory: the row does not fit alone", s)
            for s in range(params[0].n)]


def free_memory() -> None:
    """Collect garbage and return the CUDA allocator's cached blocks (after an out-of-memory error)."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
