"""Draft-length policies. Which one a config names, what it reads and whether it plans from measured costs is
decided in specdec/choices.py (`POLICIES`), which builds it from the classes here."""

from .base import BatchView, DraftStopper, LengthPolicy, PolicyEnv, RoundResult
from .goodput import GoodputLength
from .simple import AcceptanceHeadLength, ConfidenceLength, FixedLength, HeuristicLength, NoDrafts

__all__ = ["AcceptanceHeadLength", "BatchView", "ConfidenceLength", "DraftStopper", "FixedLength", "GoodputLength",
           "HeuristicLength", "LengthPolicy", "NoDrafts", "PolicyEnv", "RoundResult"]
