"""A small causal LM as drafter, with its own ragged KV cache.

Per round a row first feeds the tokens its draft cache has not seen (the pending token, plus the last
accepted draft token after a fully accepted round: 1 or 2 tokens, more after rounds without
speculation, the whole row if it joined while the policy was not drafting), then drafts one token per
forward. Rows whose policy stopped them keep riding along in the batch forward (their extra tokens
are not proposed), so the whole batch stays one tensor. What the draft cache holds of each row is
host state (`d_len`), updated from the round's read-back: drafting never waits on the device, unless
the policy stops rows on the draft's outputs (its `stopper`). A stopper that reads the state after a
token was fed back (SpecDec++'s head) decides once that forward ran, and its logits give the row's
next token for free: the row proposes it too, as SpecDec++'s reference does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from .. import sampling
from ...exec.cache import PagedKVCache
from ..verify import scan
from .base import Draft, Proposer

if TYPE_CHECKING:
    from ...sched.batch import Batch
    from ...plan.policies import LengthPolicy
    from ...exec.runner import ModelRunner
    from ..sampling import Draws, Rows


def _full_vocab(q: torch.Tensor | None, vocab: int) -> torch.Tensor | None:
    """q over the target's vocabulary: zero past the draft's (`draft_vocab`)."""
    if q is None or q.shape[-1] >= vocab:
        return q
    return torch.nn.functional.pad(q, (0, vocab - q.shape[-1]))


class DraftModelProposer(Proposer):
    def __init__(self, batch: Batch, runner: ModelRunner, policy: LengthPolicy, raw_q: bool = False):
        super().__init__(batch)
        self.runner = runner
        self.stopper = policy.stopper  # stops rows on the draft's outputs (None: every row drafts its limit)
        self.raw_q = raw_q  # keep the draft's raw distributions (fuzzy verification compares them)
        self.d_len = batch.slots.add_host("draft_len")  # tokens of the row held in the draft cache
        self.fed_len = batch.slots.add_host("draft_fed")  # after propose(): what the cache will hold if all pass
        batch.slots.add_cache(runner.cache, self.d_len)

    def admit(self, start: int, end: int, target_top_ids=None, drafting: bool = True) -> None:
        b = self.batch
        shared = isinstance(self.runner.cache, PagedKVCache) and b.prefixes is not None and b.prefixes["draft"]
        if drafting or shared:  # a paged pool's rows share the draft's prefix blocks once its store holds them
            self.d_len[start:end] = b.prefill(self.runner, start, end)
        else:  # no speculation for now: the first drafting round's catch-up feeds the whole row
            self.d_len[start:end] = 0

    def catch_up(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed each row what its draft cache lacks, seq[d_len : seq_len] (ragged, right-padded); returns the
        logits [n, vocab] and hidden states [n, d] at each row's last token. Rows that joined while the policy
        did not draft (an empty draft cache) take what the draft's prefix store holds of them, and more tokens
        than the batch's `prefill_chunk` go in chunks: both by a prefill of all but the last, then the last alone."""
        b = self.batch
        lens, d_len = b.lens[:n], self.d_len[:n]
        stored = b.prefixes is not None and b.prefixes["draft"] is not None and not d_len.all()
        if stored or (b.prefill_chunk and n * int((lens - d_len).max(initial=0)) > b.prefill_chunk):
            d_len[:] = b.prefill(self.runner, 0, n, "draft", done=d_len)
        behind = lens - d_len  # >= 1: at least the pending token
        t0 = int(behind.max())
        catch = b.to_device(np.stack([d_len, behind - 1]))  # one copy: [2, n]
        idx = catch[0][:, None] + torch.arange(t0, device=b.device)[None, :]  # [n, t0]
        tokens_in = b.seq[:n].gather(1, idx.clamp(max=b.max_len - 1))
        return self.runner.step(tokens_in, idx, int((d_len + t0).max()), last=catch[1])

    def propose(self, n: int, limits: np.ndarray, rows: Rows, draws: Draws, siblings: int | None = None) -> Draft:
        b, stop = self.batch, self.stopper
        k_max = int(limits.max()) if n else 0
        self.fed_len[:n] = self.d_len[:n]
        if k_max == 0:
            return Draft.empty(n, b.device)
        logits, h = self.catch_up(n)
        forwards = 1
        noise, u = draws.noise, draws.draft
        choice = rows if noise is None else sampling.as_greedy(rows)  # coupled: argmax of perturbed logits
        lens = b.lens[:n]
        self.fed_len[:n] = lens  # the catch-up fed up to the pending token
        limits_dev = b.to_device(limits) if stop is not None or limits.min() != k_max else None
        active = limits_dev > 0 if stop is not None else None  # rows still drafting (tracked if rows stop early)
        lengths = torch.zeros(n, dtype=torch.int64, device=b.device) if stop is not None else None
        if stop is not None:
            stop.start(n)
        seq_len = b.to_device(lens) if k_max > 1 else None
        grammar = b.constraints if b.constraints is not None and b.constraints.rows(n) else None
        tokens, qs, raws, drawn = [], [], [], []
        non_finite = torch.zeros(n, dtype=torch.bool, device=b.device)  # the row fails
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
                if step + 1 == k_max or not bool(active.any()):  # a host sync: rows stop on the draft's outputs
                    break
            elif step + 1 == k_max:
                break
            # feed x back: it sits right after the pending token's run
            logits, h = self.runner.step(x[:, None], (seq_len + step)[:, None], int(lens.max()) + step + 1)
            logits, h = logits[:, 0], h[:, 0]
            forwards += 1
            self.fed_len[:n] = lens + step + 1
            if stop is not None and stop.after_feed:  # e.g. the acceptance head reads h after x was fed
                keep = stop.keep(step, token_prob, h)
                free = active & ~keep  # SpecDec++ keeps the token this forward draws for them: the next step's
                active &= keep
        k = len(tokens)
        if grammar is not None:
            grammar.rollback(n)
        if stop is None:
            lengths = limits_dev if limits_dev is not None else torch.full((n,), k, dtype=torch.int64, device=b.device)
        q_probs = _full_vocab(torch.stack(qs, dim=1), b.vocab_size) if qs else None
        raw_q = _full_vocab(torch.stack(raws, dim=1), b.vocab_size) if raws else None
        host = np.array(drawn, dtype=np.int64).T if drawn else None
        return Draft(torch.stack(tokens, dim=1), lengths, q_probs, forwards=forwards, non_finite=non_finite,
                     raw_q=raw_q, host_tokens=host)

    def commit(self, n: int, old_len: np.ndarray, accepted: np.ndarray) -> None:
        # the draft cache is right up to the last accepted draft token it was fed
        self.d_len[:n] = np.minimum(self.fed_len[:n], old_len + accepted)

    def rewind(self, n: int) -> None:
        # the pending token is never in it
        self.d_len[:n] = np.minimum(self.d_len[:n], self.batch.lens[:n] - 1)


def _fit(noise: torch.Tensor, vocab: int) -> torch.Tensor:
    """Noise [n, target vocab] cut or zero-padded to the draft's vocab (the same token ids)."""
    return noise[:, :vocab] if noise.shape[-1] >= vocab else torch.nn.functional.pad(noise, (0, vocab - noise.shape[-1]))
