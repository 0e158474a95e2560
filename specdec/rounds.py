"""Rounds: admitting prompts into a batch, and the draft -> verify -> accept loop over its rows.

A round reads the device back once, at its end (`Rounds.verify`); everything the host needs before
that (lengths, K) it already knows.
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np
import torch

from . import sampling, trees
from .batch import Batch, _Row
from .config import SampleResult, row_seed
from .proposers.base import Draft
from .verify import fuzzy_pass, verify_greedy, verify_lossless


class Rounds:
    def __init__(self, engine, batch: Batch, prompts, keys, results, on_round=None, params=None):
        self.e = engine
        self.on_round = on_round
        self.b = batch
        self.prompts = prompts
        self.keys = keys
        self.results = results
        self.params = params or [engine.sampling] * len(prompts)  # each prompt's sampling settings
        self.m = engine.spec.max_draft_tokens if engine.spec.method != "none" else 0
        self.random = not all(sp.greedy for sp in self.params)  # some row samples: rounds draw uniforms

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
            p, sp = self.prompts[i], self.params[i]
            gen = None if sp.greedy else torch.Generator().manual_seed(row_seed(sp.seed, self.keys[i]))
            result = SampleResult(key=self.keys[i], prompt_tokens=len(p), verification=self.e.spec.verification)
            b.rows[slot] = _Row(i, result, list(p), gen, now, sp)
            b.sp.set(slot, sp)
        top = b.prefill_target(start, end, b.proposer.prefill_top)
        b.proposer.admit(start, end, top)
        b.policy.admit(start, end)
        b.n = end

    def step(self) -> None:
        b = self.b
        n, m = b.n, self.m
        rows = b.rows[:n]
        if m:
            room = np.array([r.sp.max_new_tokens - r.result.generated_tokens - 1 for r in rows], dtype=np.int64)
            limits = np.minimum(np.clip(b.policy.limits(n), 0, m), room)
        else:
            limits = np.zeros(n, dtype=np.int64)
        draft, (acc_l, new_l, len_l, bad_l), trial = self.round(n, limits)
        if trial:
            b.policy.untimed()  # a trial of a verify width: no sample of what its length costs
        b.policy.observe(n, len_l, acc_l)  # after the read-back: a GPU's round is complete
        finished, emitted_total = [], 0
        for i, row in enumerate(rows):
            res = row.result
            if bad_l[i]:  # this row's logits were NaN or inf: its tokens mean nothing from here on
                res.finish_reason = "error"
                res.error = f"non_finite_logits: the {'target' if bad_l[i] & 1 else 'draft'}'s logits held NaN or inf"
                finished.append(i)
                continue
            a = int(acc_l[i])
            emitted = new_l[i][: a + 1]
            cut = len(emitted)
            for j, t in enumerate(emitted):
                if t in self.e.stop_ids or t in row.sp.stop_token_ids:
                    cut = j + 1
                    res.finish_reason = "stop"
                    break
            if row.sp.stop:  # stop strings, on the decoded text
                hit = self.e.stop_strings.find(res.token_ids, emitted[:cut], row.sp.stop)
                if hit is not None:
                    cut, res.stop_string = hit
                    res.finish_reason = "stop"
            max_new = row.sp.max_new_tokens
            room = max_new - res.generated_tokens
            if cut >= room:
                if cut > room or res.finish_reason != "stop":
                    res.finish_reason = "length"
                cut = room
            emitted = emitted[:cut]
            res.token_ids.extend(emitted)
            row.tokens.extend(emitted)
            emitted_total += len(emitted)
            res.rounds += 1
            res.draft_forwards += draft.forwards
            res.draft_lengths.append(int(len_l[i]))
            res.accept_lengths.append(min(a, cut))
            if res.finish_reason == "stop" or res.generated_tokens >= max_new:
                finished.append(i)
        for i in reversed(finished):  # descending: the last active row is never a finished one
            self.retire(i)
        if self.on_round is not None:
            self.on_round(emitted_total)

    def round(self, n: int, limits: np.ndarray):
        """Draft (at most `limits` [n] tokens per row), verify and accept one round of rows [0, n). Returns
        the draft, the round's host read-back (accepted, tokens, draft lengths, non-finite flags) and whether
        verification ran at a width only to time it."""
        u = self.uniforms(n)
        draft = self.b.proposer.propose(n, limits) if self.m else Draft.empty(n, self.b.device)
        k = draft.tokens.shape[1]
        widths = self.e.widths if draft.parent is None else None  # a tree's forward is as wide as the tree
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
        (as lists; stale past a + 1), of the draft lengths [n] and of non-finite logits per row (bit 1: the
        target's, bit 2: the draft's)."""
        b, e = self.b, self.e
        dev, k = b.device, draft.tokens.shape[1]
        t_verify = time.perf_counter()
        lens = b.lens[:n].copy()
        seq_len = b.to_device(lens)
        ar = torch.arange(n, device=dev)
        pending = b.seq[ar, seq_len - 1]
        tokens_in = torch.cat([pending[:, None], draft.tokens], dim=1)  # [n, k+1]
        kv_len = int(lens.max()) - 1 + width
        if draft.parent is None:  # chains, padded with junk to `width`
            tokens_in = torch.nn.functional.pad(tokens_in, (0, width - k - 1))
            positions = (seq_len - 1)[:, None] + torch.arange(width, device=dev)[None, :]
            logits, _ = b.target.step(tokens_in, positions, kv_len)
        else:  # token trees: node j at slot base + j, position base + depth, seeing its ancestors
            positions, slots, mask = trees.tree_inputs(draft.parent, draft.depth, seq_len - 1, kv_len, draft.max_depth)
            logits, _ = b.target.step(tokens_in, positions, kv_len, slots=slots, mask=mask)
        logits = logits[:, : k + 1, : e.vocab_size]  # [n, k+1, vocab]
        bad = (~torch.isfinite(logits).flatten(1).all(1)).to(torch.int64)  # 1: the target's logits are not finite
        if draft.bad is not None:
            bad = bad | (draft.bad.to(torch.int64) << 1)  # 2: the draft's
        accepted, next_token, path = self.verdict(logits, draft, u)

        new = draft.tokens
        if path is not None:  # keep the accepted path: its tokens, and its keys and values moved into place
            d = path.shape[1]
            base = (seq_len - 1)[:, None]
            b.target.cache.move_slots(base + path, base + torch.arange(1, d + 1, device=dev)[None, :])
            new = draft.tokens.gather(1, (path - 1).clamp(min=0))
        new = torch.cat([new, torch.zeros((n, 1), dtype=torch.int64, device=dev)], dim=1)
        new.scatter_(1, accepted[:, None], next_token[:, None])  # x_1..x_a, y, (stale)
        write_pos = (seq_len[:, None] + torch.arange(new.shape[1], device=dev)[None, :]).clamp(max=b.max_len - 1)
        b.seq[:n].scatter_(1, write_pos, new)

        out = torch.cat([accepted[:, None], draft.lengths[:, None], bad[:, None], new], dim=1).cpu().numpy()  # the read-back
        accepted_h, lengths_h = out[:, 0], out[:, 1]
        b.lens[:n] = lens + accepted_h + 1
        b.proposer.commit(n, lens, accepted_h)
        if e.widths:
            e.widths.observe(n, width, time.perf_counter() - t_verify)
        return accepted_h, out[:, 3:].tolist(), lengths_h, out[:, 2]

    def verdict(self, logits: torch.Tensor, draft: Draft, u: torch.Tensor | None):
        """The verification rule of this engine for `draft`: accepted [n], the next token [n], and for a token
        tree its accepted path [n, depth] (None for chains). Prompt lookup goes through the tree rule (a chain
        is a tree) so that conditional verification applies to it; the draft model's tokens through the
        lossless rule, with FSD's close tokens passing outright under `verification: fuzzy`."""
        spec, m = self.e.spec, self.m
        rows = self.b.sp.view(logits.shape[0])
        n, k = draft.tokens.shape
        if draft.parent is not None or spec.method == "prompt_lookup":
            if draft.parent is None:
                parent, depth = trees.chain(n, k, logits.device)
                d = k
            else:
                parent, depth, d = draft.parent, draft.depth, draft.max_depth
            v = trees.verify_tree(logits, draft.tokens, parent, depth, draft.lengths, d, rows,
                                  None if u is None else u[:, m : m + d + 1], draft.relaxed, spec.conditional_rule)
            return v.accepted, v.next_token, (v.path if draft.parent is not None else None)
        also = None  # tokens accepted outright: fuzzy verification's close distributions
        if spec.fuzzy_rule is not None and k:
            rule = spec.fuzzy_rule
            also = fuzzy_pass(logits, draft.raw_q, rule.divergence, rule.threshold)
        greedy = verify_greedy(logits, draft.tokens, draft.lengths, also) if rows.any_greedy else None
        if rows.greedy:
            return greedy.accepted, greedy.next_token, None
        p = sampling.probs(logits, rows)
        v = verify_lossless(p, draft.tokens, draft.lengths, draft.q_probs, u[:, m : m + k], u[:, 2 * m], also)
        if greedy is None:
            return v.accepted, v.next_token, None
        g = rows.greedy_rows  # a mixed batch: each row by its own rule
        return torch.where(g, greedy.accepted, v.accepted), torch.where(g, greedy.next_token, v.next_token), None

    def retire(self, slot: int) -> None:
        b = self.b
        row = b.rows[slot]
        row.result.wall_s = time.perf_counter() - row.t0
        if row.result.finish_reason not in ("stop", "length", "error"):
            row.result.finish_reason = "length"
        self.results[row.index] = row.result
        b.policy.retire(slot)
        last = b.n - 1
        b.move_row(last, slot)
        b.rows[last] = None
        b.n = last
