"""The choices a speculation config names, each decided here once: the method (`METHODS`: what proposes drafts,
which rule verifies them, which models it runs, how many tree nodes a row may draft) and the draft-length policy
(`POLICIES`). The config is validated against these tables, the engine builds its parts from them, and nothing
else compares a method by name.

Importing this module imports nothing heavy, so that a job config parses without torch: what a choice builds
(a proposer, a rule, a policy) is imported when it is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import SpecConfig
    from .exec.prefill import Prefiller
    from .plan.policies import LengthPolicy, PolicyEnv
    from .sched.slots import Slots
    from .spec.grammar import Constraints
    from .spec.proposers.base import Proposer
    from .spec.verify import Rule

# coupled sampling's noise: 2 = Philox4x32-10 on the model's device (specdec/spec/sampling.py `gumbel`), 1 = numpy's
# Philox-4x64 on the host. A coupled job's fingerprint holds it: another version draws other samples.
COUPLED_NOISE_VERSION = 2


class Method:
    """A speculation method. The base is what every drafting method shares: chains of up to `max_draft_tokens`,
    verified by the lossless chain rule."""

    name: str
    doc: str
    drafts = True  # proposes tokens (method none is plain decoding through the same loop)
    draft_model = False  # loads and runs `models.draft`
    relaxed: str | None = None  # the relaxed `verification` it may use besides lossless
    settings: tuple[str, ...] = ()  # the speculation settings of its own that it reads

    def siblings(self, spec: SpecConfig) -> int:
        """The most siblings per node of its token trees (0: chains)."""
        return 0

    def max_draft(self, spec: SpecConfig) -> int:
        """The most tokens a row drafts in a round: a chain's length, a tree's depth (0: no drafts)."""
        return spec.max_draft_tokens if self.drafts else 0

    def max_nodes(self, spec: SpecConfig) -> int:
        """Its tree budget: the most draft tokens (tree nodes) one row proposes in a round."""
        return self.max_draft(spec) * (1 + self.siblings(spec))

    def prompt_top_ids(self, spec: SpecConfig) -> int:
        """The target's most likely ids its proposer wants at every prompt position, from the prefill (0: none)."""
        s = self.siblings(spec)
        return s + 1 if s else 0

    def rule(self, spec: SpecConfig) -> Rule:
        from .spec.verify import ChainRule

        return ChainRule()

    def proposer(self, slots: Slots, spec: SpecConfig, policy: LengthPolicy, rule: Rule, draft: Prefiller | None,
                 vocab_size: int, constraints: Constraints | None) -> Proposer:
        """The drafter of a batch's rows (`slots`); `draft`: the prefills of the draft model's cache, for a method
        that runs one; `vocab_size`: the target's; `constraints`: the rows' output formats (None: no row has one)."""
        from .spec.proposers.base import Proposer

        return Proposer(slots)


class Plain(Method):
    name, doc = "none", "plain decoding"
    drafts = False


class DraftModel(Method):
    name, doc = "draft_model", "a small model drafts chains"
    draft_model, relaxed = True, "fuzzy"
    settings = ("draft_vocab",)

    def rule(self, spec):
        from .spec.verify import ChainRule, FuzzyRule

        f = spec.fuzzy_rule
        return FuzzyRule(f.divergence, f.threshold) if f is not None else ChainRule()

    def proposer(self, slots, spec, policy, rule, draft, vocab_size, constraints):
        from .spec.proposers.draft_model import DraftModelProposer

        return DraftModelProposer(slots, draft, policy, vocab_size, constraints, raw_q=rule.reads_raw_q)


class PromptLookup(Method):
    name, doc = "prompt_lookup", "n-grams of the row's own text draft chains, or AASD's token trees"
    relaxed = "conditional"
    settings = ("prompt_lookup",)

    def siblings(self, spec):
        return spec.prompt_lookup.alignment_sampling

    def rule(self, spec):
        from .spec.verify import ConditionalRule, TreeRule

        c = spec.conditional_rule
        return ConditionalRule(*c) if c is not None else TreeRule()

    def proposer(self, slots, spec, policy, rule, draft, vocab_size, constraints):
        from .spec.proposers.prompt_lookup import PromptLookupProposer

        return PromptLookupProposer(slots, spec.prompt_lookup, self.prompt_top_ids(spec))


METHODS: dict[str, Method] = {m.name: m for m in (Plain(), DraftModel(), PromptLookup())}


@dataclass(frozen=True)
class Policy:
    """A draft-length policy: its class in specdec/plan/policies and the settings it reads."""

    name: str
    cls: str  # its class, in specdec.plan.policies
    doc: str
    settings: tuple[str, ...] = ()  # the speculation settings of its own that it reads
    needs_costs: bool = False  # plans from measured costs: the engine measures them before building it
    max_draft_tokens: int | None = None  # its own default bound (None: the config's)

    def build(self, spec: SpecConfig, env: PolicyEnv | None = None) -> LengthPolicy:
        from .plan import policies

        return getattr(policies, self.cls)(spec, env)


# the first is the default
POLICIES: dict[str, Policy] = {p.name: p for p in (
    Policy("goodput", "GoodputLength", "one K per round for the whole batch, chosen from costs measured at start "
           "(once per machine and settings: kept in the cache folder): the default", needs_costs=True),
    Policy("fixed", "FixedLength", "`num_draft_tokens` every round", ("num_draft_tokens",)),
    Policy("heuristic", "HeuristicLength", "transformers' schedule: +2 after a fully accepted round, else -1",
           ("num_draft_tokens",)),
    Policy("confidence", "ConfidenceLength", "stop a row's draft after a token the draft gave less than "
           "`confidence_threshold`", ("confidence_threshold",)),
    Policy("acceptance_head", "AcceptanceHeadLength", "SpecDec++: stop when the trained head's P(a rejection) "
           "exceeds its threshold", ("acceptance_head",), max_draft_tokens=20),  # SpecDec++'s bound
)}


def ignored_settings(method: str, draft_length: str) -> set[str]:
    """The speculation settings that a config of this method and policy never reads."""
    chosen = METHODS[method]
    of_policies = {s for p in POLICIES.values() for s in p.settings}
    of_methods = {s for m in METHODS.values() for s in m.settings}
    ignored = (of_policies - set(POLICIES[draft_length].settings)) | (of_methods - set(chosen.settings))
    if not chosen.drafts:
        ignored |= of_policies | {"draft_length", "max_draft_tokens"}
    return ignored


def describe(table: dict) -> str:
    return "; ".join(f"`{name}`: {choice.doc}" for name, choice in table.items())
