"""Plain configuration and result types of the engine (no pydantic: the job layer validates).

These are the engine's whole public vocabulary: `SamplingParams` (how tokens are chosen),
`SpecConfig` (how drafts are proposed, sized and verified) and `SampleResult` (one row's output and
its per-round acceptance statistics, named exactly as the output columns).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Literal

Method = Literal["none", "draft_model", "prompt_lookup"]
DraftLength = Literal["fixed", "heuristic", "confidence", "acceptance_head", "goodput"]
Verification = Literal["lossless", "fuzzy", "conditional"]
FinishReason = Literal["stop", "length", "error"]


@dataclass(frozen=True)
class SamplingParams:
    """Token selection, applied identically to draft (q) and target (p) logits, in float32."""

    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass(frozen=True)
class SpecConfig:
    method: Method = "draft_model"
    num_draft_tokens: int = 4  # fixed length, and where heuristic starts
    draft_length: DraftLength = "fixed"
    max_draft_tokens: int = 16
    verification: Verification = "lossless"
    # policy settings (ignored by policies that do not use them)
    confidence_threshold: float = 0.4
    acceptance_head_path: str | None = None
    acceptance_head_threshold: float = 0.3
    # draft model: score only the first `draft_vocab` token ids (0 = all). BPE ids are ordered by merge
    # rank, so low ids are the frequent tokens; q is then zero beyond them, which stays lossless
    # because verification uses exactly the q the draft sampled from.
    draft_vocab: int = 0
    # verify over a wider window when that shape was measured to be cheaper (specdec/widths.py)
    verify_padding: bool = True
    # prompt lookup: n-gram sizes tried, longest first
    prompt_lookup_max_ngram: int = 3
    prompt_lookup_min_ngram: int = 1


def row_seed(seed: int, key: object) -> int:
    """A row's generator seed from (job seed, row id): independent of batch composition."""
    digest = hashlib.sha256(f"{seed}\x00{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@dataclass
class SampleResult:
    """One row's generation and its statistics (the output columns of ARCHITECTURE.md)."""

    key: object
    prompt_tokens: int
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason = "length"
    error: str | None = None
    rounds: int = 0  # target forwards after prefill
    draft_forwards: int = 0  # draft forwards this row took part in (0 for prompt lookup / none)
    draft_lengths: list[int] = field(default_factory=list)  # per round: tokens proposed
    accept_lengths: list[int] = field(default_factory=list)  # per round: tokens accepted
    wall_s: float = 0.0

    @property
    def generated_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def drafted_tokens(self) -> int:
        return sum(self.draft_lengths)

    @property
    def accepted_tokens(self) -> int:
        return sum(self.accept_lengths)

    @property
    def acceptance_rate(self) -> float | None:
        drafted = self.drafted_tokens
        return self.accepted_tokens / drafted if drafted else None

    @property
    def mean_accepted_length(self) -> float | None:
        return self.generated_tokens / self.rounds if self.rounds else None

    def stats(self) -> dict:
        """The per-sample statistic columns (everything but id and completion)."""
        return {
            "token_ids": list(self.token_ids),
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "finish_reason": self.finish_reason,
            "error": self.error,
            "rounds": self.rounds,
            "draft_forwards": self.draft_forwards,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "draft_lengths": list(self.draft_lengths),
            "accept_lengths": list(self.accept_lengths),
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "wall_s": self.wall_s,
        }

    @classmethod
    def failed(cls, key: object, prompt_tokens: int, reason: str) -> "SampleResult":
        return cls(key=key, prompt_tokens=prompt_tokens, finish_reason="error", error=reason)
