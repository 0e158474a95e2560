"""The batched draft -> verify -> accept loop.

One `SpecEngine` per model pair. `generate(prompts, keys)` runs continuous batching over any number
of token-id prompts: up to `batch_size` rows are active at once; a finished row leaves (swap-remove:
the last active row moves into its slot) and a waiting prompt is prefilled into the free slot, so
finished rows stop costing compute and the batch stays full.

Per row and round (S = the row's sequence length; its last token is "pending": emitted but not yet in
the target's cache):
  limits = policy.limits()                     how many tokens each row may draft
  draft  = proposer.propose(limits)            x_1..x_k per row, and q (None for point masses)
  target forward on [pending, x_1..x_k]        one call scores all k+1 positions, per-row positions
  verdict = verify(...)                        accepted a, and the recovered / bonus token y
  emit x_1..x_a, y; cut at a stop token or max_new_tokens; target cache length becomes S + a
The prompt's last token is the first pending token, so every emitted token comes from a round and
`generated_tokens <= accepted_tokens + rounds` holds exactly; `method: none` is the same loop with
k = 0 (one token per target call).

The host keeps what it already knows (row lengths, draft lengths, the policy's K) and a round reads
the device back once, at its end (`_Loop.verify`): no forward, draft step or policy waits on the GPU
mid-round, except the draft steps of policies that stop rows on the draft's own outputs
(`LengthPolicy.stops_early`). The models' KV caches belong to the engine and outlive `generate()`
calls, so the CUDA graphs captured on them do too (specdec/runner.py); on a GPU their size comes from
a memory plan (specdec/memory.py).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from . import memory, sampling
from .cache import RaggedKVCache
from .config import SampleResult, SamplingParams, SpecConfig, row_seed
from .models import ModelPair
from .policy import Slots, make_policy
from .proposers.base import Draft, Proposer
from .proposers.draft_model import DraftModelProposer
from .proposers.prompt_lookup import PromptLookupProposer
from .runner import ModelRunner, pow2_at_least
from .verify import verify_greedy, verify_lossless
from .widths import VerifyWidths


@dataclass
class _Row:
    index: int  # position in the caller's prompt list
    result: SampleResult
    tokens: list[int]  # prompt + emitted so far (host copy, for prompt lookup and stop checks)
    generator: torch.Generator | None
    t0: float


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on the device without waiting for it: a pinned staging copy, sent asynchronously."""
    t = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.clone()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Batch:
    """The state of the active rows [0, n): token buffer, lengths (on the host), per-row records."""

    def __init__(self, engine: "SpecEngine", capacity: int, max_len: int):
        self.engine = engine
        self.device = engine.device
        self.target = engine.runner("target", capacity, max_len)
        self.capacity = capacity
        self.max_len = max_len
        self.vocab_size = engine.vocab_size
        self.sampling = engine.sampling
        self.spec = engine.spec
        self.seq = torch.zeros((capacity, max_len), dtype=torch.int64, device=self.device)
        self.slots = Slots(capacity, self.device)
        self.lens = self.slots.add_host("seq_len")  # tokens per row (prompt + emitted), known on the host
        self.rows: list[_Row | None] = [None] * capacity
        self.n = 0
        self.u_draft = torch.empty((capacity, 0), device=self.device)
        self.policy = make_policy(self.spec, self.slots, engine.policy_memory)
        self.proposer = engine._make_proposer(self)

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        return to_device(array, self.device)

    def write_rows(self, start: int, prompts: list[list[int]]) -> None:
        """Rows [start, start + len(prompts)) hold these prompts (one copy to the device)."""
        end, t = start + len(prompts), max(len(p) for p in prompts)
        tokens = np.zeros((len(prompts), t), dtype=np.int64)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = p
        self.seq[start:end, :t] = self.to_device(tokens)
        self.lens[start:end] = [len(p) for p in prompts]

    def prefill(self, runner: ModelRunner, start: int, end: int) -> np.ndarray:
        """Cache all but the pending token of rows [start, end); returns their cached lengths."""
        lengths = self.lens[start:end] - 1
        t = int(lengths.max())
        if t > 0:
            runner.prefill(self.seq[start:end, :t], start, end)
        return lengths

    def move_row(self, src: int, dst: int) -> None:
        if src == dst:
            return
        length = int(self.lens[src])
        self.target.cache.move_row(src, dst, length)
        self.proposer.move_row(src, dst)
        self.seq[dst, :length] = self.seq[src, :length]
        self.slots.move(src, dst)
        self.rows[dst] = self.rows[src]


class SpecEngine:
    """Generation over a model pair. `fast_path=False` runs every model through transformers' own modules
    (no lean Llama forward, no CUDA graphs); `step_graphs` overrides where steps replay captured graphs
    (default: on a GPU; True on a CPU runs the same padded static steps eagerly, for tests);
    `gpu_memory_fraction` bounds what the KV caches may take on a GPU (specdec/memory.py)."""

    def __init__(self, pair: ModelPair, sampling_params: SamplingParams, spec: SpecConfig, batch_size: int = 16,
                 fast_path: bool = True, gpu_memory_fraction: float = 0.9, step_graphs: bool | None = None):
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        if spec.method == "draft_model" and pair.draft is None:
            raise ValueError("speculation.method draft_model needs models.draft")
        if spec.verification != "lossless":
            raise ValueError(f"speculation.verification {spec.verification!r} is not available yet; use lossless")
        if not 0 <= spec.num_draft_tokens <= spec.max_draft_tokens:
            raise ValueError("speculation.num_draft_tokens must be between 0 and max_draft_tokens")
        self.pair = pair
        self.target = pair.target
        self.vocab_size = pair.vocab_size
        self.sampling = sampling_params
        self.spec = spec
        self.batch_size = batch_size
        self.device = pair.device
        self.stop_ids = frozenset(sampling_params.stop_token_ids) | frozenset(pair.stop_token_ids)
        models = [pair.target] + ([pair.draft] if spec.method == "draft_model" else [])
        self.max_positions = min(getattr(m.config, "max_position_embeddings", 1 << 30) for m in models)
        self.policy_memory: dict = {}  # what length policies learn (timings, rates) outlives a batch
        self.fast_path = fast_path
        self.step_graphs = step_graphs
        self.gpu_memory_fraction = gpu_memory_fraction
        self._runners: dict[str, ModelRunner] = {}
        self.plan_check()
        pad = spec.verify_padding and spec.method != "none"
        self.widths = VerifyWidths(spec.max_draft_tokens + 1) if pad else None  # measured verify widths
        policy = make_policy(spec, Slots(1, "cpu"))  # refuse an unknown policy now, not mid-job
        self.profile_s = self.profile() if policy.profiles and spec.method != "none" else 0.0

    @torch.inference_mode()
    def profile(self, context: int = 64, samples: int = 2) -> float:
        """Measure what a round of each draft length costs, at every batch-size bucket up to `batch_size`,
        on synthetic rows, and hand the round times to the length policy (`LengthPolicy.record`): goodput
        then plans from the first round on instead of exploring on the job's rows.

        A round of K drafts costs the draft's K forwards plus one target forward over K + 1 tokens per row
        (its verification, at the width verify padding would pick). Both are timed apart through the real
        code (`proposer.propose`, `_Loop.verify`, which also seeds verify padding's width timings), each
        length `samples` times and a plain round next to every timing (the plain round is the level
        every other length is a ratio to, so it is timed most, and alongside, as the machine's load
        drifts). The minimum of each counts here, where samples are taken back to back on idle rows;
        the policy keeps live rounds' medians, and those replace these as the job runs. Lengths are
        timed upwards while `policy.worth_timing` says one could still win, given that drafting one
        more token costs at least one draft forward more. The
        rows repeat a 16-token pattern (prompt lookup finds full drafts in it; a model's cost does not
        depend on the tokens) and are cut back to `context` tokens after every round, so every round runs
        at the same length. It also times the target's prefill of one row and of two, and the draft's of
        one (`policy.record_admission`): what a row joining alone costs, as rows that speculation put out
        of step do. Returns the seconds it took: once per engine, which a job's worker pays when it loads
        its models."""
        t_start = time.perf_counter()
        m, cap, dev = self.spec.max_draft_tokens, self.batch_size, self.device
        g = torch.Generator().manual_seed(0)
        pattern = torch.randint(0, self.vocab_size, (cap, 16), generator=g)
        prompts = pattern.repeat(1, context // 16 + 1)[:, :context].tolist()
        batch = Batch(self, cap, context + m + 2)
        loop = _Loop(self, batch, prompts, list(range(cap)), [None] * cap)
        loop.admit(list(range(cap)))
        policy = batch.policy

        def prefill(runner, rows: int) -> float:
            """Seconds to prefill rows [0, rows) again (their caches get what they hold), best of `samples`."""
            best = float("inf")
            for _ in range(samples):
                t0 = time.perf_counter()
                batch.prefill(runner, 0, rows)
                sync(dev)
                best = min(best, time.perf_counter() - t0)
            return best

        # what a prefill call costs beyond its rows' share (a 1-row and a 2-row call: affine in rows), and a
        # row's draft prefill: what joining alone costs, which rows drifting apart under speculation do
        fixed = 0.0  # at one row every admission is alone, whatever the length
        if cap > 1:
            fixed = max(0.0, 2 * prefill(batch.target, 1) - prefill(batch.target, 2))
        draft = prefill(batch.proposer.runner, 1) if self.spec.method == "draft_model" else 0.0
        policy.record_admission(fixed, draft, self.sampling.max_new_tokens)

        def timed(n: int, k: int) -> tuple[int, float, float]:
            """One round of k drafts on rows [0, n): (k drafted, seconds drafting, seconds verifying)."""
            u = loop.uniforms(n)
            sync(dev)
            t0 = time.perf_counter()
            draft = batch.proposer.propose(n, np.full(n, k)) if k else Draft.empty(n, dev)
            k = draft.tokens.shape[1]
            sync(dev)  # the draft's work is done
            t1 = time.perf_counter()
            loop.verify(n, draft, k + 1, u)  # ends with the round's read-back
            t2 = time.perf_counter()
            batch.lens[:n] = context
            batch.proposer.rewind(n)
            return k, t1 - t0, t2 - t1

        for n in sorted({min(1 << i, cap) for i in range(cap.bit_length() + 1)}):
            plain: list[float] = []  # a plain round before every timing: what all is a ratio to
            drafting: dict[int, float] = {0: 0.0}
            verifying: dict[int, float] = {}  # per width
            rounds: dict[int, float] = {}  # per K: best drafting + verification at the width padding picks
            for k in range(m + 1):
                if k and not policy.worth_timing(k, rounds, max(rounds.values()) + drafting.get(1, 0.0)):
                    break
                for _ in range(samples):
                    plain.append(timed(n, 0)[2])
                    if not k:
                        continue
                    kd, d, v = timed(n, k)
                    if kd == 0:
                        break  # nothing to draft (prompt lookup found no match)
                    drafting[kd] = min(d, drafting.get(kd, d))
                    verifying[kd + 1] = min(v, verifying.get(kd + 1, v))
                verifying[1] = min(plain)
                for j in drafting:
                    w = self.widths.best(n, j + 1) if self.widths else j + 1
                    rounds[j] = drafting[j] + verifying.get(w, verifying[j + 1])
            for t in sorted(plain, reverse=True):  # the level first (a policy keeping the last few keeps the least)
                policy.record(n, 0, t)
            for j in sorted(rounds)[1:]:
                policy.record(n, j, rounds[j])
        return time.perf_counter() - t_start

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
                           self.spec.max_draft_tokens + 1, self.vocab_size, freed)

    def row_tokens(self, prompt_tokens: int) -> int:
        """Cache slots a row of this prompt length needs (its output and the draft's slack included)."""
        return prompt_tokens + self.sampling.max_new_tokens + self.spec.max_draft_tokens + 2

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
        max_len = max(max_len, min(pow2_at_least(max_len), self.max_positions + self.spec.max_draft_tokens + 2)) + 1
        for name, model in self._models().items():
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
        """How the target's steps run: 'graphs', 'lean' or 'generic' (specdec/runner.py)."""
        runner = self._runners.get("target")
        if runner is not None:
            return runner.path
        from . import llama
        lean = self.fast_path and llama.unsupported(self.target) is None
        return ("graphs" if self.device.type == "cuda" else "lean") if lean else "generic"

    def _make_proposer(self, batch: Batch) -> Proposer:
        if self.spec.method == "draft_model":
            return DraftModelProposer(batch, self.runner("draft", batch.capacity, batch.max_len))
        if self.spec.method == "prompt_lookup":
            return PromptLookupProposer(batch)
        return Proposer(batch)  # method none: never drafts (limits are 0)

    def _check_prompt(self, prompt, plan: memory.MemoryPlan | None) -> str | None:
        if len(prompt) == 0:
            return "empty prompt"
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            return f"token id out of range [0, {self.vocab_size})"
        need = len(prompt) + self.sampling.max_new_tokens
        if need > self.max_positions:
            return (f"prompt of {len(prompt)} tokens + max_new_tokens {self.sampling.max_new_tokens} exceeds "
                    f"the model's {self.max_positions} positions")
        if plan is not None and plan.max_row_tokens() < self.row_tokens(len(prompt)):
            return (f"prompt of {len(prompt)} tokens + max_new_tokens {self.sampling.max_new_tokens} needs "
                    f"{self.row_tokens(len(prompt))} KV-cache slots; the GPU memory plan allows "
                    f"{plan.max_row_tokens()} (resources.gpu_memory_fraction {plan.fraction})")
        return None

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], keys: list | None = None) -> list[SampleResult]:
        """Generate for every prompt; results in input order. Bad prompts become error results."""
        keys = list(range(len(prompts))) if keys is None else list(keys)
        if len(keys) != len(prompts):
            raise ValueError("keys and prompts differ in length")
        prompts = [list(map(int, p)) for p in prompts]
        results: list[SampleResult | None] = [None] * len(prompts)
        todo = []
        plan = self.memory_plan(self.batch_size)
        for i, p in enumerate(prompts):
            reason = self._check_prompt(p, plan)
            if reason:
                results[i] = SampleResult.failed(keys[i], len(p), reason)
            else:
                todo.append(i)
        if todo:
            # longest first: similar lengths run together and the long tail does not trail at the end
            todo.sort(key=lambda i: -len(prompts[i]))
            max_len = self.row_tokens(len(prompts[todo[0]]))
            batch = Batch(self, min(self._batch_rows(max_len, plan), len(todo)), max_len)
            _Loop(self, batch, prompts, keys, results).run(deque(todo))
        return results  # type: ignore[return-value]


class _Loop:
    def __init__(self, engine: SpecEngine, batch: Batch, prompts, keys, results):
        self.e = engine
        self.b = batch
        self.prompts = prompts
        self.keys = keys
        self.results = results
        sp, spec = engine.sampling, engine.spec
        self.max_new = sp.max_new_tokens
        self.m = spec.max_draft_tokens if spec.method != "none" else 0
        self.random = not sp.greedy

    def run(self, queue: deque) -> None:
        b = self.b
        while queue or b.n:
            if queue and b.n < b.capacity:
                self.admit([queue.popleft() for _ in range(min(b.capacity - b.n, len(queue)))])
            b.policy.waiting = len(queue)
            self.step()

    def admit(self, indices: list[int]) -> None:
        b = self.b
        start, end = b.n, b.n + len(indices)
        now = time.perf_counter()
        b.write_rows(start, [self.prompts[i] for i in indices])
        for slot, i in zip(range(start, end), indices):
            p = self.prompts[i]
            gen = None
            if self.random:
                gen = torch.Generator().manual_seed(row_seed(self.e.sampling.seed, self.keys[i]))
            b.rows[slot] = _Row(i, SampleResult(key=self.keys[i], prompt_tokens=len(p)), list(p), gen, now)
        b.prefill(b.target, start, end)
        b.proposer.admit(start, end)
        b.policy.admit(start, end)
        b.n = end

    def step(self) -> None:
        b = self.b
        n, m = b.n, self.m
        rows = b.rows[:n]
        if m:
            room = np.array([self.max_new - r.result.generated_tokens - 1 for r in rows], dtype=np.int64)
            limits = np.minimum(np.clip(b.policy.limits(n), 0, m), room)
        else:
            limits = np.zeros(n, dtype=np.int64)
        draft, (acc_l, new_l, len_l), trial = self.round(n, limits)
        if trial:
            b.policy.untimed()  # a trial of a verify width: no sample of what its length costs
        b.policy.observe(n, len_l, acc_l)  # after the read-back: a GPU's round is complete
        finished = []
        for i, row in enumerate(rows):
            res = row.result
            a = int(acc_l[i])
            emitted = new_l[i][: a + 1]
            cut = len(emitted)
            for j, t in enumerate(emitted):
                if t in self.e.stop_ids:
                    cut = j + 1
                    res.finish_reason = "stop"
                    break
            room = self.max_new - res.generated_tokens
            if cut >= room:
                if cut > room or res.finish_reason != "stop":
                    res.finish_reason = "length"
                cut = room
            emitted = emitted[:cut]
            res.token_ids.extend(emitted)
            row.tokens.extend(emitted)
            res.rounds += 1
            res.draft_forwards += draft.forwards
            res.draft_lengths.append(int(len_l[i]))
            res.accept_lengths.append(min(a, cut))
            if res.finish_reason == "stop" or res.generated_tokens >= self.max_new:
                finished.append(i)
        for i in reversed(finished):  # descending: the last active row is never a finished one
            self.retire(i)

    def round(self, n: int, limits: np.ndarray):
        """Draft (at most `limits` [n] tokens per row), verify and accept one round of rows [0, n). Returns
        the draft, the round's host read-back (accepted, tokens, draft lengths) and whether verification
        ran at a width only to time it."""
        u = self.uniforms(n)
        draft = self.b.proposer.propose(n, limits) if self.m else Draft.empty(n, self.b.device)
        k = draft.tokens.shape[1]
        widths = self.e.widths
        trial = widths is not None and widths.untimed(n, k + 1) is not None  # choose() explores it
        width = widths.choose(n, k + 1) if widths else k + 1  # >= k+1: a cheaper shape, if measured
        host = self.verify(n, draft, width, u)
        return draft, host, trial

    def uniforms(self, n: int) -> torch.Tensor | None:
        """This round's uniforms of rows [0, n) (None when greedy): the draft's first m, the verdict's m + 1.
        A fixed count per row and round, so a row's stream does not depend on its batch."""
        if not self.random:
            return None
        u = sampling.uniforms([r.generator for r in self.b.rows[:n]], 2 * self.m + 1, self.b.device)
        self.b.u_draft = u[:, : self.m]
        return u

    def verify(self, n: int, draft: Draft, width: int, u: torch.Tensor | None):
        """One target forward over [pending, x_1..x_k] (padded with junk to `width` >= k + 1), the
        verdict, and acceptance: rows [0, n) grow by accepted + 1 tokens. Ends with the round's one read-back
        of the device; returns host arrays of accepted [n], of the round's tokens x_1..x_a, y per row
        (as lists; stale past a + 1) and of the draft lengths [n]."""
        b, e = self.b, self.e
        dev, m, k = b.device, self.m, draft.tokens.shape[1]
        t_verify = time.perf_counter()
        lens = b.lens[:n].copy()
        seq_len = b.to_device(lens)
        ar = torch.arange(n, device=dev)
        pending = b.seq[ar, seq_len - 1]
        tokens_in = torch.cat([pending[:, None], draft.tokens], dim=1)  # [n, k+1]
        tokens_in = torch.nn.functional.pad(tokens_in, (0, width - k - 1))  # junk past the draft, if padded
        positions = (seq_len - 1)[:, None] + torch.arange(width, device=dev)[None, :]
        logits, _ = b.target.step(tokens_in, positions, int(lens.max()) - 1 + width)
        logits = logits[:, : k + 1, : e.vocab_size]  # [n, k+1, vocab]
        if u is not None:
            p = sampling.probs(logits, e.sampling)
            verdict = verify_lossless(p, draft.tokens, draft.lengths, draft.q_probs, u[:, m : m + k], u[:, 2 * m])
        else:
            verdict = verify_greedy(logits, draft.tokens, draft.lengths)

        accepted = verdict.accepted
        new = torch.cat([draft.tokens, torch.zeros((n, 1), dtype=torch.int64, device=dev)], dim=1)
        new.scatter_(1, accepted[:, None], verdict.next_token[:, None])  # x_1..x_a, y, (stale)
        write_pos = (seq_len[:, None] + torch.arange(k + 1, device=dev)[None, :]).clamp(max=b.max_len - 1)
        b.seq[:n].scatter_(1, write_pos, new)

        out = torch.cat([accepted[:, None], draft.lengths[:, None], new], dim=1).cpu().numpy()  # the read-back
        accepted_h, lengths_h = out[:, 0], out[:, 1]
        b.lens[:n] = lens + accepted_h + 1
        b.proposer.commit(n, lens, accepted_h)
        if e.widths:
            e.widths.observe(n, width, time.perf_counter() - t_verify)
        return accepted_h, out[:, 2:].tolist(), lengths_h

    def retire(self, slot: int) -> None:
        b = self.b
        row = b.rows[slot]
        row.result.wall_s = time.perf_counter() - row.t0
        if row.result.finish_reason not in ("stop", "length"):
            row.result.finish_reason = "length"
        self.results[row.index] = row.result
        b.policy.retire(slot)
        last = b.n - 1
        b.move_row(last, slot)
        b.rows[last] = None
        b.n = last
