"""A Ray Data stage: generation as one step of a Dataset pipeline (the `data` extra: `pip install specbatch[data]`).

    ds = ray.data.read_json("prompts.jsonl")
    ds = ds.map_batches(SpecbatchStage, fn_constructor_kwargs={"config": cfg}, concurrency=(1, 4),
                        num_gpus=1, batch_size=64, batch_format="pyarrow")
    ds.write_parquet("out/")

Each actor of the pool builds one `Generator` from `config` (a dict or a YAML path, as a Generator takes it) and
keeps it; each batch's rows are read as a job reads its input rows (`input.prompt_column`, `messages_column`,
`sampling_columns`, ...). A batch comes back with the output columns of a job's Parquet parts first (a row's
`n` samples are consecutive rows), then every input column as it was (`input.id_column` `id` becomes the output
`id`, its string); an input column named as another output column is refused, naming it. A bad row is an
error row, as in jobs. Without `specbatch run`'s bookkeeping: no exactly-once parts, manifest or resume.
"""

from __future__ import annotations

import os

import pyarrow as pa

from workers.outputs import output_table, parsed_types

from .generator import Generator, GeneratorSpec


class SpecbatchStage:
    """A callable class for `Dataset.map_batches`: one Generator per actor, loaded once."""

    def __init__(self, config: dict | str | os.PathLike | GeneratorSpec | None = None, **sections):
        self.generator = Generator(config, **sections)

    def __call__(self, batch) -> pa.Table:
        """The batch's output rows with its input columns (a pyarrow Table, a pandas DataFrame or a dict of
        numpy arrays in; a pyarrow Table out)."""
        table = _arrow(batch)
        spec = self.generator.spec
        rows, sources = self.generator.rows(table.to_pylist())
        out = output_table(rows, [], parsed_types(spec.output.parsed_columns, spec.generation.response_format))
        replaced = {"id"} if spec.input.key_column == "id" else set()
        clash = [c for c in table.column_names if c in out.column_names and c not in replaced]
        if clash:
            raise ValueError(f"input columns {clash} are output columns of SpecbatchStage: rename them first "
                             "(Dataset.rename_columns)")
        kept = table.take(pa.array(sources, type=pa.int64()))
        for name in kept.column_names:
            if name not in replaced:
                out = out.append_column(kept.schema.field(name), kept.column(name))
        return out


def _arrow(batch) -> pa.Table:
    if isinstance(batch, pa.Table):
        return batch
    from ray.data.block import BlockAccessor

    return BlockAccessor.for_block(BlockAccessor.batch_to_block(batch)).to_arrow()
