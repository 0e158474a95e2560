"""Rounds: admitting prompts into a batch, and the draft -> verify -> accept loop over its rows.

Per round, over the active rows [0, n) (a row's last token is "pending": emitted, not yet in the
target's cache):
  limits  = policy.plan(batch)                how many tokens each row may draft
  draft   = proposer.propose(limits)          x_1..x_k per row (or a token tree), and q
  logits  = target([pending, x_1..x_k])       one forward scores every drafted position
  verdict = rule(logits, draft)               accepted a, and the recovered / bonus token y
  emit x_1..x_a, y; cut at a stop token, a stop string or max_new_tokens; finished rows leave
A round reads the device back once, at the end of `verify`; everything the host needs before that
(lengths, K) it already knows.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from . import sampling, trees
from .batch import Batch, Row
from .config import SampleResult, SamplingParams, row_seed
from .policies import BatchView, LengthPolicy, RoundResult
from .proposers.base import Draft

if TYPE_CHECKING:
    from .engine import SpecEngine


@dataclass
class Readback:
    """A round's results on the host, per row of [0, n)."""

    accepted: np.ndarray  # [n] drafted tokens accepted
    drafted: np.ndarray  # [n] tokens (tree nodes) proposed
    bad: np.ndarray  # [n] non-finite logits: bit 1 the target's, bit 2 the draft's
    tokens: list[list[int]]  # per row x_1..x_a, y (stale past a + 1)


class Rounds:
    def __init__(self, engine: SpecEngine, batch: Batch, policy: LengthPolicy, prompts: list[list[int]], keys: list,
                 params: list[SamplingParams], results: list[SampleResult | None], on_round=None):
        self.e, self.b, self.policy = engine, batch, policy
        self.prompts, self.keys, self.params, self.results = prompts, keys, params, results
        self.on_round = on_round
        self.m = engine.spec.max_draft_tokens if engine.spec.method != "none" else 0
        self.random = not all(sp.greedy for sp in params)  # some row samples: rounds draw uniforms
        self.waiting = self.joined = 0

    def run(self, queue: deque) -> None:
        b = self.b
        while queue or b.n:
            if queue and b.n < b.capacity:
                self.admit([queue.popleft() for _ in range(min(b.capacity - b.n, len(queue)))], len(queue))
            self.round()

    def admit(self, indices: list[int], waiting: int = 0) -> None:
        b, now = self.b, time.perf_counter()
        start, end = b.n, b.n + len(indices)
        rows = []
        for i in indices:
            sp = self.params[i]
            gen = None if sp.greedy else torch.Generator().manual_seed(row_seed(sp.seed, self.keys[i]))
            result = SampleResult(key=self.keys[i], prompt_tokens=len(self.prompts[i]), verification=self.e.rule.name)
            rows.append(Row(i, result, list(self.prompts[i]), gen, now, sp))
        b.write_rows(start, rows)
        top = b.prefill_target(start, end, b.proposer.prefill_top)
        self.waiting, self.joined = waiting, self.joined + len(indices)
        b.proposer.admit(start, end, top, drafting=self.policy.drafts_soon(self.view(end)))
        b.n = end

    def view(self, n: int) -> BatchView:
        return BatchView(n, self.waiting, self.joined)

    def limits(self, n: int) -> np.ndarray:
        """[n] host: the tokens each row may draft this round (the policy's plan, within max_draft_tokens and
        the row's room before max_new_tokens)."""
        if not self.m:
            return np.zeros(n, dtype=np.int64)
        room = np.array([r.sp.max_new_tokens - r.result.generated_tokens - 1 for r in self.b.rows[:n]])
        plan = self.policy.plan(self.view(n))
        self.joined = 0
        return np.minimum(np.clip(plan, 0, self.m), room)

    def round(self) -> None:
        """One round of the active rows: plan, propose, verify (one read-back), finish rows."""
        b, n = self.b, self.b.n
        limits = self.limits(n)
        t0 = self.e.clock()
        u = self.uniforms(n)  # [n, 2M + 1] or None: the draft's first M, the rule's M + 1
        draft = b.proposer.propose(n, limits, None if u is None else u[:, : self.m])
        widths = self.e.widths if draft.tree is None else None  # a tree's forward is as wide as the tree
        k = draft.tokens.shape[1]
        trial = widths is not None and widths.untimed(n, k + 1) is not None  # a width timed, not a K's cost
        out = self.verify(n, draft, widths.choose(n, k + 1) if widths else k + 1, u)
        emitted = sum(self.finish(b.rows[i], out, i, draft.forwards) for i in range(n))
        finished = np.array([b.rows[i].done for i in range(n)], dtype=bool)
        seconds = None if trial else self.e.clock() - t0
        self.policy.observe(RoundResult(n, out.drafted, out.accepted, finished, seconds))
        for i in reversed(np.flatnonzero(finished)):  # descending: the last active row is never a finished one
            self.retire(int(i))
        if self.on_round is not None:
            self.on_round(emitted)

    def uniforms(self, n: int) -> torch.Tensor | None:
        """This round's uniforms of rows [0, n) (None when greedy): a fixed count per row and round, so a row's
        stream does not depend on its batch."""
        if not self.random:
            return None
        return sampling.uniforms([r.generator for r in self.b.rows[:n]], 2 * self.m + 1, self.b.device)

    def verify(self, n: int, draft: Draft, width: int, u: torch.Tensor | None) -> Readback:
        """One target forward over [pending, draft] (chains padded with junk to `width` >= k + 1), the rule's
        verdict, and acceptance: rows [0, n) grow by accepted + 1 tokens. Ends with the round's read-back."""
        b, dev, k = self.b, self.b.device, draft.tokens.shape[1]
        t0 = time.perf_counter()
        lens = b.lens[:n].copy()
        base = b.to_device(lens) - 1  # [n] the pending token's slot
        tokens_in = torch.cat([b.seq[torch.arange(n, device=dev), base][:, None], draft.tokens], dim=1)  # [n, k+1]
        kv_len = int(lens.max()) - 1 + width
        if draft.tree is None:  # chains, padded with junk to `width`
            positions = base[:, None] + torch.arange(width, device=dev)[None, :]
            logits, _ = b.target.step(torch.nn.functional.pad(tokens_in, (0, width - k - 1)), positions, kv_len)
        else:  # token trees: node j at slot base + j, position base + depth, seeing its ancestors
            t = draft.tree
            positions, slots, mask = trees.tree_inputs(t.parent, t.depth, base, kv_len, t.max_depth)
            logits, _ = b.target.step(tokens_in, positions, kv_len, slots=slots, mask=mask)
        logits = logits[:, : k + 1, : b.vocab_size]  # [n, k+1, vocab]
        v = self.e.rule(logits, draft, b.sp.view(n), None if u is None else u[:, self.m :])
        bad = (~torch.isfinite(logits).flatten(1).all(1)).to(torch.int64)  # 1: the target's logits are not finite
        if draft.bad is not None:
            bad |= draft.bad.to(torch.int64) << 1  # 2: the draft's

        new = draft.tokens
        if v.path is not None:  # keep the accepted path: its tokens, and its keys and values moved into place
            ar = torch.arange(1, v.path.shape[1] + 1, device=dev)[None, :]
            b.target.cache.move_slots(base[:, None] + v.path, base[:, None] + ar)
            new = draft.tokens.gather(1, (v.path - 1).clamp(min=0))
        new = torch.cat([new, torch.zeros((n, 1), dtype=torch.int64, device=dev)], dim=1)
        new.scatter_(1, v.accepted[:, None], v.next_token[:, None])  # x_1..x_a, y, (stale)
        write = (base[:, None] + 1 + torch.arange(new.shape[1], device=dev)[None, :]).clamp(max=b.max_len - 1)
        b.seq[:n].scatter_(1, write, new)

        host = torch.cat([v.accepted[:, None], draft.lengths[:, None], bad[:, None], new], 1).cpu().numpy()  # read-back
        out = Readback(host[:, 0], host[:, 1], host[:, 2], host[:, 3:].tolist())
        b.lens[:n] = lens + out.accepted + 1
        b.proposer.commit(n, lens, out.accepted)
        if self.e.widths:
            self.e.widths.observe(n, width, time.perf_counter() - t0)
        return out

    def finish(self, row: Row, out: Readback, i: int, forwards: int) -> int:
        """Row i's share of the round: its tokens, cut after a stop token, at a stop string or at max_new_tokens,
        and its statistics. Returns how many tokens it emitted."""
        res = row.result
        if out.bad[i]:  # this row's logits were NaN or inf: its tokens mean nothing from here on
            res.finish_reason = "error"
            res.error = f"non_finite_logits: the {'target' if out.bad[i] & 1 else 'draft'}'s logits held NaN or inf"
            return 0
        a = int(out.accepted[i])
        emitted = out.tokens[i][: a + 1]
        stop = next((j for j, t in enumerate(emitted) if t in self.e.stop_ids or t in row.sp.stop_token_ids), None)
        cut = len(emitted) if stop is None else stop + 1
        if stop is not None:
            res.finish_reason = "stop"
        if row.sp.stop and (hit := self.e.stop_strings.find(res.token_ids, emitted[:cut], row.sp.stop)) is not None:
            cut, res.stop_string = hit
            res.finish_reason = "stop"
        room = row.sp.max_new_tokens - res.generated_tokens
        if cut >= room:
            if cut > room or res.finish_reason != "stop":
                res.finish_reason = "length"
            cut = room
        res.token_ids.extend(emitted[:cut])
        row.tokens.extend(emitted[:cut])
        res.rounds += 1
        res.draft_forwards += forwards
        res.draft_lengths.append(int(out.drafted[i]))
        res.accept_lengths.append(min(a, cut))
        return cut

    def retire(self, slot: int) -> None:
        b = self.b
        row = b.rows[slot]
        row.result.wall_s = time.perf_counter() - row.t0
        if row.result.finish_reason not in ("stop", "length", "error"):
            row.result.finish_reason = "length"
        self.results[row.index] = row.result
        last = b.n - 1
        b.move_row(last, slot)
        b.rows[last] = None
        b.n = last
