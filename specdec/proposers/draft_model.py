"""A small causal LM as drafter, with its own ragged KV cache.

Per round a row first feeds the tokens its draft cache has not seen (the pending token, plus the last
accepted draft token after a fully accepted round: 1 or 2 tokens, more after rounds without
speculation, the whole row if it joined while the policy was not drafting), then drafts one token per
forward. Rows whose policy stopped them keep riding along in the batch forward (their extra tokens
are not proposed), so the whole batch stays one tensor. What the draft cache holds of each row is
host state (`d_len`), updated from the round's read-back: drafting never waits on the device, unless
the policy stops rows on the draft's outputs (`stops_early`).
"""

from __future__ import annotations

import numpy as np
import torch

from .. import sampling
from ..runner import ModelRunner
from .base import Draft, Proposer


def _full_vocab(q: torch.Tensor | None, vocab: int) -> torch.Tensor | None:
    """q over the target's vocabulary: zero past the draft's (`draft_vocab`)."""
    if q is None or q.shape[-1] >= vocab:
        return q
    return torch.nn.functional.pad(q, (0, vocab - q.shape[-1]))


class DraftModelProposer(Proposer):
    deterministic = False

    def __init__(self, batch, runner: ModelRunner):
        super().__init__(batch)
        self.runner = runner
        self.d_len = batch.slots.add_host("draft_len")  # tokens of the row held in the draft cache
        self.fed_len = batch.slots.add_host("draft_fed")  # after propose(): what the cache will hold if all pass

    def admit(self, start: int, end: int, target_top=None) -> None:
        b = self.batch
        if b.policy.drafts_soon(end):
            self.d_len[start:end] = b.prefill(self.runner, start, end)
        else:  # no speculation for now: the first drafting round's catch-up feeds the whole row
            self.d_len[start:end] = 0

    def propose(self, n: int, limits: np.ndarray) -> Draft:
        b = self.batch
        dev = b.device
        k_max = int(limits.max()) if n else 0
        if k_max == 0:
            self.fed_len[:n] = self.d_len[:n]
            return Draft.empty(n, dev)
        lens, d_len = b.lens[:n], self.d_len[:n]
        # catch-up: feed seq[d_len : seq_len] (ragged, right-padded), score each row's last real token
        behind = lens - d_len  # >= 1
        t0 = int(behind.max())
        catch = b.to_device(np.stack([d_len, behind - 1]))  # one copy: [2, n]
        idx = catch[0][:, None] + torch.arange(t0, device=dev)[None, :]  # [n, t0]
        tokens_in = b.seq[:n].gather(1, idx.clamp(max=b.max_len - 1))
        logits, h = self.runner.step(tokens_in, idx, int((d_len + t0).max()), last=catch[1])
        forwards = 1

        policy = b.policy
        stops = policy.stops_early
        limits_dev = b.to_device(limits) if stops or limits.min() != k_max else None
        active = limits_dev > 0 if stops else None  # rows still drafting (only tracked if rows stop early)
        lengths = torch.zeros(n, dtype=torch.int64, device=dev) if stops else None
        seq_len = b.to_device(lens) if k_max > 1 else None
        tokens, qs, raws = [], [], []
        rows = b.sp.view(n)
        fuzzy = b.spec.verification == "fuzzy"
        fed = 0  # drafted tokens fed back into the draft this round
        bad = torch.zeros(n, dtype=torch.bool, device=dev)  # non-finite draft logits (the row fails)
        for step in range(k_max):
            bad |= ~torch.isfinite(logits).all(-1)
            if rows.greedy:
                x = logits.argmax(-1)
                q = sampling.probs(logits, rows) if policy.uses_draft_probs else None
            else:  # each row by its own settings; greedy rows of a mixed batch take the argmax
                q = sampling.probs(logits, rows)
                x = sampling.choose(logits, q, b.u_draft[:n, step], rows)
                qs.append(q)
            tokens.append(x)
            if fuzzy:  # FSD compares the models' raw distributions
                raws.append(torch.softmax(logits.float(), dim=-1))
            if stops:
                lengths += active
                token_prob = q.gather(1, x[:, None]).squeeze(1) if q is not None else None
                active &= limits_dev > step + 1
                if not policy.keep_after_feed:
                    keep = policy.keep(step, token_prob, h)
                    if keep is not None:
                        active &= keep
                if step + 1 == k_max or not bool(active.any()):  # a host sync: rows stop on the draft's outputs
                    break
            elif step + 1 == k_max:
                break
            pos = (seq_len + step)[:, None]  # x_{step+1} sits right after the pending token's run
            logits, h = self.runner.step(x[:, None], pos, int(lens.max()) + step + 1)
            logits, h = logits[:, 0], h[:, 0]
            forwards += 1
            fed += 1
            if stops and policy.keep_after_feed:  # e.g. the acceptance head reads h after x was fed
                keep = policy.keep(step, token_prob, h)
                if keep is not None:
                    active &= keep
                if not bool(active.any()):
                    break

        self.fed_len[:n] = lens + fed
        k = len(tokens)
        draft_tokens = torch.stack(tokens, dim=1)
        if not stops:
            lengths = limits_dev if limits_dev is not None else torch.full((n,), k, dtype=torch.int64, device=dev)
        else:
            draft_tokens = draft_tokens[:, :k]
        q_probs = torch.stack(qs, dim=1)[:, :k] if qs else None
        raw_q = torch.stack(raws, dim=1)[:, :k] if raws else None
        q_probs, raw_q = (_full_vocab(q, b.vocab_size) for q in (q_probs, raw_q))
        return Draft(draft_tokens, lengths, q_probs, forwards, bad, max_depth=k, raw_q=raw_q)

    def commit(self, n: int, old_len: np.ndarray, accepted: np.ndarray) -> None:
        # the draft cache is right up to the last accepted draft token it was fed
        self.d_len[:n] = np.minimum(self.fed_len[:n], old_len + accepted)

    def rewind(self, n: int) -> None:
        # the pending token is never in it
        self.d_len[:n] = np.minimum(self.d_len[:n], self.batch.lens[:n] - 1)

    def move_row(self, src: int, dst: int) -> None:
        self.runner.cache.move_row(src, dst, int(self.d_len[src]))
