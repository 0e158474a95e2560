"""A small causal LM as drafter, with its own ragged KV cache.

Per round a row first feeds the tokens its draft cache has not seen (the pending token, plus the last
accepted draft token after a fully accepted round: 1 or 2 tokens, more after rounds without
speculation, the whole row if it joined while the policy was not drafting), then drafts one token per
forward. Rows whose policy stopped them keep riding along in the batch forward (their extra tokens
are not proposed), so the whole batch stays one tensor. What the draft cache holds of each row is
host state (`d_len`), updated from the round's read-back, and device state (`d_len_dev`), advanced as
the round is queued: drafting never waits on the device, and a round can be drafted before the one before it is
read back (`drafts_ahead`: the catch-up's tokens and positions come from the device's lengths). A policy that stops
rows on the draft's outputs (its `stopper`) ends the draft steps once every row stopped, a host read per step; a
round queued ahead runs them to the limit instead, where that pays (`ahead_pays`: not on a CPU, whose reads cost
nothing), its rows' lengths the same, counted on the device. A stopper that
reads the state after a token was fed back (SpecDec++'s head) decides once that forward ran, and its
logits give the row's next token for free: the row proposes it too, as SpecDec++'s reference does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from ...exec.cache import PagedKVCache
from ...exec.inputs import to_device
from .. import sampling
from ..draft import Draft
from ..verify import scan
from .base import Proposer

if TYPE_CHECKING:
    from ...exec.prefill import Prefiller
    from ...plan.policies import LengthPolicy
    from ...sched.slots import Slots
    from ..grammar import Constraints
    from ..sampling import Draws, Rows


def _full_vocab(q: torch.Tensor | None, vocab: int) -> torch.Tensor | None:
    """q over the target's vocabulary: zero past the draft's (`draft_vocab`)."""
    if q is None or q.shape[-1] >= vocab:
        return q
    return torch.nn.functional.pad(q, (0, vocab - q.shape[-1]))


class DraftModelProposer(Proposer):
    """Drafts with the model whose cache rows `prefill` fills (its runner, prefix store and chunk), over the
    target's `vocab_size`; `constraints`: the rows' output formats, when some row may have one."""

    def __init__(self, slots: Slots, prefill: Prefiller, policy: LengthPolicy, vocab_size: int,
                 constraints: Constraints | None = None, raw_q: bool = False):
        super().__init__(slots)
        self.prefill, self.runner = prefill, prefill.runner
        self.vocab_size, self.constraints = vocab_size, constraints
        self.stopper = policy.stopper  # stops rows on the draft's outputs (None: every row drafts its limit)
        self.raw_q = raw_q  # keep the draft's raw distributions (fuzzy verification compares them)
        self.d_len = slots.add_host("draft_len")  # tokens of the row held in the draft cache
        self.d_len_dev = slots.add("draft_len_dev")  # the same on the device (ahead by a round in flight)
        slots.add_cache(self.runner.cache, self.d_len)

    def admit(self, start: int, end: int, target_top_ids=None, drafting: bool = True) -> None:
        shared = isinstance(self.runner.cache, PagedKVCache) and self.prefill.store is not None
        if drafting or shared:  # a paged pool's rows share the draft's prefix blocks once its store holds them
            self.d_len[start:end] = self.fill(start, end)
        else:  # no speculation for now: the first drafting round's catch-up feeds the whole row
            self.d_len[start:end] = 0
        self._to_device(start, end)

    def _to_device(self, start: int, end: int) -> None:
        self.d_len_dev[start:end] = to_device(self.d_len[start:end], self.slots.device)

    def fill(self, start: int, end: int, have: np.ndarray | None = None) -> np.ndarray:
        """The draft caches all but the pending token of rows [start, end), after the `have` slots each holds
        (None: none) and what its prefix store gives (specdec/exec/prefill.py); returns their cached lengths."""
        s, cached = self.slots, self.slots.lens[start:end] - 1
        self.prefill.run(self.prefill.plan(start, s.history[start:end], s.prompt_lens[start:end], cached, have))
        return cached

    def catch_up(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed each row what its draft cache lacks, seq[d_len : seq_len] (ragged, right-padded); returns the
        logits [n, vocab] and hidden states [n, d] at each row's last token. Rows that joined while the policy
        did not draft (an empty draft cache) take what the draft's prefix store holds of them, and more tokens
        than the batch's `prefill_chunk` go in chunks: both by a prefill of all but the last, then the last alone."""
        s, chunk = self.slots, self.prefill.chunk
        lens, d_len = s.lens[:n], self.d_len[:n]
        if not s.in_flight and (self.needs_fill(n) or (chunk and n * int((lens - d_len).max(initial=0)) > chunk)):
            d_len[:] = self.fill(0, n, have=d_len)
            self._to_device(0, n)
        # what each row lacks (>= 1: at least the pending token), at most: a round in flight grew rows by up to
        # `in_flight` tokens, and after a drafting round a row lacks its pending token and at most one more
        t0 = 2 if s.in_flight_drafted else int((lens + s.in_flight - d_len).max())
        have = self.d_len_dev[:n]
        idx = have[:, None] + s.span(0, t0)[None, :]  # [n, t0]
        tokens_in = s.seq[:n].gather(1, idx.clamp(max=s.max_len - 1))
        kv_len = int(lens.max()) + s.in_flight + 1 if s.in_flight else int((d_len + t0).max())
        return self.runner.step(tokens_in, idx, kv_len, last=s.lens_dev[:n] - have - 1)

    def needs_fill(self, n: int) -> bool:
        """Some row's draft cache is empty while the prefix store may hold its prompt: a prefill fills it."""
        return self.prefill.store is not None and not self.d_len[:n].all()

    def drafts_ahead(self, n: int) -> bool:
        """No stopper reads the draft's outputs (or drafting to the limit pays: `ahead_pays`), no output format
        constrains it, and every row's draft cache holds its prompt: the catch-up is a step of a few tokens over the
        device's lengths."""
        return (self.stopper is None or self.ahead_pays) and \
            (self.constraints is None or not self.constraints.rows(n)) and bool(self.d_len[:n].all())

    def propose(self, n: int, limits: np.ndarray, rows: Rows, draws: Draws, siblings: int | None = None) -> Draft:
        s, stop, dev = self.slots, self.stopper, self.slots.device
        k_max = int(limits.max()) if n else 0
        if k_max == 0:
            return Draft.empty(n, dev)
        logits, h = self.catch_up(n)
        forwards = 1
        noise, u = draws.noise, draws.draft
        choice = rows if noise is None else sampling.as_greedy(rows)  # coupled: argmax of perturbed logits
        lens = s.lens[:n]
        limits_dev = to_device(limits, dev) if stop is not None or limits.min() != k_max else None
        if s.in_flight:  # the host's room is a round old: each row drafts within what the device says is left
            room = (s.ends_dev[:n] - s.lens_dev[:n] - 1).clamp(min=0)
            limits_dev = room.clamp(max=k_max) if limits_dev is None else torch.minimum(limits_dev, room)
        active = limits_dev > 0 if stop is not None else None  # rows still drafting (tracked if rows stop early)
        lengths = torch.zeros(n, dtype=torch.int64, device=dev) if stop is not None else None
        if stop is not None:
            stop.start(n)
        seq_len = s.lens_dev[:n] if k_max > 1 else None  # the device's: a round in flight may have grown them
        grammar = self.constraints if self.constraints is not None and self.constraints.rows(n) else None
        tokens, qs, raws, drawn = [], [], [], []
        non_finite = torch.zeros(n, dtype=torch.bool, device=dev)  # the row fails
        free = None  # rows a stopper reading fed states stopped: the forward that fed their token drew one more
        for step in range(k_max):
            plain = grammar is None and noise is None and choice.greedy  # the token is the raw logits' argmax
            if plain:
                best, finite = scan(logits)  # the argmax and the non-finite check in one pass
            else:
                best, finite = None, torch.isfinite(logits.amax(-1))
            non_finite |= ~finite
            if grammar is not None:  # constrained rows draw from their masked logits (q is that distribution)
                logits = logits.masked_fill(~grammar.draft_mask(n, logits.shape[-1]), float("-inf"))
            if noise is not None:  # coupled: the noise of the position this step drafts
                logits = sampling.coupled(logits, rows, _fit(noise[:, step], logits.shape[-1]))
            # q: the processed distribution each row's token is drawn from (greedy rows: their argmax)
            q = sampling.probs(logits, choice) if not choice.greedy or (stop is not None and stop.needs_probs) else None
            x = best if plain else sampling.choose(logits, q, None if u is None else u[:, step], choice)
            tokens.append(x)
            if grammar is not None:  # a host sync per draft step: each row's grammar follows its draft
                drawn.append(x.tolist())
                grammar.advance(n, drawn[-1])
            if not choice.greedy:
                qs.append(q)
            if self.raw_q:
                raws.append(torch.softmax(logits.float(), dim=-1))
            if stop is not None:
                lengths += active if free is None else active | free
                free = None
                token_prob = q.gather(1, x[:, None]).squeeze(1) if q is not None else None
                active &= limits_dev > step + 1
                if not stop.after_feed:
                    active &= stop.keep(step, token_prob, h)
                if step + 1 == k_max or (not s.in_flight and not bool(active.any())):  # a host read, unless ahead
                    break
            elif step + 1 == k_max:
                break
            # feed x back: it sits right after the pending token's run
            logits, h = self.runner.step(x[:, None], (seq_len + step)[:, None],
                                         int(lens.max()) + s.in_flight + step + 1)
            logits, h = logits[:, 0], h[:, 0]
            forwards += 1
            if stop is not None and stop.after_feed:  # e.g. the acceptance head reads h after x was fed
                keep = stop.keep(step, token_prob, h)
                free = active & ~keep  # SpecDec++ keeps the token this forward draws for them: the next step's
                active &= keep
        k = len(tokens)
        if grammar is not None:
            grammar.rollback(n)
        if stop is None:
            lengths = limits_dev if limits_dev is not None else torch.full((n,), k, dtype=torch.int64, device=dev)
        q_probs = _full_vocab(torch.stack(qs, dim=1), self.vocab_size) if qs else None
        raw_q = _full_vocab(torch.stack(raws, dim=1), self.vocab_size) if raws else None
        host = np.array(drawn, dtype=np.int64).T if drawn else None
        return Draft(torch.stack(tokens, dim=1), lengths, q_probs, forwards=forwards, non_finite=non_finite,
                     raw_q=raw_q, host_tokens=host)

    def advance(self, n: int, old_len: torch.Tensor, accepted: torch.Tensor, forwards: int) -> None:
        if forwards:  # the catch-up fed up to the pending token, each later forward one drafted token more
            torch.minimum(old_len + (forwards - 1), old_len + accepted, out=self.d_len_dev[:n])

    def commit(self, n: int, old_len: np.ndarray, accepted: np.ndarray, forwards: int) -> None:
        # the draft cache is right up to the last accepted draft token it was fed
        if forwards:
            self.d_len[:n] = np.minimum(old_len + forwards - 1, old_len + accepted)

    def rewind(self, n: int) -> None:
        # the pending token is never in it
        self.d_len[:n] = np.minimum(self.d_len[:n], self.slots.lens[:n] - 1)
        self._to_device(0, n)


def _fit(noise: torch.Tensor, vocab: int) -> torch.Tensor:
    """Noise [n, target vocab] cut or zero-padded to the draft's vocab (the same token ids)."""
    return noise[:, :vocab] if noise.shape[-1] >= vocab else torch.nn.functional.pad(noise, (0, vocab - noise.shape[-1]))
