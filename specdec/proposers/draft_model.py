"""A small causal LM as drafter, with its own ragged KV cache.

Per round a row first feeds the tokens its draft cache has not seen (the pending token, plus the last
accepted draft token after a fully accepted round: 1 or 2 tokens, more after rounds without
speculation, the whole row if it joined while the policy was not drafting), then drafts one token per
forward. Rows whose policy stopped them keep riding along in
the batch forward (their extra tokens are not proposed), so the whole batch stays one tensor.
"""

from __future__ import annotations

import torch

from .. import sampling
from ..cache import RaggedKVCache, forward_hidden
from .base import Draft, Proposer


class DraftModelProposer(Proposer):
    deterministic = False

    def __init__(self, batch, model):
        super().__init__(batch)
        self.model = model
        head = model.get_output_embeddings()
        rows = batch.spec.draft_vocab or batch.vocab_size
        self.head_weight = head.weight[: min(rows, batch.vocab_size)]  # [draft_vocab, d] (a view)
        self.head_bias = head.bias[: self.head_weight.shape[0]] if getattr(head, "bias", None) is not None else None
        self.cache = RaggedKVCache(model, batch.capacity, batch.max_len)
        self.d_len = batch.slots.add("draft_len")  # tokens of the row held in the draft cache
        self.fed_len = batch.slots.add("draft_fed")  # after propose(): tokens fed this round

    def admit(self, start: int, end: int) -> None:
        b = self.batch
        if b.policy.drafts_soon(end):
            self.d_len[start:end] = b.prefill(self.model, self.cache, start, end)
        else:  # no speculation for now: the first drafting round's catch-up feeds the whole row
            self.d_len[start:end] = 0

    def propose(self, n: int, limits: torch.Tensor) -> Draft:
        b = self.batch
        dev = b.device
        k_max = int(limits.max()) if n else 0
        if k_max == 0:
            self.fed_len[:n] = self.d_len[:n]
            return Draft.empty(n, dev)
        rows = torch.arange(n, device=dev)
        seq_len, d_len = b.seq_len[:n], self.d_len[:n]
        # catch-up: feed seq[d_len : seq_len] (ragged, right-padded)
        behind = seq_len - d_len  # [n] >= 1
        t0 = int(behind.max())
        idx = d_len[:, None] + torch.arange(t0, device=dev)[None, :]  # [n, t0]
        tokens_in = b.seq[:n].gather(1, idx.clamp(max=b.max_len - 1))
        hidden = forward_hidden(self.model, self.cache, tokens_in, idx, 0, n)
        h = hidden[rows, behind - 1]  # [n, d] state after the pending token
        forwards = 1

        active = limits > 0  # rows still drafting
        lengths = torch.zeros(n, dtype=torch.int64, device=dev)
        tokens, qs = [], []
        policy = b.policy
        fed = 0  # drafted tokens fed back into the draft this round
        for step in range(k_max):
            logits = torch.nn.functional.linear(h, self.head_weight, self.head_bias)  # [n, draft_vocab]
            if b.sampling.greedy:
                x = logits.argmax(-1)
                q = sampling.probs(logits, b.sampling) if policy.uses_draft_probs else None
            else:
                q = sampling.probs(logits, b.sampling)
                x = sampling.sample(q, b.u_draft[:n, step])
                qs.append(q)
            tokens.append(x)
            lengths += active
            token_prob = q.gather(1, x[:, None]).squeeze(1) if q is not None else None
            active &= limits > step + 1
            if not policy.keep_after_feed:
                keep = policy.keep(step, token_prob, h)
                if keep is not None:
                    active &= keep
            if step + 1 == k_max or not bool(active.any()):
                break
            pos = (seq_len + step)[:, None]  # x_{step+1} sits right after the pending token's run
            h = forward_hidden(self.model, self.cache, x[:, None], pos, 0, n)[:, 0]
            forwards += 1
            fed += 1
            if policy.keep_after_feed:  # e.g. the acceptance head reads h after x was fed
                keep = policy.keep(step, token_prob, h)
                if keep is not None:
                    active &= keep
                if not bool(active.any()):
                    break

        self.fed_len[:n] = seq_len + fed
        k = int(lengths.max())
        draft_tokens = torch.stack(tokens, dim=1)[:, :k]
        q_probs = torch.stack(qs, dim=1)[:, :k] if qs else None
        if q_probs is not None and q_probs.shape[-1] < b.vocab_size:  # q is zero past the draft's vocab
            q_probs = torch.nn.functional.pad(q_probs, (0, b.vocab_size - q_probs.shape[-1]))
        return Draft(draft_tokens, lengths, q_probs, forwards)

    def commit(self, n: int, old_len: torch.Tensor, accepted: torch.Tensor) -> None:
        # the draft cache is right up to the last accepted draft token it was fed
        self.d_len[:n] = torch.minimum(self.fed_len[:n], old_len + accepted)

    def rewind(self, n: int) -> None:
        self.d_len[:n] = torch.minimum(self.d_len[:n], self.batch.seq_len[:n] - 1)  # the pending token is never in it

    def move_row(self, src: int, dst: int) -> None:
        self.cache.move_row(src, dst, int(self.d_len[src]))
