"""The engine: generation over a model pair, with speculative decoding in ragged, continuous batches.

One `SpecEngine` per model pair. `generate(prompts, keys)` runs continuous batching over any number
of token-id prompts: up to `batch_size` rows are active at once; a finished row leaves (swap-remove:
the last active row moves into its slot) and a waiting prompt is prefilled into the free slot, so
finished rows stop costing compute and the batch stays full.

Built once per engine: the verification rule (specdec/verify.py), the draft-length policy
(specdec/policies/, which keeps what it learns across calls) and the models' runners. Each round
(specdec/rounds.py) drafts, verifies in one target forward and accepts; the prompt's last token is
the first pending token, so every emitted token comes from a round and `generated_tokens <=
accepted_tokens + rounds` holds exactly; `method: none` is the same loop with k = 0.

The host keeps what it already knows (row lengths, draft lengths, the policy's K) and a round reads
the device back once, at its end: no forward, draft step or policy waits on the GPU mid-round, except
the draft steps of a policy that stops rows on the draft's own outputs (`LengthPolicy.stopper`). The
models' KV caches belong to the engine and outlive `generate()` calls, so the CUDA graphs captured on
them do too (specdec/runner.py); on a GPU their size comes from a memory plan (specdec/memory.py).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import torch

from . import memory, profiler
from .batch import Batch
from .cache import RaggedKVCache
from .config import SampleResult, SamplingParams, SpecConfig
from .costmodel import CostModel, Profile, pow2_at_least
from .models import ModelPair
from .policies import LengthPolicy, PolicyEnv, make_policy, policy_class
from .proposers.base import Proposer
from .proposers.draft_model import DraftModelProposer
from .proposers.prompt_lookup import PromptLookupProposer
from .grammar import Constraints, GrammarError, Grammars
from .rounds import Request, Rounds
from .runner import ModelRunner
from .stops import StopStrings
from .tp import TPRunner
from .verify import make_rule
from .widths import VerifyWidths


class SpecEngine:
    """Generation over a model pair. `fast_path=False` runs every model through transformers' own modules
    (no lean Llama forward, no CUDA graphs); `step_graphs` overrides where steps replay captured graphs
    (default: on a GPU; True on a CPU runs the same padded static steps eagerly, for tests);
    `gpu_memory_fraction` bounds what the KV caches may take on a GPU (specdec/memory.py)."""

    def __init__(self, pair: ModelPair, sampling_params: SamplingParams, spec: SpecConfig, batch_size: int = 16,
                 fast_path: bool = True, gpu_memory_fraction: float = 0.9, step_graphs: bool | None = None,
                 profile: Profile | None = None):
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        if spec.method == "draft_model" and pair.draft is None:
            raise ValueError("speculation.method draft_model needs models.draft")
        self.pair = pair
        self.target = pair.target
        self.vocab_size = pair.vocab_size
        self.sampling = sampling_params
        self.spec = spec
        self.batch_size = batch_size
        self.device = pair.device
        self.stop_ids = frozenset(sampling_params.stop_token_ids) | frozenset(pair.stop_token_ids)
        self.stop_strings = StopStrings(pair.tokenizer)
        self.grammars = Grammars(pair.tokenizer, pair.vocab_size, tuple(sorted(self.stop_ids)))  # output formats
        models = [pair.target] + ([pair.draft] if spec.method == "draft_model" else [])
        self.max_positions = min(getattr(m.config, "max_position_embeddings", 1 << 30) for m in models)
        self.rule = make_rule(spec)
        self.policy: LengthPolicy | None = None  # built on first need (goodput's after its costs are measured)
        self.clock = time.perf_counter  # what rounds are timed by (a test may drive a fake one)
        self.fast_path = fast_path
        self.step_graphs = step_graphs
        self.gpu_memory_fraction = gpu_memory_fraction
        self._runners: dict[str, ModelRunner] = {}
        self.plan_check()
        pad = spec.verify_padding and spec.method != "none"
        self.widths = VerifyWidths(spec.max_draft_tokens + 1) if pad else None  # measured verify widths
        self.needs_costs = policy_class(spec.draft_length).needs_costs and spec.method != "none"
        self.profile = profile  # measured costs (specdec/costmodel.py); measured on first need if None
        self.profile_s = 0.0  # seconds spent measuring it

    @torch.inference_mode()
    def measure_costs(self) -> LengthPolicy:
        """The engine's length policy, built once. One that plans from costs (goodput) gets its cost model: from
        the profile given to the engine, or one measured now on synthetic rows (specdec/profiler.py; seconds,
        once per engine: a job's worker pays it when it loads its models). generate() calls it."""
        if self.policy is not None:
            return self.policy
        spec = self.spec if self.spec.method != "none" else self.spec.model_copy(update={"draft_length": "fixed"})
        env = PolicyEnv(self.device, row_tokens=self.sampling.max_new_tokens)
        if self.needs_costs:
            t0 = time.perf_counter()
            if self.profile is None:
                self.profile = profiler.measure(self)
                self.profile_s = time.perf_counter() - t0
            env.costs = CostModel(self.profile, VerifyWidths.max_pad if self.widths else 0)
        self.policy = make_policy(spec, env)
        return self.policy

    def _models(self) -> dict[str, torch.nn.Module]:
        models = {"target": self.target}
        if self.spec.method == "draft_model":
            models["draft"] = self.pair.draft
        return models

    def output_head(self, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The output head of a model, the draft's cut to `draft_vocab` rows (SpecConfig.draft_vocab)."""
        head = self._models()[name].get_output_embeddings()
        rows = head.weight.shape[0] if name == "target" else min(self.spec.draft_vocab or self.vocab_size,
                                                                  self.vocab_size)
        bias = getattr(head, "bias", None)
        return head.weight[:rows], bias[:rows] if bias is not None else None

    def memory_plan(self, rows: int) -> memory.MemoryPlan | None:
        """The KV-cache memory plan for `rows` rows on a GPU (None on CPU), counting the engine's current
        caches as free (a new allocation replaces them)."""
        freed = sum(r.cache.nbytes() for r in self._runners.values())
        return memory.plan(self.device, list(self._models().values()), self.gpu_memory_fraction, rows,
                           self.spec.max_nodes + 1, self.vocab_size, freed)

    def row_tokens(self, prompt_tokens: int, max_new: int | None = None) -> int:
        """Cache slots a row of this prompt length needs (its output and the draft's slack included)."""
        return prompt_tokens + (max_new or self.sampling.max_new_tokens) + self.spec.max_nodes + 2

    def plan_check(self) -> None:
        """Refuse now what could never run on a GPU: one row of a one-token prompt plus max_new_tokens."""
        plan = self.memory_plan(1)
        if plan is not None:
            plan.rows(self.row_tokens(1), 1)

    def runner(self, name: str, rows: int, max_len: int) -> ModelRunner:
        """The runner of model `name` over a cache of at least `rows` rows and `max_len` slots. The caches
        grow (all models' together, their graphs dropped) and never shrink: a job's worker ends up
        with one size and reuses its captured steps from shard to shard."""
        have = self._runners.get(name)
        if have is None or have.cache.rows < rows or have.cache.max_len < max_len:
            self._allocate(rows, max_len)
        return self._runners[name]

    def _allocate(self, rows: int, max_len: int) -> None:
        old = next(iter(self._runners.values()), None)
        if old is not None:
            rows, max_len = max(rows, old.cache.rows), max(max_len, old.cache.max_len)
        self._runners.clear()
        # room to grow: a power of two of slots (within the models' positions, plus the draft's slack), and one
        # more, so that no attention window (a power of two, specdec/runner.py) spans the whole buffer
        max_len = max(max_len, min(pow2_at_least(max_len), self.max_positions + self.spec.max_nodes + 2)) + 1
        for name, model in self._models().items():
            if name == "target" and self.pair.tp is not None:  # a tensor-parallel target: every rank allocates
                self._runners[name] = TPRunner(self.pair.tp, rows, max_len, key=id(self))
                continue
            cache = RaggedKVCache(model, rows, max_len)
            self._runners[name] = ModelRunner(model, cache, *self.output_head(name), lean=self.fast_path,
                                              graphs=self.step_graphs)

    def _batch_rows(self, max_len: int, plan: memory.MemoryPlan | None) -> int:
        """Rows a batch of rows up to max_len slots may have: batch_size, or fewer where the GPU's memory
        plan allows fewer (the current caches, if large enough, are kept as they are)."""
        have = next(iter(self._runners.values()), None)
        if plan is None or (have is not None and have.cache.rows >= self.batch_size and have.cache.max_len >= max_len):
            return self.batch_size
        return plan.rows(max_len, self.batch_size)

    @property
    def step_path(self) -> str:
        """How the target's steps run: 'graphs', 'lean' or 'generic' (specdec/runner.py); '+eager-fallback' when
        some shapes of any model fell back from the fast path."""
        runner = self._runners.get("target")
        if runner is not None:
            fell = any(getattr(r, "eager", None) for r in self._runners.values())
            return runner.path.removesuffix("+eager-fallback") + ("+eager-fallback" if fell else "")
        if self.pair.tp is not None:
            return f"lean-tp{self.pair.tp.group.world}"
        from . import llama
        lean = self.fast_path and llama.unsupported(self.target) is None
        return ("graphs" if self.device.type == "cuda" else "lean") if lean else "generic"

    def new_batch(self, rows: int, max_len: int, policy: LengthPolicy) -> Batch:
        """An empty batch of `rows` slots of `max_len` tokens, with its proposer, and `policy`'s per-row state."""
        batch = Batch(self.runner("target", rows, max_len), rows, max_len, self.vocab_size, self.sampling)
        if self.spec.method == "draft_model":
            raw = self.rule.name == "fuzzy"  # FSD compares the models' raw distributions
            batch.proposer = DraftModelProposer(batch, self.runner("draft", rows, max_len), policy, raw)
        elif self.spec.method == "prompt_lookup":
            batch.proposer = PromptLookupProposer(batch, self.spec.prompt_lookup)
        else:
            batch.proposer = Proposer(batch)  # method none: never drafts
        policy.attach(batch.slots)
        return batch

    def max_prompt_tokens(self, plan: memory.MemoryPlan | None, max_new: int | None = None) -> int:
        """The longest prompt a row of `max_new` new tokens can take: the models' positions, and the GPU
        memory plan's slots."""
        max_new = max_new or self.sampling.max_new_tokens
        room = self.max_positions - max_new
        if plan is not None:
            room = min(room, plan.max_row_tokens() - self.row_tokens(0, max_new))
        return room

    def _check_prompt(self, prompt: list[int], room: int, truncate: str,
                      max_new: int) -> tuple[list[int], str | None]:
        """The prompt to run (cut to its last `room` tokens if `truncate` is "left"), or why it cannot run."""
        if len(prompt) == 0:
            return prompt, "empty_prompt: the prompt has no tokens"
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            return prompt, f"token_out_of_range: a token id is outside [0, {self.vocab_size})"
        if len(prompt) > room:
            if truncate == "left" and room > 0:
                return prompt[-room:], None
            return prompt, (f"prompt_too_long: {len(prompt)} tokens + max_new_tokens {max_new}"
                            f" exceed the {room + max_new} positions a row can have (the "
                            "models' context, or the GPU memory plan); input.truncate: left keeps the last tokens")
        return prompt, None

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], keys: list | None = None, truncate: str = "error",
                 on_round: Callable[[int], None] | None = None,
                 params: list[SamplingParams | None] | None = None) -> list[SampleResult]:
        """Generate for every prompt; results in input order, a prompt's `n` samples one after another (one
        result per prompt when n is 1). A prompt that cannot run becomes an error result ("reason: detail") per
        sample; `truncate="left"` cuts a prompt too long for a row to its last tokens instead. `on_round(tokens)`
        is called after every round with the tokens it emitted (progress). `params`: a prompt's own settings
        (None: the engine's); rows with different settings share batches."""
        keys = list(range(len(prompts))) if keys is None else list(keys)
        if len(keys) != len(prompts):
            raise ValueError("keys and prompts differ in length")
        params = [p or self.sampling for p in (params or [None] * len(prompts))]
        if len(params) != len(prompts):
            raise ValueError("params and prompts differ in length")
        if any(p.stop for p in params) and self.pair.tokenizer is None:
            raise ValueError("stop strings need the target's tokenizer")
        requests, results, todo = [], [], []
        plan = self.memory_plan(self.batch_size)
        for i, (p, key, sp) in enumerate(zip(prompts, keys, params)):
            p, reason = self._check_prompt([int(t) for t in p], self.max_prompt_tokens(plan, sp.max_new_tokens),
                                           truncate, sp.max_new_tokens)
            if reason is None and sp.grammar is not None:
                reason = self._check_format(sp)
            for sample in range(sp.n):
                results.append(SampleResult.failed(key, len(p), reason, sample) if reason else None)
                requests.append(Request(p, key, sample, sp, i))
                if not reason:
                    todo.append(len(requests) - 1)
        if todo:
            policy = self.measure_costs()
            # longest first: similar lengths run together and the long tail does not trail at the end; a prompt's
            # samples stay together, so that they join together and share its prefill
            todo.sort(key=lambda i: (-len(requests[i].prompt), requests[i].group))
            max_len = max(self.row_tokens(len(requests[i].prompt), requests[i].sp.max_new_tokens) for i in todo)
            batch = self.new_batch(min(self._batch_rows(max_len, plan), len(todo)), max_len, policy)
            if any(requests[i].sp.grammar is not None for i in todo):
                batch.constraints = Constraints(batch.capacity, self.vocab_size, self.device, self.stop_ids)
            Rounds(self, batch, policy, requests, results, on_round).run(deque(todo))
        return results  # type: ignore[return-value]

    def _check_format(self, sp: SamplingParams) -> str | None:
        """Why a row's output format cannot run ("bad_response_format: ..."), or None."""
        try:
            self.grammars.matcher(sp.grammar)
        except GrammarError as exc:
            return str(exc)
        return None
