"""The engine: generation over a model pair, with speculative decoding in ragged, continuous batches.

One `SpecEngine` per model pair. `generate(prompts, keys)` runs continuous batching over any number
of token-id prompts: up to `batch_size` rows are active at once; a finished row leaves (swap-remove:
the last active row moves into its slot) and a waiting prompt is prefilled into the free slot, so
finished rows stop costing compute and the batch stays full.

Built once per engine, from the method's entry (specdec/choices.py): the round's context (`RoundContext`: the
verification rule, verify widths, the clock, stop sets, output formats, the draft limit), the draft-length policy
(specdec/plan/policies/, which keeps what it learns across calls) and the models' runners. Each round
(specdec/sched/rounds.py) drafts, verifies in one target forward and accepts; the prompt's last token is
the first pending token, so every emitted token comes from a round and `generated_tokens <=
accepted_tokens + rounds` holds exactly; `method: none` is the same loop with k = 0.

The host keeps what it already knows (row lengths, draft lengths, the policy's K) and a round reads
the device back once, at its end: no forward, draft step or policy waits on the GPU mid-round, except
the draft steps of a policy that stops rows on the draft's own outputs (`LengthPolicy.stopper`), where no round is
in flight or on a CPU. The models' KV caches belong to the engine and outlive `generate()` calls, so the CUDA graphs
captured on them do too (specdec/exec/runner.py); on a GPU their size comes from a memory plan (specdec/exec/memory.py).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace

import torch

from .choices import METHODS, POLICIES
from .config import SampleResult, SamplingParams, SpecConfig
from .exec import llama, memory
from .exec.cache import BLOCK, PagedKVCache, RaggedKVCache, model_kv_bytes
from .exec.inputs import Staging
from .exec.models import ModelPair
from .exec.prefill import Prefiller
from .exec.prefix import Prefixes, admission_order
from .exec.graphs import compiled_flex
from .exec.runner import ModelRunner
from .exec.tp import TPRunner
from .plan import profiler
from .plan.costmodel import CostModel, Profile, VerifyWidths
from .plan.policies import FixedLength, LengthPolicy, NoDrafts, PolicyEnv
from .sched.batch import Batch
from .sched.rounds import Request, RoundContext, Rounds, SyntheticRounds
from .sched.slots import Slots
from .sched.stops import StopStrings
from .spec.grammar import Constraints, GrammarError, Grammars
from .spec.verify import CoupledRule


# rows whose first this many prefix blocks are the same are admitted together (`SpecEngine.admission_order`)
CLUSTER_BLOCKS = 8


class SpecEngine:
    """Generation over a model pair. `fast_path=False` runs every model through transformers' own modules
    (no lean Llama forward, no CUDA graphs); `step_graphs` overrides where steps replay captured graphs
    (default: on a GPU; True on a CPU runs the same padded static steps eagerly, for tests);
    `gpu_memory_fraction` bounds what the KV caches may take on a GPU (specdec/exec/memory.py); `profile`: measured
    costs to plan from instead of measuring them (specdec/plan/costmodel.py); `clock`: what rounds are timed by (a test
    may drive a fake one); `profile_cache`: a folder where a measured profile is kept, one per hardware, models'
    shapes and settings it depends on (`profile_depends`), so that a later engine of the same reads it instead of
    measuring (None: measured by every engine). `prefix_caching` keeps up to `prefix_cache_bytes` of prompt
    prefixes' keys and values for later rows (specdec/exec/prefix.py; on a GPU within what the memory plan leaves
    once a batch is sized).
    `prefill_chunk`: most prompt tokens (rows x tokens) one prefill forward takes (None: a whole admission's).
    `kv_cache`: "dense" rows of the longest row's slots, or "paged": blocks a row reserves for the tokens it can come
    to hold (specdec/exec/cache.py; on a GPU the pool takes what the memory plan leaves once the rows are sized), less
    the whole prompt blocks it shares by reference (a prompt's samples; prefixes the store keeps, pinned in the pool);
    `paged_attention`: how a paged cache's captured steps attend, over its rows' blocks gathered ("gather") or with
    FlexAttention over the pool in place ("flex": compiled per model and step shape; `_FlexView`); `kv_block`: slots per
    block of a paged pool (and of the prefix store's blocks: a multiple of 16; FlexAttention tiles keys by it).
    `join_prefills`: rows that join while others decode end their prefill in the round's forward (False: in
    forwards of their own first; bench/join_speed.py compares). `overlap`: a plain round is queued on the device
    before the host reads the one before it back (specdec/sched/rounds.py; False: each round waits for the one
    before; bench/host_work.py compares). `capture_budget`: seconds a job may spend, before its rows join,
    capturing the steps it can meet (`capture_steps`; those left run padded to captured ones at first; None:
    `CAPTURE_BUDGET`). `step_fault`: a test's hook that fails the first fast step of a shape
    (specdec/exec/runner.py `ModelRunner`; workers/faults.py)."""

    CAPTURE_BUDGET = 20.0  # seconds a job captures steps before its rows join, by default (`capture_budget`)

    def __init__(self, pair: ModelPair, sampling_params: SamplingParams, spec: SpecConfig, batch_size: int = 16,
                 fast_path: bool = True, gpu_memory_fraction: float = 0.9, step_graphs: bool | None = None,
                 profile: Profile | None = None, clock: Callable[[], float] = time.perf_counter,
                 prefix_caching: bool = True, prefix_cache_bytes: int = 1 << 30, prefill_chunk: int | None = 2048,
                 kv_cache: str = "dense", join_prefills: bool = True, overlap: bool = True,
                 profile_cache: str | None = None, capture_budget: float | None = None,
                 paged_attention: str = "gather", kv_block: int = BLOCK,
                 step_fault: Callable[[tuple], str | None] | None = None):
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError("prefill_chunk must be at least 1 (or None: no chunks)")
        if kv_cache not in ("dense", "paged"):
            raise ValueError(f"kv_cache must be dense or paged, not {kv_cache!r}")
        if paged_attention not in ("gather", "flex"):
            raise ValueError(f"paged_attention must be gather or flex, not {paged_attention!r}")
        self.paged_attention = paged_attention
        if kv_block < BLOCK or kv_block % BLOCK:
            raise ValueError(f"kv_block must be a multiple of {BLOCK}, not {kv_block}")
        self.kv_block = kv_block if kv_cache == "paged" else BLOCK
        if kv_cache == "paged" and pair.tp is not None:
            raise ValueError("resources.kv_cache: paged does not run with a tensor-parallel target yet (use dense)")
        self.kv_cache = kv_cache
        self.prefill_chunk = prefill_chunk
        self.method = METHODS[spec.method]
        if self.method.draft_model and pair.draft is None:
            raise ValueError(f"speculation.method {spec.method} needs a pair with a draft model")
        self.pair = pair
        self.target = pair.target
        self.vocab_size = pair.vocab_size
        self.sampling = sampling_params
        self.spec = spec
        self.batch_size = batch_size
        self.device = pair.device
        self.max_positions = min(getattr(m.config, "max_position_embeddings", 1 << 30)
                                 for m in self._models().values())
        self.policy: LengthPolicy | None = None  # built on first need (goodput's after its costs are measured)
        self.fast_path = fast_path
        self.step_graphs = step_graphs
        self.gpu_memory_fraction = gpu_memory_fraction
        self.step_fault = step_fault
        self._runners: dict[str, ModelRunner] = {}
        self.prefix = Prefixes(prefix_cache_bytes, {
            name: model_kv_bytes(model) for name, model in self._models().items()
            if not (name == "target" and pair.tp is not None)}, self.kv_block) if prefix_caching else None
        max_draft = self.method.max_draft(spec)
        # steps wider than this run eagerly, so that the captured steps are few and planned (specdec/exec/memory.py)
        self.graph_width = max_draft + 1
        self.tree_width = spec.max_nodes + 1 if self.method.siblings(spec) else 0  # and token trees' (a root and nodes)
        self.device_memory = lambda: memory.device_memory(self.device)  # (free, total) bytes; None: not planned
        self.caches: memory.Caches | None = None  # the sizes of the models' caches (`hold` allocates them)
        self.need: memory.Need | None = None  # what the memory plan sized the last batch to (None: no plan)
        self.plan_check()
        rule = self.method.rule(spec)
        stop_ids = frozenset(sampling_params.stop_token_ids) | frozenset(pair.stop_token_ids)
        self.context = RoundContext(
            rule=CoupledRule(rule) if spec.sampling == "coupled" else rule,
            widths=VerifyWidths(max_draft + 1) if spec.verify_padding and max_draft else None,
            clock=clock, stop_ids=stop_ids, stop_strings=StopStrings(pair.tokenizer),
            grammars=Grammars(pair.tokenizer, pair.vocab_size, tuple(sorted(stop_ids))), max_draft=max_draft,
            join_prefills=join_prefills, overlap=overlap, staging=Staging(self.device))
        self.needs_costs = POLICIES[spec.draft_length].needs_costs and max_draft > 0
        self.profile = profile  # measured costs (specdec/plan/costmodel.py); measured on first need if None
        self.profile_s = 0.0  # seconds spent measuring it (or reading it from `profile_cache`)
        self.profile_cache = profile_cache
        self.profile_kept = False  # the profile came from `profile_cache`, kept by an earlier engine
        self.capture_budget = self.CAPTURE_BUDGET if capture_budget is None else capture_budget
        self.capture_s = 0.0  # seconds the last job spent capturing steps before its rows joined

    @torch.inference_mode()
    def measure_costs(self) -> LengthPolicy:
        """The engine's length policy, built once. One that plans from costs (goodput) gets its cost model: from
        the profile given to the engine, or one measured now on synthetic rows (specdec/plan/profiler.py; seconds,
        once per engine: a job's worker pays it when it loads its models). generate() calls it."""
        if self.policy is not None:
            return self.policy
        env = PolicyEnv(self.device, row_tokens=self.sampling.max_new_tokens,
                        siblings=self.method.siblings(self.spec))
        if self.needs_costs:
            if self.profile is None:
                t0 = time.perf_counter()
                self.profile, self.profile_kept = profiler.kept(self.profile_cache, self.profile_depends(),
                                                                self.measure_profile)
                self.profile_s = time.perf_counter() - t0
            env.costs = CostModel(self.profile, self.context.widths)
        self.policy = POLICIES[self.spec.draft_length].build(self.spec, env) if self.method.drafts else \
            NoDrafts(self.spec)
        return self.policy

    @torch.inference_mode()
    def measure_profile(self, every_width: bool = False) -> Profile:
        """The costs of this engine's rounds, measured now on synthetic rows of 64 tokens (specdec/plan/profiler.py);
        `every_width`: every verification width, not only those a length could win at."""
        policy = FixedLength(self.spec)  # drafts on demand: rows joining are prefilled in the draft
        batch = self.new_batch(self.batch_size, 64 + self.spec.max_nodes + 2, policy, prefixes=False)
        work = SyntheticRounds(self.context, batch, policy, self.sampling, self.method.draft_model, 64)
        return profiler.measure(work, self.batch_size, self.context.max_draft, self.method.draft_model,
                                self.method.siblings(self.spec), self.context.clock,
                                f"{profiler.hardware(self.device)}, {next(self.pair.target.parameters()).dtype}",
                                every_width=every_width)

    def profile_depends(self) -> dict:
        """What this engine's cost profile depends on (`profile_cache` keeps one per distinct value): the hardware,
        torch, the models' shapes and dtype, the batch size, the method's settings, the sampling settings rounds
        compute by, and the step path."""
        def shape(model) -> dict:
            return {k: v for k, v in model.config.to_dict().items()
                    if not k.startswith("_") and k not in ("transformers_version", "name_or_path")}

        sampling = self.sampling.model_dump(mode="json", exclude={"max_new_tokens", "seed", "stop", "stop_token_ids",
                                                                   "n"})
        return {"hardware": profiler.hardware(self.device), "torch": torch.__version__, "profile": 2,
                "dtype": str(next(self.pair.target.parameters()).dtype), "batch_size": self.batch_size,
                "models": {name: shape(m) for name, m in self._models().items()},
                "tp": None if self.pair.tp is None else self.pair.tp.group.world,
                "spec": self.spec.model_dump(mode="json"),
                "sampling": sampling, "steps": [self.fast_path, self.step_graphs, self.kv_cache, self.prefill_chunk,
                                                ModelRunner.compile_layers]}

    def _models(self) -> dict[str, torch.nn.Module]:
        """The models the method runs, by role."""
        return {"target": self.pair.target, **({"draft": self.pair.draft} if self.method.draft_model else {})}

    def output_head(self, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The output head of a model, the draft's cut to `draft_vocab` rows (SpecConfig.draft_vocab)."""
        head = self._models()[name].get_output_embeddings()
        rows = head.weight.shape[0] if name == "target" else min(self.spec.draft_vocab or self.vocab_size,
                                                                  self.vocab_size)
        bias = getattr(head, "bias", None)
        return head.weight[:rows], bias[:rows] if bias is not None else None

    def memory_plan(self) -> memory.MemoryPlan | None:
        """The GPU memory plan (None on CPU: `device_memory` gives no figures), counting the engine's current caches,
        captured steps and kept prefixes as free (a new allocation replaces them; prefixes yield to rows)."""
        figures = self.device_memory()
        if figures is None:
            return None
        free, total = figures
        freed = self.resident_bytes()
        roles = []
        for name, model in self._models().items():
            tp = name == "target" and self.pair.tp is not None
            lean = not tp and self.fast_path and llama.unsupported(model) is None
            graphs = lean and (self.step_graphs if self.step_graphs is not None else self.device.type == "cuda")
            vocab = self.vocab_size if tp else self.output_head(name)[0].shape[0]
            roles.append(memory.Role(name, memory.Shape.of(model, vocab), graphs))
        return memory.MemoryPlan(roles, self.gpu_memory_fraction, total, total - free - freed, self.graph_width,
                                 ModelRunner.min_kv_bucket, prompt_top_ids=self.method.prompt_top_ids(self.spec),
                                 tree_width=self.tree_width,
                                 additive_mask=self.device.type == "cuda", prefill_chunk=self.prefill_chunk,
                                 paged=self.kv_cache == "paged",
                                 flex=self.kv_cache == "paged" and self.paged_attention == "flex", block=self.kv_block)

    def resident_bytes(self) -> int:
        """Device bytes the engine holds between generate() calls: its caches, captured steps and kept prefixes."""
        graphs = (getattr(r, "graphs", None) for r in self._runners.values())
        return (sum(r.cache.nbytes() for r in self._runners.values()) + sum(g.nbytes() for g in graphs if g)
                + (self.prefix.device_bytes if self.prefix is not None else 0))

    def row_tokens(self, prompt_tokens: int, max_new: int | None = None) -> int:
        """Cache slots a row of this prompt length needs (its output and the draft's slack included)."""
        return prompt_tokens + (max_new or self.sampling.max_new_tokens) + self.spec.max_nodes + 2

    def alloc_len(self, slots: int) -> int:
        """Slots the engine allocates per row for rows of `slots` slots (`memory.alloc_len`)."""
        return memory.alloc_len(slots, self.max_positions)

    def plan_check(self) -> None:
        """Refuse now what could never run on a GPU: one row of a one-token prompt plus max_new_tokens."""
        plan = self.memory_plan()
        if plan is not None:
            slots = self.row_tokens(1)
            need = plan.need(1, self.alloc_len(slots), 1, slots, 1)
            if not plan.fits(need):
                raise plan.refuse(need, f"one row of a 1-token prompt + max_new_tokens {self.sampling.max_new_tokens}")

    def runner(self, name: str) -> ModelRunner | TPRunner:
        """The runner of model `name` over its current cache (`hold` sizes the caches)."""
        return self._runners[name]

    def hold(self, caches: memory.Caches, exact: bool = False) -> None:
        """The engine's one allocator: caches of every model that hold `caches` (rows, each row's slots, a paged
        pool's blocks): the current ones when they do, else caches grown to hold both (all models' together, their
        captured steps dropped); `exact`: caches of exactly these sizes (a memory plan's). The caches outlive
        generate() calls: a job's worker ends up with one size and reuses its captured steps from shard to shard."""
        if self.kv_cache != "paged":
            caches = replace(caches, blocks=0)
        if exact:
            if caches == self.caches:
                return
        elif self.caches is not None and self.caches.holds(caches):
            return
        else:
            caches = memory.grown(self.caches, caches, self.alloc_len)
        if caches.max_len > self.max_positions:
            raise ValueError(f"{caches.max_len} cache slots exceed the models' {self.max_positions} positions")
        self._runners.clear()  # the old caches and their graphs go first
        self.caches = None
        if self.prefix is not None:
            self.prefix.detach()  # blocks pinned in the old pools go with them
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the old graphs' private pool goes back to the device
        rows, max_len, blocks = caches.rows, caches.max_len, caches.blocks
        for name, model in self._models().items():
            if name == "target" and self.pair.tp is not None:  # a tensor-parallel target: every rank allocates
                self._runners[name] = TPRunner(self.pair.tp, rows, max_len, key=id(self))
                continue
            if self.kv_cache == "paged":
                cache = PagedKVCache(model, rows, max_len, blocks, self.kv_block)
                cache.flex = compiled_flex() if self.paged_attention == "flex" else None
            else:
                cache = RaggedKVCache(model, rows, max_len)
            runner = ModelRunner(model, cache, *self.output_head(name), lean=self.fast_path, graphs=self.step_graphs,
                                 fault=self.step_fault)
            runner.max_graph_width = self.graph_width
            runner.max_tree_width = self.tree_width if name == "target" else 0
            runner.logits_width = memory.logits_width(memory.step_kinds(name, self.graph_width,
                                                                        tree=runner.max_tree_width))
            self._runners[name] = runner
        self.caches = caches

    def sizes(self, want: int, row_len: int, prompt: int, plan: memory.MemoryPlan | None,
              slots: list[int] | None = None, own: list[int] | None = None, shared: int = 0) -> memory.Need | None:
        """The caches (rows, slots; paged: the pool) to hold and the rows a batch may have (`batch`: up to `want`)
        for rows of up to `row_len` slots whose prompts have up to `prompt` tokens (for a paged pool: `slots`, each
        row's; `own`, the slots each writes, and `shared`, the blocks rows running together share), beside the
        caches held now (`memory.dense_sizes`, `memory.paged_sizes`); None without a plan. Raises
        `OutOfMemoryPlan` when not one row fits."""
        if plan is None:
            return None
        if self.kv_cache == "paged":
            slots = sorted(slots or [row_len], reverse=True)
            return memory.paged_sizes(plan, want, row_len, prompt, slots, sorted(own or slots, reverse=True), shared,
                                      self.caches, self.alloc_len)
        return memory.dense_sizes(plan, want, row_len, prompt, self.caches, self.alloc_len)

    @property
    def step_path(self) -> str:
        """How the target's steps run: 'graphs', 'lean' or 'generic' (specdec/exec/runner.py); '+eager-fallback' when
        some shapes of any model fell back from the fast path."""
        runner = self._runners.get("target")
        if runner is not None:
            fell = any(getattr(r, "eager", None) for r in self._runners.values())
            return runner.path.removesuffix("+eager-fallback") + ("+eager-fallback" if fell else "")
        if self.pair.tp is not None:
            return f"lean-tp{self.pair.tp.group.world}"
        lean = self.fast_path and llama.unsupported(self.target) is None
        return ("graphs" if self.device.type == "cuda" else "lean") if lean else "generic"

    @property
    def step_errors(self) -> tuple[float, tuple] | None:
        """The largest relative error of a fast step's first run against eager's (`ModelRunner._first`), over every
        model's checked shapes, with that shape's key (None: none checked: a CPU's eager steps)."""
        errors = [(e, key) for r in self._runners.values() for key, e in getattr(r, "errors", {}).items()]
        return max(errors, key=lambda x: x[0], default=None)

    def new_batch(self, rows: int, max_len: int, policy: LengthPolicy, blocks: int | None = None,
                  formats: bool = False, prefixes: bool = True) -> Batch:
        """An empty batch of `rows` slots of `max_len` tokens (a paged cache: of `blocks` blocks; None: every row
        whole), built whole: the models' prefills, its proposer, `policy`'s per-row state, the rows' output formats
        (`formats`: some row may have one) and, with `prefixes`, the engine's prefix stores (over a paged pool they
        pin its blocks)."""
        self.hold(memory.Caches(rows, max_len, memory.pool_blocks([self.alloc_len(max_len)] * rows, self.kv_block)
                                if blocks is None else blocks))
        target = self._runners["target"]
        draft = self._runners["draft"] if self.method.draft_model else None
        slots = Slots(rows, max_len, self.device)
        stores = self.prefix if prefixes else None

        def prefill(name: str, runner) -> Prefiller:
            return Prefiller(runner, slots.seq, None if stores is None else stores[name], self.prefill_chunk)

        constraints = Constraints(slots, self.vocab_size, self.device, self.context.stop_ids) if formats else None
        proposer = self.method.proposer(slots, self.spec, policy, self.context.rule,
                                        None if draft is None else prefill("draft", draft), self.vocab_size,
                                        constraints)
        policy.attach(slots)
        # row_tokens(): a row may come to hold max_nodes + 2 slots past max_new_tokens
        batch = Batch(slots, target, prefill("target", target), proposer, self.vocab_size, self.spec.max_nodes + 2,
                      constraints)
        if stores is not None:
            stores.attach({name: r.cache for name, r in self._runners.items()}, {"target": proposer.prompt_top_ids})
        return batch

    def capture_steps(self, rows: int, shortest: int, longest: int, policy: LengthPolicy | None = None) -> None:
        """Capture now, before any row joins, the steps a batch of up to `rows` rows whose rows hold from `shortest`
        to `longest` slots can meet: each model's kinds of step (`memory.step_kinds`; as wide as `policy` drafts,
        and the verify widths explored beyond; token trees as wide as the method's) at every row, width and window
        bucket; the whole batch's first, narrow windows first, for up to `capture_budget` seconds (a step left out
        runs through a captured one that covers it, and is captured once met often: `ModelRunner.cover`); then the
        compiled pieces prefills and joining rows run (`ModelRunner.warm_pieces`). Nothing where no steps are
        captured (a CPU by default)."""
        t0 = time.perf_counter()
        runners = {name: r for name, r in self._runners.items() if getattr(r, "graphs", None) is not None}
        if not runners:
            return
        some = next(iter(runners.values()))
        buckets = sorted({some.key(n, 1, 1, "all")[0] for n in range(1, rows + 1)}, reverse=True)
        lo, hi = some.key(1, 1, shortest, "all")[2], some.key(1, 1, longest, "all")[2]
        windows = [kv for kv in memory.kv_buckets(some.cache.max_len, some.min_kv_bucket) if lo <= kv <= hi]
        deadline = t0 + self.capture_budget
        most = policy.most_drafted() if policy is not None else None
        if most is not None:  # a round verifies k + 1 tokens, or a width up to `pad` wider (VerifyWidths)
            most += 1 + (self.context.widths.tuning.pad if self.context.widths is not None else 0)
        kinds = {name: memory.step_kinds(name, runner.max_graph_width, most, runner.max_tree_width)
                 for name, runner in runners.items()}
        for r in buckets:
            for kv in windows:
                for name, runner in runners.items():
                    runner.capture([(r, w, kv, out) for w, out in kinds[name]], deadline)
        for runner in runners.values():  # steps of shapes left out run through covering ones (ModelRunner.cover)
            runner.sealed = True
            runner.warm_pieces()  # and what prefills and joining rows compile, compiled before rows join
        self.capture_s = time.perf_counter() - t0

    def max_prompt_tokens(self, plan: memory.MemoryPlan | None, max_new: int | None = None) -> int:
        """The longest prompt a row of `max_new` new tokens can take: every slot of the row (the draft's slack
        included) within the models' positions, and, on a GPU, the row alone within the memory plan."""
        max_new = max_new or self.sampling.max_new_tokens
        room = self.max_positions - self.row_tokens(0, max_new)
        if plan is not None and room > 0:
            def fits(p: int) -> bool:
                slots = self.row_tokens(p, max_new)
                return plan.fits(plan.need(1, self.alloc_len(slots), 1, slots, p))
            room = memory.largest(fits, room)
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
                            f" exceed the {room + max_new} tokens a row can have (the models' "
                            f"{self.max_positions} positions less {self.spec.max_nodes + 2} for the draft, "
                            "or the GPU memory plan); input.truncate: left keeps the last tokens")
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
        plan = self.memory_plan()
        rooms: dict[int, int] = {}  # max_new_tokens -> the longest prompt
        for i, (p, key, sp) in enumerate(zip(prompts, keys, params)):
            if sp.max_new_tokens not in rooms:
                rooms[sp.max_new_tokens] = self.max_prompt_tokens(plan, sp.max_new_tokens)
            p, reason = self._check_prompt([int(t) for t in p], rooms[sp.max_new_tokens], truncate, sp.max_new_tokens)
            if reason is None and sp.grammar is not None:
                reason = self._check_format(sp)
            for sample in range(sp.n):
                results.append(SampleResult.failed(key, len(p), reason, sample) if reason else None)
                requests.append(Request(p, key, sample, sp, i))
                if not reason:
                    todo.append(len(requests) - 1)
        if todo:
            policy = self.measure_costs()
            todo = self.admission_order(requests, todo)
            plan = plan and self.memory_plan()  # again: measuring the costs may have allocated caches
            slots = [self.row_tokens(len(requests[i].prompt), requests[i].sp.max_new_tokens) for i in todo]
            want = min(self.batch_size, len(todo))
            blocks = memory.pool_blocks(sorted(slots, reverse=True)[:want], self.kv_block)  # the longest rows at once
            self.need = self.size_batch(plan, requests, todo, slots, want)
            if self.need is not None:  # the plan's caches: the current ones, or fresh ones it fits
                need = self.need
                blocks = need.pool // self.kv_block if need.pool else blocks
                self.hold(memory.Caches(need.rows, need.max_len, blocks), exact=True)
                want = need.batch
                if self.prefix is not None and not need.pool:  # the prefixes keep what was held and what rows leave
                    self.prefix.limit(plan.left(need))
            batch = self.new_batch(want, max(slots), policy, blocks,
                                   formats=any(requests[i].sp.grammar is not None for i in todo))
            self.capture_steps(want, min(len(requests[i].prompt) for i in todo), max(slots), policy)
            Rounds(self.context, batch, policy, requests, results, on_round).run(deque(todo))
        return results  # type: ignore[return-value]

    def size_batch(self, plan: memory.MemoryPlan | None, requests: list[Request], todo: list[int], slots: list[int],
                   want: int) -> memory.Need | None:
        """What a batch of up to `want` rows of the requests `todo` (in admission order; `slots`: each one's
        `row_tokens`) takes under `plan` (None without one): with prefix caching over dense caches, room held back for the prefixes rows running together
        share (`memory.prefix_room`, unless not one row fits beside it); over a paged pool, the blocks rows share by
        reference counted once (`memory.pool_sharing`)."""
        if plan is None:
            return None
        longest = max(len(requests[i].prompt) for i in todo)
        own, shared = None, 0
        if self.prefix is not None and self.kv_cache == "paged":  # the store's blocks are the pool's
            own, shared = memory.pool_sharing([requests[i].prompt for i in todo], slots, want, self.prefix.block)
        held = self.prefix_room(plan, requests, todo, want)
        return memory.size_batch(plan, held, lambda p: self.sizes(want, max(slots), longest, p, slots, own, shared))

    def prefix_room(self, plan: memory.MemoryPlan, requests: list[Request], todo: list[int], rows: int) -> int:
        """Bytes to hold back from dense rows for the prefix store (`memory.prefix_room`: the prefixes that `rows`
        rows of `todo`, a prompt's samples counted once, running together share); none over a paged pool (the store's
        blocks are the pool's) or without prefix caching."""
        if self.prefix is None or self.kv_cache == "paged":
            return 0
        prompts: dict[int, list[int]] = {}  # a prompt per group, in admission order
        for i in todo:
            prompts.setdefault(requests[i].group, requests[i].prompt)
        return memory.prefix_room(plan, list(prompts.values()), rows, self.prefix.block, self.prefix.per_token,
                                  self.prefix.budget)

    def admission_order(self, requests: list[Request], todo: list[int]) -> list[int]:
        """The order rows are admitted in. Longest first: similar lengths run together and the long tail does not
        trail at the end; with prefix caching, rows that share their first `CLUSTER_BLOCKS` prefix blocks run
        together first (specdec/exec/prefix.py). A prompt's samples stay together, so that they join together and share
        its prefill."""
        if self.prefix is None:
            return sorted(todo, key=lambda i: (-len(requests[i].prompt), requests[i].group))
        span = CLUSTER_BLOCKS * self.prefix.block
        return [todo[j] for j in admission_order([requests[i].prompt for i in todo], span)]

    def _check_format(self, sp: SamplingParams) -> str | None:
        """Why a row's output format cannot run ("bad_response_format: ..."), or None."""
        try:
            self.context.grammars.matcher(sp.grammar)
        except GrammarError as exc:
            return str(exc)
        return None
