"""Draft-length policies, by name: the one list the config, the CLI and the docs are made from."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import BatchView, DraftStopper, LengthPolicy, PolicyEnv, RoundResult
from .goodput import GoodputLength
from .simple import AcceptanceHeadLength, ConfidenceLength, FixedLength, HeuristicLength

if TYPE_CHECKING:
    from ..config import SpecConfig

# name -> (class, what it does); the first is the default
POLICIES: dict[str, tuple[type[LengthPolicy], str]] = {
    "goodput": (GoodputLength, "one K per round for the whole batch, chosen from measured costs: the default"),
    "fixed": (FixedLength, "`num_draft_tokens` every round"),
    "heuristic": (HeuristicLength, "transformers' schedule: +2 after a fully accepted round, else -1"),
    "confidence": (ConfidenceLength, "stop a row's draft after a token the draft gave less than "
                                     "`confidence_threshold`"),
    "acceptance_head": (AcceptanceHeadLength, "SpecDec++: stop when the trained head's P(a rejection) exceeds "
                                              "its threshold"),
}
NAMES = tuple(POLICIES)


def describe() -> str:
    return "; ".join(f"`{name}`: {doc}" for name, (_, doc) in POLICIES.items())


def policy_class(name: str) -> type[LengthPolicy]:
    if name not in POLICIES:
        raise ValueError(f"speculation.draft_length {name!r} is not available; choose one of {NAMES}")
    return POLICIES[name][0]


def make_policy(spec: SpecConfig, env: PolicyEnv | None = None) -> LengthPolicy:
    """The policy `spec.draft_length` names (one that `needs_costs` finds the cost model in `env`)."""
    return policy_class(spec.draft_length)(spec, env)


__all__ = ["BatchView", "DraftStopper", "LengthPolicy", "PolicyEnv", "RoundResult", "NAMES", "POLICIES", "describe",
           "make_policy", "policy_class"]
