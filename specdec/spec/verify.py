"""Verification rules: which drafted tokens the target accepts, and the token it adds.

Terms (Leviathan et al. 2023; Chen et al. 2023), per row:
- drafted tokens x_1..x_k (k = that row's draft length this round; padding beyond k is ignored);
- accepted tokens: the longest prefix that passes the rule;
- recovered token: at the first rejection, a sample from the residual max(p - q, 0) / sum(...);
- bonus token: when all k pass, a sample from p_{k+1}.
Each round emits accepted + 1 tokens. Greedy accepts while x_i == argmax p_i.
A deterministic proposer (prompt lookup) gives no q: q is a point mass on x_i.

A rule is an object the engine picks once (the method's, specdec/choices.py) and calls every round with the
target's logits over [pending, draft], the draft, the rows' sampling settings and the round's randomness:
`ChainRule` (the lossless rule for a draft model), `FuzzyRule` (FSD: close distributions pass outright),
`TreeRule` (lossless, for token trees and prompt lookup's chains), `ConditionalRule` (AASD: likely prompt tokens
pass); `CoupledRule` wraps any lossless one for coupled sampling. Each row is verified by its own sampling
settings (`Rows`): greedy rows by argmax, the others by sampling. A rule knows nothing of the batch or the models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from . import sampling, trees
from .sampling import Draws, Rows

if TYPE_CHECKING:
    from .draft import Draft


@dataclass
class Verdict:
    accepted: torch.Tensor  # [n] accepted drafted tokens per row (0..k): the accepted path's depth for a tree
    next_token: torch.Tensor  # [n] recovered or bonus token
    path: torch.Tensor | None = None  # [n, D] a tree's accepted nodes by depth (stale past `accepted`); None: chains


def _leading(passed: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Length of the all-True prefix of `passed` [n, K], limited to each row's draft length."""
    k = passed.shape[1]
    if k == 0:
        return torch.zeros_like(lengths)
    valid = torch.arange(k, device=passed.device)[None, :] < lengths[:, None]
    return (passed & valid).to(torch.int64).cumprod(dim=1).sum(dim=1)


def scan(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One pass over the vocabulary: each position's argmax [...] (the first of equal ones) and whether its largest
    logit is finite (NaN and +inf anywhere, or -inf everywhere, make it not; a -inf among finite logits is a masked
    token). On a CPU, over blocks of 128 logits where the vocabulary is a multiple of that: the blocks' maxima in
    one pass (`amax`, vectorised), then the argmax inside the winning block; `max` with indices takes several
    times as long there."""
    v = logits.shape[-1]
    if logits.device.type != "cpu" or v % 128 or v < 1024:
        peak, best = logits.max(dim=-1)
        return best, torch.isfinite(peak)
    blocks = logits.unflatten(-1, (v // 128, 128))  # a view: the vocabulary is the contiguous axis
    peak, at = blocks.amax(-1).max(-1)
    inner = blocks.gather(-2, at[..., None, None].expand(*at.shape, 1, 128)).squeeze(-2).argmax(-1)
    return at * 128 + inner, torch.isfinite(peak)


def verify_greedy(target_logits: torch.Tensor, draft_tokens: torch.Tensor, lengths: torch.Tensor,
                  also: torch.Tensor | None = None, best: torch.Tensor | None = None) -> Verdict:
    """target_logits: [n, K+1, vocab]; draft_tokens: [n, K]; lengths: [n]; also [n, K]: tokens that pass
    whatever the rule says (fuzzy verification); best [n, K+1]: the logits' argmax, when the caller has it."""
    best = target_logits.argmax(dim=-1) if best is None else best  # [n, K+1]
    k = draft_tokens.shape[1]
    passed = draft_tokens == best[:, :k]
    accepted = _leading(passed if also is None else passed | also, lengths)
    next_token = best.gather(1, accepted[:, None]).squeeze(1)
    return Verdict(accepted, next_token)


def verify_lossless(
    p: torch.Tensor,  # [n, K+1, vocab] processed target distributions, float32
    draft_tokens: torch.Tensor,  # [n, K]
    lengths: torch.Tensor,  # [n]
    q_probs: torch.Tensor | None,  # [n, K, vocab] draft distributions the tokens were sampled from (None when K = 0)
    u_accept: torch.Tensor,  # [n, K] uniforms for the acceptance tests
    u_sample: torch.Tensor,  # [n] uniform for the recovered / bonus token
    also: torch.Tensor | None = None,  # [n, K] tokens that pass whatever the rule says (fuzzy verification)
) -> Verdict:
    """Speculative sampling of chains drawn from q. A drafter without q (point masses: prompt lookup) is verified
    as a tree instead (`TreeRule`)."""
    n, k = draft_tokens.shape
    if k == 0:  # nothing drafted: the bonus token alone
        return Verdict(torch.zeros_like(lengths), sampling.sample(p[:, 0], u_sample))
    rows = torch.arange(n, device=p.device)
    p_x = p[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)  # [n, K]
    q_x = q_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)
    ratio = p_x / q_x.clamp_min(torch.finfo(q_x.dtype).tiny)
    passed = u_accept[:, :k] <= ratio  # accept x_i with probability min(1, p/q)
    accepted = _leading(passed if also is None else passed | also, lengths)

    base = p[rows, accepted]  # [n, vocab]: p at the first rejected position, or p_{k+1} (bonus)
    rejected = accepted < lengths
    q_at = q_probs[rows, accepted.clamp(max=k - 1)]
    residual = (base - q_at).clamp_min_(0.0)
    mass = residual.sum(-1, keepdim=True)
    # residual renormalised by its sum (sample() needs no normalisation); p itself if it is all zero
    residual = torch.where(mass > 0, residual, base)
    dist = torch.where(rejected[:, None], residual, base)
    return Verdict(accepted, sampling.sample(dist, u_sample))


def divergence(p: torch.Tensor, q: torch.Tensor, kind: str) -> torch.Tensor:
    """Div(p, q) over the last axis, in nats: `js` the textbook Jensen-Shannon 0.5 KL(p||m) + 0.5 KL(q||m),
    m = (p + q) / 2 (FSD's reference code computes 0.5 KL(m||p) + 0.5 KL(m||q) instead, which is infinite
    where one model gives a token zero probability); `kl` KL(p||q); `tv` half the L1 distance."""
    if kind == "tv":
        return 0.5 * (p - q).abs().sum(-1)
    xlogy = torch.special.xlogy
    if kind == "kl":
        return (xlogy(p, p) - xlogy(p, q)).sum(-1)
    m = 0.5 * (p + q)
    return 0.5 * (xlogy(p, p) - xlogy(p, m)).sum(-1) + 0.5 * (xlogy(q, q) - xlogy(q, m)).sum(-1)


def fuzzy_pass(target_logits: torch.Tensor, raw_q: torch.Tensor, kind: str, threshold: float) -> torch.Tensor:
    """Fuzzy speculative decoding (FSD): [n, K] where Div(p_i, q_i) <= threshold, p and q the models' raw
    distributions (softmax of the logits at temperature 1, as FSD's code); target_logits [n, >= K, vocab],
    raw_q [n, K, vocab]. Such a token is accepted outright; elsewhere the lossless rule still decides (FSD
    rejects there and draws from p: we keep the residual, so threshold 0 is exactly lossless and fuzzy
    accepts a superset of what lossless accepts)."""
    k = raw_q.shape[1]
    p = torch.softmax(target_logits[:, :k].float(), dim=-1)
    return divergence(p, raw_q, kind) <= threshold


class Rule:
    name = "lossless"  # what a row's `verification` column says
    reads_raw_q = False  # reads the draft's raw distributions (`Draft.raw_q`): the drafter keeps them
    coupled = False  # verifies sampled rows on Gumbel noise by position (`Draws.noise`) instead of uniforms

    def __call__(self, logits: torch.Tensor, draft: Draft, rows: Rows, draws: Draws,
                 best: torch.Tensor | None = None) -> Verdict:
        """logits [n, T+1, vocab]: the target at the pending token and at each drafted token; `draws`: the round's
        randomness (its `rule` uniforms, or noise); best [n, T+1]: the logits' argmax (`scan`), when the caller has
        it."""
        raise NotImplementedError


class ChainRule(Rule):
    """Lossless speculative sampling of chains drafted from q (greedy rows: argmax matching)."""

    def passes(self, logits: torch.Tensor, draft: Draft) -> torch.Tensor | None:
        """[n, K]: tokens accepted whatever the lossless test says (None: none)."""
        return None

    def __call__(self, logits, draft, rows, draws, best=None):
        k = draft.tokens.shape[1]
        also = self.passes(logits, draft) if k else None
        greedy = verify_greedy(logits, draft.tokens, draft.lengths, also, best) if rows.any_greedy else None
        if rows.greedy:
            return greedy
        u = draws.rule
        p = sampling.probs(logits, rows)  # [n, K+1, vocab]
        v = verify_lossless(p, draft.tokens, draft.lengths, draft.q, u[:, :k], u[:, -1], also)
        if greedy is None:
            return v
        return Verdict(sampling.per_row(rows, greedy.accepted, v.accepted),
                       sampling.per_row(rows, greedy.next_token, v.next_token))


class FuzzyRule(ChainRule):
    """FSD: a drafted token passes outright where Div(p, q) of the models' raw distributions is at most the
    threshold; elsewhere the lossless rule decides."""

    name = "fuzzy"
    reads_raw_q = True

    def __init__(self, divergence: str, threshold: float):
        self.divergence, self.threshold = divergence, threshold

    def passes(self, logits, draft):
        return fuzzy_pass(logits, draft.raw_q, self.divergence, self.threshold)


class TreeRule(Rule):
    """Token trees (a chain is a tree): a node passes when it is the target's choice at its parent (argmax, or
    a draw from p with the row's uniform for that depth); the deepest path of passing nodes is accepted. A drafter
    without q (prompt lookup's point masses) is verified by it, chains included."""

    conditional: tuple[float, float] | None = None

    def __call__(self, logits, draft, rows, draws, best=None):
        n, t = draft.tokens.shape
        tree = draft.tree
        parent, depth = (tree.parent, tree.depth) if tree is not None else trees.chain(n, t, logits.device)
        d = draft.depth
        u = draws.rule
        v = trees.verify_tree(logits, draft.tokens, parent, depth, draft.lengths, d, rows,
                              None if u is None else u[:, : d + 1], draft.relaxed, self.conditional, best)
        return Verdict(v.accepted, v.next_token, v.path if tree is not None else None)


class ConditionalRule(TreeRule):
    """AASD: a node taken from the prompt also passes where p(x) >= min(alpha H(p) + beta, max p)."""

    name = "conditional"

    def __init__(self, alpha: float, beta: float):
        self.conditional = (alpha, beta)


class CoupledRule(Rule):
    """Coupled sampling around a lossless rule: each sampled row's processed logits plus the Gumbel noise of the
    position each node predicts (`Draws.noise`; a node at depth d predicts the row's position lens + d), verified
    as greedy rows are. A sampled row's tokens are then the argmax of its perturbed logits at each position:
    plain decoding's with its seed, whatever was drafted."""

    coupled = True

    def __init__(self, rule: Rule):
        self.rule, self.name, self.reads_raw_q = rule, rule.name, rule.reads_raw_q

    def __call__(self, logits, draft, rows, draws, best=None):
        if draws.noise is None:  # every row greedy
            return self.rule(logits, draft, rows, draws, best)
        n, k = draft.tokens.shape
        noise = draws.noise
        if draft.tree is None:
            noise = noise[:, : k + 1]
        else:
            depth = trees.with_root(draft.tree.depth)  # [n, T+1]
            noise = noise.gather(1, depth[..., None].expand(-1, -1, noise.shape[-1]))
        return self.rule(sampling.coupled(logits, rows, noise), draft, sampling.as_greedy(rows), draws, None)
