"""Rounds: admitting prompts into a batch, and the draft -> verify -> accept loop over its rows.

Per round, over the active rows [0, n) (a row's last token is "pending": emitted, not yet in the
target's cache):
  limits  = policy.plan(batch)                how many tokens each row may draft
  draft   = proposer.propose(limits)          x_1..x_k per row (or a token tree), and q
  logits  = target([pending, x_1..x_k])       one forward scores every drafted position
  verdict = rule(logits, draft)               accepted a, and the recovered / bonus token y
  emit x_1..x_a, y; cut at a stop token, a stop string or max_new_tokens; finished rows leave
A round is queued on the device whole (`launch`), its results copied back behind it without the host waiting
(`Readback`, `Staging`), and handled on the host when they land (`land`): one read-back per round. The rows' lengths
and the draft cache's live on the device too, advanced there by each round's acceptance, so the next round is queued
before the host reads the one before it back (the host bounds the shapes it needs: `Slots.in_flight`): the host's
work overlaps the device's, rows that finished meanwhile ride one round, and leave (others join) while it is still
in flight, its results landing in the rows' new slots. What every round reads
(the rule, verify widths, the clock, stop sets, output formats, the draft limit) is a `RoundContext` the engine
builds once.
Rows with an output format (specdec/spec/grammar.py) are verified under its masks, and then take the tokens it
allows alone (jump-forward): the target reads those in the next round's forward, which then starts up to `lag`
tokens before each row's pending token. While rows decode, rows join within one `prefill_chunk` of prompt tokens,
and their prefill ends in the next round's target forward, beside the other rows' verification
(`Batch.target_inputs`' `Join`): the decoding rows wait for no prefill of their own.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from ..config import SampleResult, SamplingParams, row_seed
from ..exec.inputs import Flight, Staging, sync
from ..exec.prefill import PrefillPlan
from ..plan.costmodel import VerifyWidths
from ..plan.policies import BatchView, LengthPolicy, RoundResult
from ..spec import sampling
from ..spec.draft import Draft, Tree
from ..spec.grammar import Grammars
from ..spec.sampling import Draws, Rows
from ..spec.verify import Rule, scan
from .batch import Batch, Row
from .stops import StopStrings


@dataclass(frozen=True)
class RoundContext:
    """What every round reads, built once by the engine."""

    rule: Rule  # the verification rule (the method's; wrapped for coupled sampling)
    widths: VerifyWidths | None  # the width each chain round verifies at (None: no verify padding)
    clock: Callable[[], float]  # what rounds are timed by (a test may drive a fake one)
    stop_ids: frozenset[int]  # tokens that end every row: the target's EOS ids and `stop_token_ids`
    stop_strings: StopStrings  # finds stop strings in a row's decoded text
    grammars: Grammars  # compiles output formats
    max_draft: int  # the most tokens a row drafts in a round (0: plain decoding)
    # rows that join end their prefills in the next round's forward, beside the others' verification (False: in
    # forwards of their own first; bench/join_speed.py compares)
    join_prefills: bool = True
    # a plain round is queued before the host reads the plain round before it back (False: never; bench/host_work.py)
    overlap: bool = True
    staging: Staging | None = None  # the host buffers rounds' results land in (None: each `Rounds` its own)


@dataclass
class Request:
    """One row to generate: a prompt's sample."""

    prompt: list[int]
    key: object
    sample: int  # which of the prompt's n samples (its generator's seed includes it)
    sp: SamplingParams
    group: int  # the prompt's index: samples of one prompt share its prefill


@dataclass
class Readback:
    """A round's results on the host, per row of [0, n), read from the device in one copy (`pack`, then
    `unpack` what came back)."""

    accepted: np.ndarray  # [n] drafted tokens accepted
    drafted: np.ndarray  # [n] tokens (tree nodes) proposed
    target_non_finite: np.ndarray  # [n] the target's logits held NaN or inf
    tokens: np.ndarray  # [n, w] x_1..x_a, y (stale past a + 1)
    draft_non_finite: np.ndarray | None = None  # [n] the draft's logits held NaN or inf (None: no draft model)
    depth: np.ndarray | None = None  # [n] a token tree's depth per row (None: chains, whose depth is `drafted`)
    logprobs: np.ndarray | None = None  # [n, w] of each token where it was drawn (rows asked for them)
    top_ids: np.ndarray | None = None  # [n, w, K] the most likely tokens there
    top_logprobs: np.ndarray | None = None  # [n, w, K] their logprobs

    @staticmethod
    def pack(**values: torch.Tensor | None) -> tuple[torch.Tensor, list[tuple[str, int, tuple, str]]]:
        """The fields given as device tensors ([n, ...] of integers, bools or floats; None: absent), side by side
        in one int64 tensor [n, c] (floats as float64 bits), and where each lies in it (for `unpack`)."""
        given = {name: t for name, t in values.items() if t is not None}
        flat = [t.reshape(t.shape[0], -1) for t in given.values()]
        packed = torch.cat([t.double().view(torch.int64) if t.is_floating_point() else t.to(torch.int64)
                            for t in flat], dim=1)
        layout = [(name, f.shape[1], tuple(t.shape), "f" if t.is_floating_point() else
                   "b" if t.dtype == torch.bool else "i") for (name, t), f in zip(given.items(), flat)]
        return packed, layout

    def rows(self, index: list[int]) -> Readback:
        """These rows' results, in this order."""
        return replace(self, **{name: value[index] for name, value in vars(self).items() if value is not None})

    @classmethod
    def unpack(cls, host: np.ndarray, layout: list[tuple[str, int, tuple, str]]) -> Readback:
        at, out = 0, {}
        for name, width, shape, kind in layout:
            x = host[:, at : at + width]
            at += width
            out[name] = (x.view(np.float64) if kind == "f" else x.astype(bool) if kind == "b" else x).reshape(shape)
        return cls(**out)


@dataclass
class Verifying:
    """A verification queued on the device whose results the host has not read yet (`Rounds.landed`)."""

    n: int
    width: int
    flight: Flight  # where its results land
    layout: list  # the read-back's (`Readback.unpack`)
    growth: int  # the most tokens a row gains in it (the draft's depth, and one)
    forwards: int  # the draft's forwards (0: no row drafted)
    host_s: float  # host seconds it took to queue
    timed: bool  # its time is a sample of its width's cost (no rows joined in its forward)
    # where rows left while it was in flight (`Rounds.retire_finished`): the slot it ran each row of [0, len) now in
    order: list[int] | None = None


@dataclass
class Launched:
    """A round queued on the device whose results the host has not read yet (`Rounds.land`)."""

    verifying: Verifying
    forwards: int  # the draft's forwards
    timed: bool  # its time is a sample of its draft length's cost
    host_s: float  # host seconds it took to queue


class Rounds:
    def __init__(self, context: RoundContext, batch: Batch, policy: LengthPolicy, requests: list[Request],
                 results: list[SampleResult | None], on_round=None):
        self.context, self.batch, self.policy = context, batch, policy
        self.requests, self.results = requests, results
        self.on_round = on_round
        self.max_draft = context.max_draft
        self.sampled = not all(r.sp.greedy for r in requests)  # some row samples: rounds draw randomness
        logprobs = [r.sp.top_logprobs for r in requests if r.sp.logprobs]
        self.top_logprobs = max(logprobs) if logprobs else None  # most tokens per position (None: no logprobs)
        self.waiting = 0  # requests queued for a free row
        self.admitted = 0  # rows admitted since the last round's plan
        self.leaving: list[int] = []  # rows that finished, which leave before the next round is queued
        self.stop_ids = np.array(sorted(context.stop_ids), dtype=np.int64)  # what ends every row (`finish_plain`)
        self.staging = context.staging or Staging(batch.device)

    def run(self, queue: deque) -> None:
        """Rounds until the queue is empty and every row has finished. The next round is queued on the device before
        the host reads back the one before it where it can be (`may_go_ahead`; a drafting one, where the proposer
        `drafts_ahead`, each row within the room the device counts): the host's work on round r overlaps the
        device's on round r + 1, whose inputs (lengths, the draft's catch-up) the device builds from round r's
        outputs. A row that finished in a round another already follows rides that one (its tokens dropped); it
        leaves, and queued rows join, before the next round is queued, with that one still in flight where it
        verified chains (`may_move`; its results land in the rows' new slots)."""
        b, flight = self.batch, None
        while queue or b.n:
            joining = None  # rows whose prefill ends in the next round's forward
            if flight is None or (self.changes(queue) and self.may_move(flight)):
                self.retire_finished(flight)
                joining = self.join(queue)
                if not b.n:
                    if flight is not None:
                        self.land(flight)  # riders only
                        flight = None
                    continue
            if flight is not None and not self.may_go_ahead(flight):
                self.land(flight)
                flight = None
                if joining is None:
                    continue  # rows leave and join at the top, with nothing in flight
            limits = self.limits(b.n)
            if flight is not None and limits.any() and not b.proposer.drafts_ahead(b.n):
                self.land(flight)  # the policy drafts after all (its plan knew round r - 1)
                flight = None
                if joining is None and self.changes(queue):
                    continue
                limits = np.minimum(limits, self.draft_room(b.n))
            v = flight.verifying if flight is not None else None
            b.slots.in_flight, b.slots.in_flight_drafted = (v.growth, v.forwards > 0) if v else (0, False)
            try:
                launched = self.launch(limits, joining)
            finally:
                b.slots.in_flight, b.slots.in_flight_drafted = 0, False
            if flight is not None:
                self.land(flight)
            flight = launched

    def may_move(self, flight: Launched) -> bool:
        """Whether rows may leave and join while `flight` is in flight: no output format (read from the host's rows)
        waits for its results."""
        return self.context.overlap and self.batch.constraints is None

    def may_go_ahead(self, flight: Launched) -> bool:
        """Whether the next round may be queued before `flight` is read back: the rows' lengths and the draft's
        cache are on the device (`Slots.lens_dev`), so what the host lacks is each row's exact length, and bounds do
        for shapes: rows may move (`may_move`), not every row surely reaches max_new_tokens in `flight` (a row that
        does rides the next round, its tokens dropped, as one a stop token ends), and a round after a drafting one
        drafts (if at all) with a drafter that can go ahead."""
        b, n, v = self.batch, self.batch.n, flight.verifying
        if not self.may_move(flight):
            return False
        if (b.lens[:n] + 1 - b.slots.prompt_lens[:n] >= b.sp.host["max_new"][:n]).all():
            return False  # a round of riders only
        ahead = b.proposer.drafts_ahead(n)
        if v.forwards and not ahead:  # the proposer drafts from tokens the host has not read yet
            return False
        # a drafter that cannot go ahead: a plan made now would miss what the round in flight tells it
        return not (self.max_draft and not ahead and self.policy.drafts_soon(self.view(n)))

    def changes(self, queue: deque) -> bool:
        """Whether rows leave or join before the next round: some finished, or a queued request fits a free row."""
        b = self.batch
        if self.leaving:
            return True
        if not queue or b.n >= b.capacity:
            return False
        head = self.requests[queue[0]]
        return b.room([(head.prompt, head.sp.max_new_tokens)]) > 0

    def join(self, queue: deque) -> PrefillPlan | None:
        """Queued requests join the free rows, as many as the caches have room for (and, while rows decode,
        within one prefill chunk); returns the plan of those whose prefill ends in the next round's forward."""
        b, join = self.batch, self.context.join_prefills
        if not queue or b.n >= b.capacity:
            return None
        heads = [self.requests[queue[j]] for j in range(min(b.capacity - b.n, len(queue)))]
        fits = b.room([(r.prompt, r.sp.max_new_tokens) for r in heads])
        if fits == 0 and b.n == 0:
            raise RuntimeError("the KV cache has no room for one row: its memory plan is wrong")
        if fits and b.n and join:  # rows decoding wait for no prefill: one chunk joins their round
            fits = self.within_chunk(heads[:fits])
        if not fits:
            return None
        return self.admit([queue.popleft() for _ in range(fits)], len(queue), join)

    def within_chunk(self, heads: list[Request]) -> int:
        """How many of these rows (in order, at least one) join together within one `prefill_chunk`: their prompts'
        tokens to compute (not what the prefix store holds; a prompt's other samples copy it), padded to the most,
        as the round's forward takes them."""
        chunk, store = self.batch.prefill.chunk, self.batch.prefill.store
        if chunk is None:
            return len(heads)
        most, groups = 0, set()
        for i, r in enumerate(heads):
            if r.group not in groups:
                groups.add(r.group)
                left = len(r.prompt) - 1
                if store is not None:
                    left -= len(store.match(r.prompt, left, touch=False)) * store.block
                most = max(most, left)
                if len(groups) * most > chunk:
                    return max(1, i)
        return len(heads)

    def admit(self, indices: list[int], waiting: int = 0, join: bool = False) -> PrefillPlan | None:
        """Requests `indices` join the batch. One sample of each prompt is prefilled; the others copy its
        caches (they sit after all the prefilled rows, so that these are contiguous). With prefix caching, a
        prefilled row takes the blocks the store holds of its prompt, and rows that share blocks not stored yet
        with an earlier row are prefilled after it, once its blocks are stored: a shared prefix is computed once.
        `join`: the last rows' prefill ends in the next round's forward; returns its plan then (else None)."""
        b, now = self.batch, time.perf_counter()
        first: dict[int, int] = {}  # group -> its prefilled request
        for i in indices:
            first.setdefault(self.requests[i].group, i)
        lead = list(first.values())
        store = b.prefill.store
        later = store.followers([self.requests[i].prompt for i in lead],
                                [len(self.requests[i].prompt) - 1 for i in lead]) if store else [False] * len(lead)
        # rows sharing a prefix not stored yet with a row before them go after the others, once those are stored
        lead = [i for i, f in zip(lead, later) if not f] + [i for i, f in zip(lead, later) if f]
        leads = set(lead)
        order = lead + [i for i in indices if i not in leads]
        start, mid, end = b.n, b.n + len(lead), b.n + len(order)
        rows = []
        for i in order:
            r = self.requests[i]
            gen = None if r.sp.greedy else torch.Generator().manual_seed(row_seed(r.sp.seed, r.key, r.sample))
            result = SampleResult(key=r.key, prompt_tokens=len(r.prompt), sample_index=r.sample,
                                  verification=self.context.rule.name)
            rows.append(Row(i, result, list(r.prompt), gen, now, r.sp))
        b.write_rows(start, rows)
        self.waiting, self.admitted = waiting, self.admitted + len(order)
        view = self.view(end)
        drafting = self.policy.drafts_soon(view)
        wide = drafting and b.proposer.prompt_top_ids and self.policy.widens_soon(view)
        split, joining = mid - sum(later), None
        for lo, hi in ((start, split), (split, mid)):
            if hi > lo:  # the last rows' prefill ends in the next round's forward (no copies wait for it)
                top_ids, plan = b.prefill_target(lo, hi, b.proposer.prompt_top_ids if wide else 0,
                                                 tail=join and hi == end)
                b.proposer.admit(lo, hi, top_ids, drafting=drafting)
                for r in plan.rows:
                    b.rows[r.slot].result.cached_prompt_tokens = r.reused
                joining = plan if plan.tail else None
        slot_of = {i: start + j for j, i in enumerate(lead)}  # a prompt's prefilled request -> its slot
        for slot in range(mid, end):
            b.copy_row(slot_of[first[self.requests[order[slot - start]].group]], slot)
            b.rows[slot].result.cached_prompt_tokens = int(b.cached[slot])  # the whole prompt, copied
        if b.constraints is not None:
            for slot, i in zip(range(start, end), order):
                fmt = self.requests[i].sp.grammar
                b.constraints.set(slot, None if fmt is None else self.context.grammars.matcher(fmt))
            self.jump_forward(range(start, end))
        return joining

    def view(self, n: int, reach: bool = False) -> BatchView:
        """What the policy sees of rows [0, n); `reach`: with how deep each row can draft now (before a round)."""
        return BatchView(n, self.waiting, self.admitted, self.batch.proposer.reach(n) if reach else None)

    def draft_room(self, n: int) -> np.ndarray:
        """[n] host: the most tokens each row may draft before max_new_tokens (0 for a finished row)."""
        return np.array([0 if r.done else r.sp.max_new_tokens - r.result.generated_tokens - 1
                         for r in self.batch.rows[:n]], dtype=np.int64)

    def limits(self, n: int) -> np.ndarray:
        """[n] host: the tokens each row may draft this round (the policy's plan, within its `draft_room`)."""
        if not self.max_draft:
            return np.zeros(n, dtype=np.int64)
        plan = self.policy.plan(self.view(n, reach=True))
        self.admitted = 0
        if not np.any(plan):
            return np.zeros(n, dtype=np.int64)
        return np.minimum(plan, self.draft_room(n))

    def launch(self, limits: np.ndarray, joining: PrefillPlan | None = None) -> Launched:
        """Queue one round of the active rows on the device: propose within `limits`, verify, and the read-back
        of its results (`land` takes them). `joining`: the rows whose prefill ends in this round's forward."""
        b, n, clock = self.batch, self.batch.n, self.context.clock
        t0 = clock()
        flight = self.staging.next()
        flight.mark("start")
        rows = b.sp.view(n)
        draws = self.draws(n, int(limits.max(initial=0)) + 1)
        draft = b.proposer.propose(n, limits, rows, draws, self.policy.siblings)
        widths = self.context.widths if draft.tree is None else None  # a tree's forward is as wide as the tree
        k = draft.tokens.shape[1]
        trial = widths is not None and widths.untimed(n, k + 1) is not None  # a width timed, not a K's cost
        width = widths.choose(n, k + 1) if widths else k + 1
        verifying = self.queue_verify(n, draft, width, rows, draws, joining, flight)
        # a round that ends rows' prefills costs more than its drafts and width
        return Launched(verifying, draft.forwards, joining is None and not trial, clock() - t0)

    def land(self, launched: Launched) -> None:
        """Read a launched round's results back and hand each row its tokens; rows that finish leave before the
        next round that is not yet launched (`retire_finished`). A row that had finished already (a rider)
        takes nothing."""
        b, v, clock = self.batch, launched.verifying, self.context.clock
        t0 = clock()
        out = self.landed(v)
        n = len(out.accepted)  # the rows it ran still in the batch
        fresh = [i for i in range(n) if not b.rows[i].done]  # riders take nothing
        plain, own = self.plain_rows(fresh, out)
        emitted = self.finish_plain(plain, out, launched.forwards)
        emitted += sum(self.finish(i, out, launched.forwards) for i in own)
        emitted += self.jump_forward(fresh)
        self.leaving += [i for i in fresh if b.rows[i].done]
        finished = np.zeros(n, dtype=bool)
        finished[self.leaving] = True
        seconds = self.seconds(launched.host_s + clock() - t0, v.flight) if launched.timed else None
        self.policy.observe(RoundResult(n, out.drafted, out.accepted, finished, seconds, out.depth, v.width))
        if self.on_round is not None:
            self.on_round(emitted)

    @staticmethod
    def seconds(host: float, flight: Flight, since: str = "start") -> float:
        """What a round (or its verification) cost: the host's time on it or the device's, whichever was longer
        (rounds in flight overlap one's host work with the other's device work)."""
        device = flight.seconds(since)
        return host if device is None else max(host, device)

    def retire_finished(self, flight: Launched | None = None) -> None:
        """Rows that finished leave the batch (descending: the last active row is never a finished one), with
        `flight` in flight or none: the rows it ran that stay are told apart by where it ran them
        (`Verifying.order`), and a row moving into a hole takes the slots the round may have written past the
        host's count."""
        b, v = self.batch, None if flight is None else flight.verifying
        if v is not None and self.leaving:
            v.order = list(range(v.n)) if v.order is None else v.order
            assert len(v.order) == b.n, "rows joined before the round in flight landed"
            b.slots.in_flight = v.growth
        try:
            for i in sorted(self.leaving, reverse=True):
                if v is not None:
                    v.order[i] = v.order[b.n - 1]
                    v.order.pop()
                self.retire(i)
        finally:
            b.slots.in_flight = 0
        self.leaving = []

    def draws(self, n: int, width: int) -> Draws:
        """This round's randomness for rows [0, n): none when every row is greedy; the Gumbel noise of each row's
        next `width` output positions under coupled sampling; else a fixed count of uniforms per row and round (the
        draft's `max_draft`, then the rule's `max_draft` + 1), so that a row's stream does not depend on its batch."""
        b, m = self.batch, self.max_draft
        if not self.sampled:
            return Draws(m)
        if self.context.rule.coupled:
            keys = [None if r.generator is None else r.generator.initial_seed() for r in b.rows[:n]]
            # positions from the device's lengths: a round in flight may have grown them
            return Draws(m, noise=sampling.gumbel(keys, b.slots.lens_dev[:n], width, b.vocab_size, b.device))
        return Draws(m, uniforms=sampling.uniforms([r.generator for r in b.rows[:n]], 2 * m + 1, b.device))

    def verify(self, n: int, draft: Draft, width: int, rows: Rows, draws: Draws,
               joining: PrefillPlan | None = None) -> Readback:
        """`queue_verify`, then its results (`landed`): a verification the host waits for (the start-up profile)."""
        return self.landed(self.queue_verify(n, draft, width, rows, draws, joining))

    def queue_verify(self, n: int, draft: Draft, width: int, rows: Rows, draws: Draws,
                     joining: PrefillPlan | None = None, flight: Flight | None = None) -> Verifying:
        """Queue one target forward over [pending, draft] at `width` tokens per row (chains padded with junk past
        k + 1), the rule's verdict, acceptance (rows [0, n) grow by accepted + 1 tokens) and the read-back of the
        results into `flight`; `joining`'s rows end their prefill in the same forward. Nothing waits for the
        device: where no row drafted, the host counts each row's one new token now."""
        b, k, clock = self.batch, draft.tokens.shape[1], self.context.clock
        t0 = clock()
        flight = flight or self.staging.next()
        flight.mark("verify")
        inputs = b.target_inputs(n, draft, width, joining)
        if inputs.join is None:
            logits, _ = b.target.step(inputs.tokens, inputs.positions, inputs.kv_len, slots=inputs.slots,
                                      mask=inputs.mask)
            logits = logits[:, inputs.lag - 1 : inputs.lag + k, : b.vocab_size]  # [n, k+1, vocab]
        else:  # rows joining the batch end their prefills in this forward, and verify their drafts in it
            step, joined = b.target.step_joined(inputs.tokens, inputs.positions, inputs.kv_len, inputs.join)
            parts = [] if step is None else [step[:, inputs.lag - 1 : inputs.lag + k]]
            logits = torch.cat(parts + [joined])[..., : b.vocab_size]
            b.prefill.keep(joining)  # their caches hold their prompts now: the prefix store takes them
        best, finite = scan(logits)  # greedy's choices and the non-finite check in one pass
        if b.constraints is not None:  # on the host while the forward runs: each row's format masks p
            draft = self.constrain(n, draft)
        if draft.allowed is not None:
            logits = logits.masked_fill(~draft.allowed, float("-inf"))
            best = None  # the masks change the argmax
        verdict = self.context.rule(logits, draft, rows, draws, best)
        tokens = b.accept(n, inputs, verdict, draft)
        b.proposer.advance(n, inputs.base + 1, verdict.accepted, draft.forwards)
        logprobs = self.logprobs(logits, rows, tokens, verdict.path) if self.top_logprobs is not None else {}
        packed, layout = Readback.pack(accepted=verdict.accepted, drafted=draft.lengths,
                                       target_non_finite=~finite.all(1), draft_non_finite=draft.non_finite,
                                       depth=draft.row_depths(), tokens=tokens, **logprobs)
        flight.send(packed)
        return Verifying(n, width, flight, layout, draft.depth + 1, draft.forwards, clock() - t0, joining is None)

    def landed(self, v: Verifying) -> Readback:
        """A queued verification's results, once the device has sent them: the host counts what rows accepted (rounds
        land in the order they were queued: its lengths are those before this one)."""
        clock, t0 = self.context.clock, self.context.clock()
        out = Readback.unpack(v.flight.wait(), v.layout)
        if v.order is not None:  # rows left while it was in flight: the results of those that stay, where they are
            out = out.rows(v.order)
        n = len(out.accepted)
        lens = self.batch.lens[:n].copy()
        self.batch.grow(n, lens, out.accepted)
        self.batch.proposer.commit(n, lens, out.accepted, v.forwards)
        if self.context.widths and v.timed:
            self.context.widths.observe(v.n, v.width, self.seconds(v.host_s + clock() - t0, v.flight, "verify"))
        return out

    def constrain(self, n: int, draft: Draft) -> Draft:
        """The draft with each constrained row's chain cut to what its grammar allows, and every verified position
        masked by it (`Draft.allowed`)."""
        g, k = self.batch.constraints, draft.tokens.shape[1]
        if not g.rows(n):
            return draft
        host = draft.host_tokens if draft.host_tokens is not None else np.zeros((n, k), dtype=np.int64)
        full = np.full(n, k)
        if draft.tree is not None:
            return replace(draft, allowed=g.tree_masks(n, host, draft.tree.host_parent, full))
        tokens = host.tolist()
        valid = g.valid_lengths(n, tokens, full)
        return replace(draft, lengths=torch.minimum(draft.lengths, self.batch.to_device(valid)),
                       allowed=g.chain_masks(n, tokens, valid, k + 1))

    def logprobs(self, logits: torch.Tensor, rows: Rows, new: torch.Tensor, path: torch.Tensor | None) -> dict:
        """Each emitted token's logprob where it was drawn [n, w], and the most likely tokens there with theirs
        [n, w, K] (the read-back's fields)."""
        lp = sampling.logprobs(logits, rows)  # [n, k+1, vocab]
        if path is not None:  # a tree's token j was drawn at its parent: the root, then the path's nodes
            at = torch.nn.functional.pad(path, (1, 0))[:, : new.shape[1]]
            lp = lp.gather(1, at[:, :, None].expand(-1, -1, lp.shape[-1]))
        out = {"logprobs": lp.gather(2, new[:, :, None]).squeeze(2)}
        if self.top_logprobs:
            out["top_logprobs"], out["top_ids"] = lp.topk(self.top_logprobs, dim=-1)
        return out

    def plain_rows(self, slots: list[int], out: Readback) -> tuple[list[int], list[int]]:
        """These rows split into those a round finishes by array operations (`finish_plain`: no stop strings, own
        stop tokens, logprobs or output format, finite logits) and the others (`finish`, row by row)."""
        b = self.batch
        if b.constraints is not None:
            return [], slots
        failed = out.target_non_finite if out.draft_non_finite is None else out.target_non_finite | out.draft_non_finite
        plain, own = [], []
        for i in slots:
            sp = b.rows[i].sp
            (own if sp.stop or sp.stop_token_ids or sp.logprobs or failed[i] else plain).append(i)
        return plain, own

    def finish_plain(self, slots: list[int], out: Readback, forwards: int) -> int:
        """`finish` for rows of `plain_rows`: each row's cut (after the first stop token among x_1..x_a, y, or at
        max_new_tokens) found over the read-back at once, then its lists extended once. Returns the tokens kept."""
        if not slots:
            return 0
        rows, idx = self.batch.rows, np.asarray(slots)
        a, tokens, drafted = out.accepted[idx], out.tokens[idx], out.drafted[idx]
        stops = np.isin(tokens, self.stop_ids) & (np.arange(tokens.shape[1])[None, :] <= a[:, None])
        stopped = stops.any(1)
        upto = np.where(stopped, stops.argmax(1), a) + 1  # x_1..x_a, y, or up to the first stop token
        room = np.array([rows[i].sp.max_new_tokens - len(rows[i].result.token_ids) for i in slots])
        cut = np.minimum(upto, room)
        reasons = np.where(stopped & (upto <= room), "stop", np.where(upto >= room, "length", ""))
        for i, c, got, d, acc, why in zip(slots, cut.tolist(), tokens.tolist(), drafted.tolist(), a.tolist(),
                                          reasons.tolist()):
            row = rows[i]
            res, kept = row.result, got[:c]
            res.token_ids.extend(kept)
            row.tokens.extend(kept)
            res.rounds += 1
            res.draft_forwards += forwards
            res.draft_lengths.append(d)
            res.accept_lengths.append(min(acc, c))
            if why:
                res.finish_reason = why
        return int(cut.sum())

    def finish(self, i: int, out: Readback, forwards: int) -> int:
        """Row i's share of the round: its tokens and statistics. Returns how many tokens it emitted."""
        row, b = self.batch.rows[i], self.batch
        res = row.result
        failed = "target" if out.target_non_finite[i] else \
            "draft" if out.draft_non_finite is not None and out.draft_non_finite[i] else None
        if failed:  # this row's logits were NaN or inf: its tokens mean nothing from here on
            res.finish_reason = "error"
            res.error = f"non_finite_logits: the {failed}'s logits held NaN or inf"
            return 0
        a = int(out.accepted[i])
        tokens = out.tokens[i, : a + 1].tolist()
        lps = ranked = None
        if row.sp.logprobs:
            lps = out.logprobs[i, : a + 1].tolist()
            ranked = None if out.top_ids is None else [list(zip(*t)) for t in zip(
                out.top_ids[i, : a + 1].tolist(), out.top_logprobs[i, : a + 1].tolist())]
        kept = self.emit(row, tokens, lps, ranked)
        res.rounds += 1
        res.draft_forwards += forwards
        res.draft_lengths.append(int(out.drafted[i]))
        res.accept_lengths.append(min(a, kept))
        if b.constraints is not None and not b.constraints.commit(i, tokens[:kept]):
            res.finish_reason, res.error = "error", "grammar: an emitted token left the output format"
        return kept

    def emit(self, row: Row, tokens: list[int], lps: list[float] | None = None,
             ranked: list[list[tuple[int, float]]] | None = None) -> int:
        """Append `tokens` to the row, cut after a stop token, at a stop string or at max_new_tokens; their logprobs
        (`lps`) and the most likely (id, logprob) pairs at each (`ranked`) too, where the row asked. Returns how many
        were kept."""
        res, stops = row.result, self.context.stop_ids
        stop = next((j for j, t in enumerate(tokens) if t in stops or t in row.sp.stop_token_ids), None)
        cut = len(tokens) if stop is None else stop + 1
        if stop is not None:
            res.finish_reason = "stop"
        if row.sp.stop and (hit := self.context.stop_strings.find(res.token_ids, tokens[:cut], row.sp.stop)) is not None:
            cut, res.stop_string = hit
            res.finish_reason = "stop"
        room = row.sp.max_new_tokens - res.generated_tokens
        if cut >= room:
            if cut > room or res.finish_reason != "stop":
                res.finish_reason = "length"
            cut = room
        res.token_ids.extend(tokens[:cut])
        row.tokens.extend(tokens[:cut])
        if row.sp.logprobs:
            res.logprobs = (res.logprobs or []) + lps[:cut]
            if row.sp.top_logprobs:
                res.top_logprobs = (res.top_logprobs or []) + [[(t, p) for t, p in pairs if p > float("-inf")]
                                                               [: row.sp.top_logprobs] for pairs in ranked[:cut]]
        return cut

    def jump_forward(self, slots) -> int:
        """Rows whose output format allows exactly one next token take it (and the next, while that holds)
        without a model call; the target reads them in the next round (under every method, `none` included).
        Returns the tokens emitted."""
        b = self.batch
        if b.constraints is None:
            return 0
        added: dict[int, list[int]] = {}
        for i in slots:
            row = b.rows[i]
            if b.constraints.matchers[i] is None or row.done:
                continue
            forced = b.constraints.forced(i, row.sp.max_new_tokens - row.result.generated_tokens)
            if forced:
                kept = self.emit(row, forced, [0.0] * len(forced), [[(t, 0.0)] for t in forced])
                row.result.forced_tokens += kept
                added[i] = forced[:kept]
        b.append(added)
        return sum(len(t) for t in added.values())

    def retire(self, slot: int) -> None:
        row = self.batch.remove(slot)
        row.result.wall_s = time.perf_counter() - row.t0
        if row.result.finish_reason not in ("stop", "length", "error"):
            row.result.finish_reason = "length"
        self.results[row.index] = row.result


class SyntheticRounds:
    """The parts of a round on synthetic rows, each run then undone, for the start-up profile (specdec/plan/profiler.py
    times them): every row repeats a 16-token pattern (prompt lookup finds full drafts in it; a model's cost does
    not depend on the tokens) `context` tokens long, and is cut back to that after every call, so each call runs at
    the same length and leaves nothing behind."""

    def __init__(self, context: RoundContext, batch: Batch, policy: LengthPolicy, sp: SamplingParams,
                 draft_model: bool, context_len: int = 64):
        self.batch, self.length, self.draft_model = batch, context_len, draft_model
        self.g = torch.Generator().manual_seed(0)
        pattern = torch.randint(0, batch.vocab_size, (batch.capacity, 16), generator=self.g)
        prompts = pattern.repeat(1, context_len // 16 + 1)[:, :context_len].tolist()
        self.loop = Rounds(context, batch, policy, [Request(p, i, 0, sp, i) for i, p in enumerate(prompts)],
                           [None] * batch.capacity)
        self.loop.admit(list(range(batch.capacity)))
        sync(batch.device)

    def draft(self, n: int, k: int) -> None:
        """Draft k tokens for rows [0, n) (the draft cache's length stays as it was)."""
        b = self.batch
        b.proposer.propose(n, np.full(n, k), b.sp.view(n), self.loop.draws(n, k + 1))
        b.rewind(n, self.length)
        sync(b.device)

    def verify(self, n: int, width: int, depth: int | None = None) -> None:
        """Verify a chain of width - 1 random drafts for rows [0, n); with `depth`, a tree of width - 1 nodes: a
        chain that deep, the rest leaves under the root."""
        b, dev, k = self.batch, self.batch.device, width - 1
        tokens = torch.randint(0, b.vocab_size, (n, k), generator=self.g).to(dev)
        rows = b.sp.view(n)
        q = None if rows.greedy or not self.draft_model else \
            torch.full((n, k, b.vocab_size), 1.0 / b.vocab_size, device=dev)
        tree = None
        if depth is not None:
            ar = torch.arange(k, device=dev)
            parent, depths = torch.where(ar < depth, ar, 0), torch.where(ar < depth, ar + 1, 1)
            tree = Tree(parent[None].expand(n, k), depths[None].expand(n, k), depth)
        draft = Draft(tokens, torch.full((n,), k, device=dev), q, tree)
        self.loop.verify(n, draft, width, rows, self.loop.draws(n, (k if depth is None else depth) + 1))
        b.rewind(n, self.length)
        sync(dev)

    def prefill(self, rows: int, draft: bool = False) -> None:
        """The target's (or the draft's) prefill of rows [0, rows)."""
        b = self.batch
        if draft:
            b.proposer.fill(0, rows)
        else:
            b.prefill_target(0, rows)
        sync(b.device)
