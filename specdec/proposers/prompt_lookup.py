"""Prompt lookup decoding: draft the continuation of the latest earlier occurrence of the sequence's
suffix n-gram (n from `prompt_lookup_max_ngram` down to `prompt_lookup_min_ngram`), searched in the
row's prompt and output so far. Deterministic: q is a point mass, so verification stays lossless."""

from __future__ import annotations

import numpy as np

from .base import Draft, Proposer


def lookup(seq: np.ndarray, k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Up to k tokens following the most recent earlier match of seq's longest matching suffix."""
    n_tok = len(seq)
    for n in range(min(max_ngram, n_tok - 1), min_ngram - 1, -1):
        pattern = seq[n_tok - n :]
        # windows starting at 0 .. n_tok-n-1, each followed by at least one token
        windows = np.lib.stride_tricks.sliding_window_view(seq[: n_tok - 1], n)
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return seq[start : start + k].tolist()
    return []


class PromptLookupProposer(Proposer):
    deterministic = True

    def propose(self, n: int, limits: np.ndarray) -> Draft:
        b = self.batch
        spec = b.spec
        drafts = []
        for i, limit in enumerate(limits.tolist()):
            seq = np.asarray(b.rows[i].tokens, dtype=np.int64)
            drafts.append(lookup(seq, limit, spec.prompt_lookup_max_ngram, spec.prompt_lookup_min_ngram)
                          if limit > 0 else [])
        k = max((len(d) for d in drafts), default=0)
        host = np.zeros((n, k + 1), dtype=np.int64)  # the lengths, then the tokens: one copy to the device
        for i, d in enumerate(drafts):
            host[i, 0] = len(d)
            host[i, 1 : 1 + len(d)] = d
        both = b.to_device(host)
        return Draft(both[:, 1:], both[:, 0], None, 0)
