"""`Generator`: text in, rows out, in this process (no Ray), on CPU or one GPU.

Built from a job config's sections (`models`, `generation`, `speculation`, `resources`; `input` for how a row
dict is read, `output` for `keep_columns` and `parsed_columns`), given as a dict, a YAML path (a job's config
works: its `name`, `input.path` and `output.path` are not used), keyword arguments, or a config with keyword
sections merged over it. It loads the pair and measures goodput's costs once; `generate` then runs the job
worker's own row pipeline (workers/rows.py) over the prompts it is given, so a row's tokens are those
`specbatch run` writes for it.
"""

from __future__ import annotations

import copy
import difflib
import os
from collections.abc import Iterable

from pydantic import Field, ValidationError, model_validator

from jobs.spec import ConfigError, check_sections, format_errors, read_config
from specdec.config import Config, ModelsConfig, SamplingParams, SpecConfig
from workers.inputs import InputSpec, Record, usable_id
from workers.outputs import OutputSpec, output_table, parsed_types
from workers.requests import SETTINGS, settings
from workers.rows import free_memory, generate_fitting, generate_rows
from workers.spec import ResourcesSpec, models_used


class RowsSpec(InputSpec):
    """A job's `input` section as a Generator reads the rows it is given: no file, and every setting a row
    dict names is that row's own (`sampling_columns`)."""

    path: str | None = Field(None, description="a job's input file; a Generator does not read it")
    sampling_columns: list[str] = Field(list(SETTINGS), description="the keys of a row dict holding its own "
                                        "settings (default: every setting)")


class ColumnsSpec(OutputSpec):
    """A job's `output` section as a Generator uses it: `keep_columns` and `parsed_columns`, no folder."""

    path: str | None = Field(None, description="a job's output folder; a Generator writes none")


class GeneratorSpec(Config):
    """What a Generator runs by: the sections of a job config that say how rows are generated."""

    name: str | None = Field(None, description="a job's name; not used")
    input: RowsSpec = Field(default_factory=RowsSpec, description="how a row dict becomes a prompt")
    output: ColumnsSpec = Field(default_factory=ColumnsSpec, description="columns added to the output rows")
    models: ModelsConfig = Field(description="the pair")
    generation: SamplingParams = Field(default_factory=SamplingParams, description="token selection")
    speculation: SpecConfig = Field(default_factory=SpecConfig, description="drafting and verification")
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec, description="batching and the device")

    @model_validator(mode="after")
    def _one_process(self):
        check_sections(self)
        if self.models.target.tensor_parallel > 1:
            raise ValueError("models.target.tensor_parallel: a Generator runs the target in one process; "
                             "split it over GPUs with `specbatch run`")
        if self.speculation.control_fraction:
            raise ValueError("speculation.control_fraction: control shards are a job's; a Generator has no shards")
        return self


def generator_spec(config: dict | str | os.PathLike | GeneratorSpec | None = None, **sections) -> GeneratorSpec:
    """The validated spec of a config (a dict, a YAML path, or a spec) with keyword `sections` merged over it
    (a dict section key by key, anything else replacing); ConfigError naming the key that is wrong."""
    if isinstance(config, GeneratorSpec) and not sections:
        return config
    if isinstance(config, GeneratorSpec):
        data = config.model_dump(mode="json", by_alias=True)
    elif isinstance(config, (str, os.PathLike)):
        data = read_config(os.fspath(config))
    elif config is None or isinstance(config, dict):
        data = copy.deepcopy(config or {})
    else:
        raise ConfigError(f"config: a dict, a YAML path or a GeneratorSpec, not a {type(config).__name__}")
    for key, value in sections.items():
        data[key] = _merged(data.get(key), value)
    try:
        return GeneratorSpec.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"config error: {format_errors(exc, GeneratorSpec)}") from None


def _merged(base, over):
    if hasattr(over, "model_dump"):  # a config model given whole, e.g. SamplingParams(...)
        over = over.model_dump(mode="json", by_alias=True, exclude_unset=True)
    if isinstance(base, dict) and isinstance(over, dict):
        return {**base, **{k: _merged(base.get(k), v) for k, v in over.items()}}
    return copy.deepcopy(over)


class Generator:
    """A model pair and its engine, loaded once, in this process; `generate` turns prompts into output rows.

        gen = Generator("configs/demo.yaml", generation={"max_new_tokens": 32})
        rows = gen.generate(["Name three colors.", [{"role": "user", "content": "Hi!"}],
                             {"id": "q3", "prompt": "Pick one.", "n": 2, "temperature": 0.7}])

    `resources.batch_size` rows decode together and `gpu_memory_fraction` bounds the GPU's share; with
    `gpus_per_worker` null the engine runs on the GPU where torch sees one, else on the CPU."""

    def __init__(self, config: dict | str | os.PathLike | GeneratorSpec | None = None, /, **sections):
        import torch

        from specdec.engine import SpecEngine
        from specdec.exec.models import load_pair
        from workers.fetch import ModelPathError, cache_dir, localize

        self.spec = spec = generator_spec(config, **sections)
        gpus = spec.resources.gpus_per_worker
        if gpus and not torch.cuda.is_available():
            raise ConfigError(f"resources.gpus_per_worker: {gpus:g}, but torch sees no CUDA device here")
        device = "cuda" if (gpus is None or gpus > 0) and torch.cuda.is_available() else "cpu"
        try:
            used = {key: localize(src, key) for key, src in models_used(spec.models, spec.speculation).items()}
        except ModelPathError as exc:
            raise ConfigError(str(exc)) from None
        self.pair = load_pair(used["models.target.path"], used.get("models.draft.path"), device,
                              cache=str(cache_dir()))  # a GGUF model dequantized once, kept in the cache folder
        self.tokenizer = self.pair.tokenizer
        self.engine = SpecEngine(self.pair, spec.generation, spec.speculation, batch_size=spec.resources.batch_size,
                                 gpu_memory_fraction=spec.resources.gpu_memory_fraction,
                                 profile_cache=str(cache_dir() / "profiles"), **spec.resources.engine_settings())
        self.engine.measure_costs()  # goodput's cost profile: once per machine and settings, as a job's worker's

    def generate(self, prompts: str | dict | Iterable[str | list | dict], **settings) -> list[dict]:
        """One dict per output row, with the columns of a job's Parquet output (`id`, `completion`, `token_ids`,
        `finish_reason`, `error`, the acceptance statistics, `logprobs`, `parsed`, ..., then `output.keep_columns`
        and `output.parsed_columns`), in input order, a prompt's `n` samples one after another.

        A prompt is a string (the text of `input.prompt_column`: raw, or a user turn with `input.chat_template`),
        a list of `{role, content}` messages (rendered with the target's chat template), or a row dict read as a
        job reads an input row, its setting keys (`max_new_tokens`, `temperature`, `n`, `response_format`, ...)
        its own (its `messages`, where the config names no `input.messages_column` and the row has no prompt, are
        its chat). `settings` apply to every row (a row's own win). A row's id is its `input.id_column` value,
        else its position in `prompts`; with `generation.seed` it seeds a sampled row. A bad row is an error
        row (`finish_reason: error`, `error`: "reason: detail"); a bad `settings` key raises ConfigError."""
        rows, _ = self.rows(prompts, **settings)
        keep = self.spec.output.keep_columns
        return output_table(rows, keep, parsed_types(self.spec.output.parsed_columns,
                                                     self.spec.generation.response_format)).to_pylist()

    def rows(self, prompts, **call) -> tuple[list[dict], list[int]]:
        """(output rows as the pipeline gives them, the index in `prompts` each came from)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        unknown = [k for k in call if k not in SETTINGS]
        if unknown:
            near = difflib.get_close_matches(unknown[0], SETTINGS, n=1)
            raise ConfigError(f"generate: {unknown[0]!r} is not a setting"
                              + (f" (did you mean {near[0]}?)" if near else f"; settings: {', '.join(SETTINGS)}"))
        try:
            generation = settings(self.spec.generation, call)
        except ValueError as exc:
            raise ConfigError(f"generate: {str(exc).split(': ', 1)[1]}") from None
        inp = self.spec.input
        records, views = [], []
        for i, item in enumerate(prompts):
            record, view = _record(item, i, inp)
            records.append(record)
            views.append(view)
        return generate_rows(
            records, inp, generation, self.tokenizer,
            lambda p, k, s: generate_fitting(self.engine, p, k, s, inp.truncate, on_oom=free_memory),
            self.spec.output.keep_columns, views=views)


def _record(item, index: int, inp: InputSpec) -> tuple[Record, InputSpec | None]:
    """A prompt of `generate` as an input record, and the InputSpec it is read by (None: `inp`)."""
    text_view = dict(format="rows", prompt_template=None, messages_column=None, prompt_column="prompt")
    chat_view = inp.model_copy(update={**text_view, "messages_column": "messages"})
    if isinstance(item, str):
        return Record(str(index), {"prompt": item}), inp.model_copy(update=text_view)
    if isinstance(item, list):
        return Record(str(index), {"messages": item}), chat_view
    if isinstance(item, dict):
        record = Record(usable_id(item.get(inp.key_column)) or str(index), item)
        plain = inp.format == "rows" and not (inp.messages_column or inp.prompt_template)
        return record, chat_view if plain and "messages" in item and inp.prompt_column not in item else None
    return Record(str(index), {}, f"not_an_object: prompt {index} is a {type(item).__name__}, not a string, a "
                                  "message list or a row dict"), None
