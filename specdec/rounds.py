"""Rounds: admitting prompts into a batch, and the draft -> verify -> accept loop over its rows.

Per round, over the active rows [0, n) (a row's last token is "pending": emitted, not yet in the
target's cache):
  limits  = policy.plan(batch)                how many tokens each row may draft
  draft   = proposer.propose(limits)          x_1..x_k per row (or a token tree), and q
  logits  = target([pending, x_1..x_k])       one forward scores every drafted position
  verdict = rule(logits, draft)               accepted a, and the recovered / bonus token y
  emit x_1..x_a, y; cut at a stop token, a stop string or max_new_tokens; finished rows leave
A round reads the device back once, at the end of `verify`; everything the host needs before that
(lengths, K) it already knows. Rows with an output format (specdec/grammar.py) are verified under its
masks, and then take the tokens it allows alone (jump-forward): the target reads those in the next
round's forward, which then starts up to `lag` tokens before each row's pending token.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from . import sampling, trees
from .verify import scan
from .batch import Batch, Row
from .config import SampleResult, SamplingParams, row_seed
from .policies import BatchView, LengthPolicy, RoundResult
from .proposers.base import Draft

if TYPE_CHECKING:
    from .engine import SpecEngine


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
    """A round's results on the host, per row of [0, n)."""

    accepted: np.ndarray  # [n] drafted tokens accepted
    drafted: np.ndarray  # [n] tokens (tree nodes) proposed
    bad: np.ndarray  # [n] non-finite logits: bit 1 the target's, bit 2 the draft's
    tokens: list[list[int]]  # per row x_1..x_a, y (stale past a + 1)
    logprobs: np.ndarray | None = None  # [n, a + 1 ...] of each token where it was drawn (rows asked for them)
    top: tuple[np.ndarray, np.ndarray] | None = None  # ids and logprobs [n, a + 1 ..., K] of the top tokens there


class Rounds:
    def __init__(self, engine: SpecEngine, batch: Batch, policy: LengthPolicy, requests: list[Request],
                 results: list[SampleResult | None], on_round=None):
        self.e, self.b, self.policy = engine, batch, policy
        self.requests, self.results = requests, results
        self.on_round = on_round
        self.m = engine.spec.max_draft_tokens if engine.spec.method != "none" else 0
        self.random = not all(r.sp.greedy for r in requests)  # some row samples: rounds draw uniforms
        self.coupled = self.random and engine.spec.sampling == "coupled"  # ... or Gumbel noise by position
        self.top = max((r.sp.top_logprobs for r in requests if r.sp.logprobs), default=-1)  # -1: no logprobs
        self.waiting = self.joined = 0

    def run(self, queue: deque) -> None:
        b = self.b
        while queue or b.n:
            if queue and b.n < b.capacity:
                self.admit([queue.popleft() for _ in range(min(b.capacity - b.n, len(queue)))], len(queue))
            self.round()

    def admit(self, indices: list[int], waiting: int = 0) -> None:
        """Requests `indices` join the batch. One sample of each prompt is prefilled; the others copy its
        caches (they sit after all the prefilled rows, so that these are contiguous). With prefix caching, a
        prefilled row takes the blocks the store holds of its prompt, and rows that share blocks not stored yet
        with an earlier row are prefilled after it, once its blocks are stored: a shared prefix is computed once."""
        b, now = self.b, time.perf_counter()
        first: dict[int, int] = {}  # group -> its prefilled request
        for i in indices:
            first.setdefault(self.requests[i].group, i)
        lead = list(first.values())
        store = b.prefixes["target"] if b.prefixes is not None else None
        later = store.followers([self.requests[i].prompt for i in lead],
                                [len(self.requests[i].prompt) - 1 for i in lead]) if store else [False] * len(lead)
        # rows sharing a prefix not stored yet with a row before them go after the others, once those are stored
        lead = [i for i, f in zip(lead, later) if not f] + [i for i, f in zip(lead, later) if f]
        order = lead + [i for i in indices if i not in set(lead)]
        start, mid, end = b.n, b.n + len(lead), b.n + len(order)
        rows = []
        for i in order:
            r = self.requests[i]
            gen = None if r.sp.greedy else torch.Generator().manual_seed(row_seed(r.sp.seed, r.key, r.sample))
            result = SampleResult(key=r.key, prompt_tokens=len(r.prompt), sample_index=r.sample,
                                  verification=self.e.rule.name)
            rows.append(Row(i, result, list(r.prompt), gen, now, r.sp))
        b.write_rows(start, rows)
        self.waiting, self.joined = waiting, self.joined + len(order)
        view = self.view(end)
        drafting = self.policy.drafts_soon(view)
        wide = drafting and b.proposer.prefill_top and self.policy.widens_soon(view)
        split = mid if wide else mid - sum(later)  # top ids are computed at every position: no stored prefix
        for lo, hi in ((start, split), (split, mid)):
            if hi > lo:
                top, reused = b.prefill_target(lo, hi, b.proposer.prefill_top if wide else 0)
                b.proposer.admit(lo, hi, top, drafting=drafting)
                for slot, n in zip(range(lo, hi), reused):
                    b.rows[slot].result.cached_prompt_tokens = int(n)
        for slot in range(mid, end):
            b.copy_row(start + lead.index(first[self.requests[order[slot - start]].group]), slot)
            b.rows[slot].result.cached_prompt_tokens = int(b.cached[slot])  # the whole prompt, copied
        b.n = end
        if b.constraints is not None:
            for slot, i in zip(range(start, end), order):
                fmt = self.requests[i].sp.grammar
                b.constraints.matchers[slot] = None if fmt is None else self.e.grammars.matcher(fmt)
            self.jump_forward(range(start, end))

    def view(self, n: int, reach: bool = False) -> BatchView:
        """What the policy sees of rows [0, n); `reach`: with how deep each row can draft now (before a round)."""
        return BatchView(n, self.waiting, self.joined, self.b.proposer.reach(n) if reach else None)

    def limits(self, n: int) -> np.ndarray:
        """[n] host: the tokens each row may draft this round (the policy's plan, within max_draft_tokens and
        the row's room before max_new_tokens)."""
        if not self.m:
            return np.zeros(n, dtype=np.int64)
        room = np.array([r.sp.max_new_tokens - r.result.generated_tokens - 1 for r in self.b.rows[:n]])
        plan = self.policy.plan(self.view(n, reach=True))
        self.joined = 0
        return np.minimum(np.clip(plan, 0, self.m), room)

    def round(self) -> None:
        """One round of the active rows: plan, propose, verify (one read-back), finish rows."""
        b, n = self.b, self.b.n
        limits = self.limits(n)
        t0 = self.e.clock()
        u = self.randomness(n, int(limits.max(initial=0)) + 1)  # [n, 2M + 1] or None: the draft's M, the rule's M + 1
        draft = b.proposer.propose(n, limits, None if u is None else u[:, : self.m], self.policy.siblings)
        widths = self.e.widths if draft.tree is None else None  # a tree's forward is as wide as the tree
        k = draft.tokens.shape[1]
        trial = widths is not None and widths.untimed(n, k + 1) is not None  # a width timed, not a K's cost
        out = self.verify(n, draft, widths.choose(n, k + 1) if widths else k + 1, u)
        emitted = sum(self.finish(i, out, draft.forwards) for i in range(n))
        emitted += self.jump_forward(range(n))
        finished = np.array([b.rows[i].done for i in range(n)], dtype=bool)
        seconds = None if trial else self.e.clock() - t0
        self.policy.observe(RoundResult(n, out.drafted, out.accepted, finished, seconds, draft.host_depth))
        for i in reversed(np.flatnonzero(finished)):  # descending: the last active row is never a finished one
            self.retire(int(i))
        if self.on_round is not None:
            self.on_round(emitted)

    def randomness(self, n: int, width: int) -> torch.Tensor | None:
        """This round's uniforms (`uniforms`); coupled, the noise of rows [0, n)'s next `width` positions, kept
        in the batch for the draft and the rule."""
        self.b.noise = self.noise(n, width) if self.coupled else None
        return self.uniforms(n)

    def uniforms(self, n: int) -> torch.Tensor | None:
        """This round's uniforms of rows [0, n) (None when greedy or coupled): a fixed count per row and round, so
        a row's stream does not depend on its batch."""
        if not self.random or self.coupled:
            return None
        return sampling.uniforms([r.generator for r in self.b.rows[:n]], 2 * self.m + 1, self.b.device)

    def noise(self, n: int, width: int) -> torch.Tensor:
        """Coupled sampling's Gumbel noise [n, width, vocab] of rows [0, n)'s next `width` output positions."""
        keys = [None if r.generator is None else r.generator.initial_seed() for r in self.b.rows[:n]]
        return sampling.gumbel(keys, self.b.lens[:n], width, self.b.vocab_size, self.b.device)

    def coupled_logits(self, logits: torch.Tensor, draft: Draft, rows: sampling.Rows) -> torch.Tensor:
        """The logits [n, T+1, vocab] perturbed by each node's position's noise (a node at depth d of a row
        predicts the token at position lens + d): sampled rows' tokens are then their argmax."""
        n, k = draft.tokens.shape
        depth = (trees.with_root(draft.tree.depth) if draft.tree is not None
                 else torch.arange(k + 1, device=logits.device).expand(n, k + 1))
        width = int(depth.max()) + 1
        noise = self.b.noise
        if noise is None or noise.shape[0] != n or noise.shape[1] < width:
            noise = self.noise(n, width)
        if draft.tree is None:
            return sampling.coupled(logits, rows, noise[:, : k + 1])
        return sampling.coupled(logits, rows, noise.gather(1, depth[..., None].expand(-1, -1, noise.shape[-1])))

    def verify(self, n: int, draft: Draft, width: int, u: torch.Tensor | None) -> Readback:
        """One target forward over [pending, draft] (chains padded with junk to `width` >= k + 1), the rule's
        verdict, and acceptance: rows [0, n) grow by accepted + 1 tokens. Ends with the round's read-back."""
        b, dev, k = self.b, self.b.device, draft.tokens.shape[1]
        t0 = time.perf_counter()
        lens = b.lens[:n].copy()
        lag = int((lens - b.cached[:n]).max())  # the most tokens a row's target cache lacks (1 but after jump-forward)
        base = b.to_device(lens) - 1  # [n] the pending token's slot
        behind = (base[:, None] + torch.arange(1 - lag, 1, device=dev)[None, :]).clamp(min=0)  # [n, lag]
        tokens_in = torch.cat([b.seq[:n].gather(1, behind), draft.tokens], dim=1)  # [n, lag + k]
        kv_len = int(lens.max()) - 1 + width
        if draft.tree is None:  # chains, padded with junk to `width`
            positions = (base[:, None] + torch.arange(1 - lag, width, device=dev)[None, :]).clamp(min=0)
            logits, _ = b.target.step(torch.nn.functional.pad(tokens_in, (0, width - k - 1)), positions, kv_len)
        else:  # token trees: node j at slot base + j, position base + depth, seeing its ancestors
            t = draft.tree
            positions, slots, mask = trees.tree_inputs(t.parent, t.depth, base, kv_len, t.max_depth, lag - 1)
            logits, _ = b.target.step(tokens_in, positions, kv_len, slots=slots, mask=mask)
        logits = logits[:, lag - 1 : lag + k, : b.vocab_size]  # [n, k+1, vocab]
        best, finite = scan(logits)  # greedy's choices and the non-finite check in one pass
        bad = (~finite.all(1)).to(torch.int64)  # 1: the target's logits are not finite
        if draft.bad is not None:
            bad |= draft.bad.to(torch.int64) << 1  # 2: the draft's
        if b.constraints is not None:  # on the host while the forward runs: each row's format masks p
            self.constrain(n, draft)
        if draft.allowed is not None:
            logits = logits.masked_fill(~draft.allowed, float("-inf"))
            best = None  # the masks change the argmax
        rows = b.sp.view(n)
        if self.coupled:  # verification is argmax matching on the perturbed logits
            v = self.e.rule(self.coupled_logits(logits, draft, rows), draft, sampling.as_greedy(rows), None)
        else:
            v = self.e.rule(logits, draft, rows, None if u is None else u[:, self.m :], best)

        new = draft.tokens
        if v.path is not None:  # keep the accepted path: its tokens, and its keys and values moved into place
            ar = torch.arange(1, v.path.shape[1] + 1, device=dev)[None, :]
            b.target.cache.move_slots(base[:, None] + v.path, base[:, None] + ar)
            new = draft.tokens.gather(1, (v.path - 1).clamp(min=0))
        new = torch.cat([new, torch.zeros((n, 1), dtype=torch.int64, device=dev)], dim=1)
        new.scatter_(1, v.accepted[:, None], v.next_token[:, None])  # x_1..x_a, y, (stale)
        write = (base[:, None] + 1 + torch.arange(new.shape[1], device=dev)[None, :]).clamp(max=b.max_len - 1)
        b.seq[:n].scatter_(1, write, new)

        parts = [v.accepted[:, None], draft.lengths[:, None], bad[:, None], new]
        if self.top >= 0:
            parts.append(self.logprobs(logits, rows, new, v.path))
        host = torch.cat(parts, dim=1).cpu().numpy()  # the read-back
        w = new.shape[1]
        out = Readback(host[:, 0], host[:, 1], host[:, 2], host[:, 3 : 3 + w].tolist())
        if self.top >= 0:
            floats = host[:, 3 + w :].view(np.float64)
            out.logprobs = floats[:, :w]
            if self.top:
                out.top = (host[:, 3 + w * (2 + self.top) :].reshape(n, w, self.top),
                           floats[:, w : w * (1 + self.top)].reshape(n, w, self.top))
        b.lens[:n] = lens + out.accepted + 1
        b.cached[:n] = b.lens[:n] - 1
        b.proposer.commit(n, lens, out.accepted)
        if self.e.widths:
            self.e.widths.observe(n, width, time.perf_counter() - t0)
        return out

    def constrain(self, n: int, draft: Draft) -> None:
        """Cut each constrained row's chain to what its grammar allows, and mask every verified position."""
        g, k = self.b.constraints, draft.tokens.shape[1]
        if not g.rows(n):
            return
        host = draft.host_tokens if draft.host_tokens is not None else np.zeros((n, k), dtype=np.int64)
        full = np.full(n, k)
        if draft.tree is not None:
            draft.allowed = g.tree_masks(n, host, draft.tree.host_parent, full)
            return
        tokens = host.tolist()
        valid = g.valid_lengths(n, tokens, full)
        draft.lengths = torch.minimum(draft.lengths, self.b.to_device(valid))
        draft.allowed = g.chain_masks(n, tokens, valid, k + 1)

    def logprobs(self, logits: torch.Tensor, rows, new: torch.Tensor, path: torch.Tensor | None) -> torch.Tensor:
        """Each emitted token's logprob where it was drawn, and the top ones there, as float64 bits (int64) for
        the round's one read-back: [n, w] chosen, [n, w * K] top logprobs, [n, w * K] top ids."""
        lp = sampling.logprobs(logits, rows)  # [n, k+1, vocab]
        if path is not None:  # a tree's token j was drawn at its parent: the root, then the path's nodes
            at = torch.nn.functional.pad(path, (1, 0))[:, : new.shape[1]]
            lp = lp.gather(1, at[:, :, None].expand(-1, -1, lp.shape[-1]))
        chosen = lp.gather(2, new[:, :, None]).squeeze(2).double()
        parts = [chosen.view(torch.int64)]
        if self.top:
            values, ids = lp.topk(self.top, dim=-1)
            parts += [values.double().flatten(1).view(torch.int64), ids.flatten(1)]
        return torch.cat(parts, dim=1)

    def finish(self, i: int, out: Readback, forwards: int) -> int:
        """Row i's share of the round: its tokens and statistics. Returns how many tokens it emitted."""
        row, b = self.b.rows[i], self.b
        res = row.result
        if out.bad[i]:  # this row's logits were NaN or inf: its tokens mean nothing from here on
            res.finish_reason = "error"
            res.error = f"non_finite_logits: the {'target' if out.bad[i] & 1 else 'draft'}'s logits held NaN or inf"
            return 0
        a = int(out.accepted[i])
        tokens = out.tokens[i][: a + 1]
        lps = top = None
        if row.sp.logprobs:
            lps = out.logprobs[i, : a + 1].tolist()
            top = None if out.top is None else [list(zip(*t)) for t in zip(out.top[0][i, : a + 1].tolist(),
                                                                               out.top[1][i, : a + 1].tolist())]
        kept = self.emit(row, tokens, lps, top)
        res.rounds += 1
        res.draft_forwards += forwards
        res.draft_lengths.append(int(out.drafted[i]))
        res.accept_lengths.append(min(a, kept))
        if b.constraints is not None and not b.constraints.commit(i, tokens[:kept]):
            res.finish_reason, res.error = "error", "grammar: an emitted token left the output format"
        return kept

    def emit(self, row: Row, tokens: list[int], lps: list[float] | None = None, top=None) -> int:
        """Append `tokens` to the row, cut after a stop token, at a stop string or at max_new_tokens; their logprobs
        too, where the row asked. Returns how many were kept."""
        res = row.result
        stop = next((j for j, t in enumerate(tokens) if t in self.e.stop_ids or t in row.sp.stop_token_ids), None)
        cut = len(tokens) if stop is None else stop + 1
        if stop is not None:
            res.finish_reason = "stop"
        if row.sp.stop and (hit := self.e.stop_strings.find(res.token_ids, tokens[:cut], row.sp.stop)) is not None:
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
                                                               [: row.sp.top_logprobs] for pairs in top[:cut]]
        return cut

    def jump_forward(self, slots) -> int:
        """Rows whose output format allows exactly one next token take it (and the next, while that holds)
        without a model call; the target reads them in the next round (under every method, `none` included).
        Returns the tokens emitted."""
        b = self.b
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
