"""goodput: each round, the one draft length K (0 = no speculation) that maximises the batch's expected
emitted tokens per second under the cost model (specdec/plan/costmodel.py).

One K for all rows: a round costs what its longest row costs (draft steps and verification run the
batch as one tensor), and a longer draft never lowers a row's expected tokens. Acceptance is what
verification actually tested (accepted tokens plus the first rejected one): per depth d, the pair's rate of
passing the d-th token once the ones before it passed (prompt lookup's later tokens pass far more often than
its first: a copied span goes on once it started; a draft model's are near constant), shifted per row in
log-odds by the row's per-token rate against the pair's (shrunk towards it by `Tuning.row_weight` tested tokens).
A row drafts no deeper than its proposer can reach now (prompt lookup: the text after the matched n-gram;
none where nothing matched), and a round no deeper than its deepest row.

The choice is the best expectation; lengths that could win, counting `Tuning.optimism` standard deviations of
their expected tokens (K = 0 tests nothing, so two unlucky rounds must not shut speculation off for good;
until the pair has been tested much, its rate is that uncertain for every row), and lengths next to the
choice never run live (their cost rests on one start-up timing), are re-timed once stale (the neighbours of
the choice, 0, the runner-up and the same K at other widths, if within `Tuning.retime_within` of it; the most
promising first), so one slow sample cannot lock a choice in. Each
length waits on its own: a re-timing that leaves it unable to win doubles its wait (not the others'), one
that changes the choice resets them all. A length is also charged for the admissions it brings on: rows
decoding in step finish and join in one prefill call, speculation spreads them and each then joins alone
(the call's fixed cost, and a draft prefill). Every constant of this is a field of `costmodel.Tuning`.

Token trees (prompt lookup with alignment sampling s > 0): the choice is K and how wide, 0..s
siblings per node. A width's rounds verify more nodes (measured: nodes per level of depth) at the
cost of that width (the cost model), and pass more levels (measured: its pass rate at each depth against
all rounds' there); trees run where width is cheap enough to pay for what it adds, chains or plain rounds
elsewhere. A tree round's acceptance counts its accepted path against its depth, not its nodes.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import numpy as np

from ..costmodel import CostModel, best_length, bucket, chain_tokens, keep_last
from .base import BatchView, LengthPolicy, RoundResult


@dataclass
class _Probe:
    """A length being re-timed at a bucket until its samples are in or its rounds run out."""

    bucket: int
    before: int  # the choice when it began
    choice: int  # the choice it times (an index of `GoodputLength.scores`)
    samples_left: int
    rounds_left: int


class GoodputLength(LengthPolicy):
    def __init__(self, spec, env):
        super().__init__(spec, env)
        self.costs: CostModel = env.costs
        self.tuning = t = env.costs.tuning
        self.row_tokens = env.row_tokens  # a row's emitted tokens until rows finish: max_new_tokens
        self.pair_accepted, self.pair_tested = t.pair_prior  # the pair's tokens accepted, tested over all rows
        self.choice: dict[int, int] = {}  # bucket -> the choice index it runs (0: no speculation)
        self.wait: dict[tuple[int, int], int] = {}  # (bucket, choice) -> rounds between its re-timings
        self.lengths: list[float] = []  # tokens emitted by recently finished rows
        self.groups: dict[bool, list[int]] = {False: [], True: []}  # rows per admission, after plain / drafting rounds
        self.last: int | None = None  # the K of the last round
        self.probe: _Probe | None = None
        self.scored: tuple[tuple, tuple] | None = None  # ((rows, cost rounds), `scores`) of the last scoring
        self.decided: tuple[tuple, int, float] | None = None  # (the scores, the choice, the round a re-timing is due)
        # token trees (prompt lookup with alignment sampling): 0..s siblings per node, chosen with K
        most = env.siblings
        self.sibling_choices = list(range(most + 1))
        # s -> per depth 1..max_k: rows that tested it, that passed it, in rounds of s siblings per node
        self.levels = np.zeros((len(self.sibling_choices), 2, spec.max_draft_tokens))
        levels = t.fan_prior_levels  # s -> nodes, levels drafted (a prior of 1 + s / 2 nodes per level)
        self.fan = {s: [levels * (1 + s / 2), levels] for s in self.sibling_choices}
        self.siblings = 0 if most else None

    def pair_rate(self) -> float:
        """The pair's per-token acceptance rate over every tested token."""
        return self.pair_accepted / self.pair_tested

    def attach(self, slots) -> None:
        self.accepted = slots.add_host("goodput_accepted", dtype=np.float64)
        self.tested = slots.add_host("goodput_tested", dtype=np.float64)
        self.emitted = slots.add_host("goodput_emitted", dtype=np.int64)

    def rates(self, n: int) -> np.ndarray:
        w = self.tuning.row_weight
        return (self.accepted[:n] + w * self.pair_rate()) / (self.tested[:n] + w)

    def in_step(self, n: int) -> bool:
        """Have rows [0, n) (n > 1) all emitted as many tokens, so that plain rounds finish them together?"""
        return n > 1 and bool((self.emitted[:n] == self.emitted[0]).all())

    def joining(self, view: BatchView) -> tuple[float, float]:
        """Admission seconds each emitted token brings on beyond its row's own prefill, under plain and
        under drafting rounds: only while prompts wait or rows are in step (else nothing joins)."""
        profile = self.costs.profile
        if not (view.waiting or self.in_step(view.n)):
            return 0.0, 0.0
        row = max(statistics.fmean(self.lengths) if self.lengths else self.row_tokens, 1.0)

        def per_token(drafting: bool) -> float:
            seen = self.groups[drafting]
            together = statistics.fmean(seen) if seen else (1 if drafting else view.n)
            return (profile.prefill_fixed / together + (profile.draft_prefill if drafting else 0.0)) / row

        return per_token(False), per_token(True)

    def depth_rates(self, s: int | None = None) -> np.ndarray:
        """[max_k] the rate of passing the d-th drafted token once the ones before it passed: over all rounds, each
        depth shrunk towards the depth above's by `Tuning.depth_weight` tested levels (the first towards the per-token
        rate; a depth never tested takes the one above's); for rounds of s siblings per node, shifted in log-odds
        by how their passes compare with all rounds' rates at the depths they tested (widths run at different
        lengths, and rates rise with depth), shrunk towards none by `Tuning.width_weight` tested levels."""
        return self.pooled_rates() if s is None else self.width_rates(self.pooled_rates(), s)

    def pooled_rates(self) -> np.ndarray:
        """[max_k] `depth_rates` over all rounds."""
        tested, passed = self.levels.sum(0)
        out, above, w = np.empty(len(tested)), self.pair_rate(), self.tuning.depth_weight
        for d in range(len(tested)):
            above = out[d] = (passed[d] + w * above) / (tested[d] + w)
        return out

    def width_rates(self, out: np.ndarray, s: int) -> np.ndarray:
        """[max_k] `depth_rates` of rounds of s siblings per node, from all rounds' (`pooled_rates`)."""
        if len(self.sibling_choices) == 1 or not self.levels[s, 0].any():
            return out
        tested, passed = self.levels[s]
        expect = float(tested @ out) / tested.sum()  # all rounds' rate at the depths this width tested
        w = self.tuning.width_weight
        seen = (passed.sum() + w * expect) / (tested.sum() + w)
        return expit(logit(out) + logit(seen) - logit(expect))

    def scores(self, view: BatchView) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per choice c = s * (max_k + 1) + K (K drafts, s siblings per node): the batch's expected tokens, their
        standard deviation, and the round's predicted seconds with the admissions it brings on (nan where
        the cost model cannot say or no row reaches K; K = 0 only at s = 0)."""
        n, max_k = view.n, self.spec.max_draft_tokens
        k = np.arange(max_k + 1)
        plain, drafting = self.joining(view)
        pair = self.pair_rate()
        a = np.clip(self.rates(n), 1e-3, 0.999)  # [n]
        pooled = self.pooled_rates()
        parts = []
        for s in self.sibling_choices:
            depths = logit(self.width_rates(pooled, s))[None, :] - logit(pair)  # [1, max_k]: log-odds over the pair's
            tested = self.levels[s, 0].sum() if len(self.sibling_choices) > 1 else np.inf  # what its rates rest on
            sd_rate = self.rate_sd(a, np.minimum(self.tested[:n], tested), pair)
            reach = None if view.reach is None else view.reach[:n, min(s, view.reach.shape[1] - 1)]
            rows = chain_tokens(expit(depths + logit(a)[:, None]), reach)  # [n, max_k + 1]
            hope = chain_tokens(expit(depths + logit(np.clip(a + sd_rate, 1e-3, 0.999))[:, None]), reach)
            tokens, sd = rows.sum(0), np.sqrt(((hope - rows) ** 2).sum(0))
            fan = self.fan[s][0] / self.fan[s][1]
            cost = self.costs.seconds(n, max_k, s, fan) + tokens * np.where(k > 0, drafting, plain)
            if reach is not None:
                cost[k > reach.max(initial=0)] = np.nan  # no row drafts that deep now
            if s:
                cost[0] = np.nan  # no drafts: a plain round, counted at s = 0
            parts.append((tokens, sd, cost))
        return tuple(np.concatenate(x) for x in zip(*parts))

    def recent_scores(self, view: BatchView) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`scores`, or the last ones while they still stand: since them only plain rounds ran (which teach no
        acceptance and barely move a cost), no rows were admitted, the batch kept its size, within `Tuning.settle`
        rounds; a drafter whose reach changes by round (prompt lookup) is scored every round."""
        rounds = self.costs.rounds
        if self.scored is not None and view.reach is None and not view.admitted and self.last == 0:
            (n, since), scores = self.scored
            if n == view.n and rounds - since < self.tuning.settle:
                return scores
        scores = self.scores(view)
        self.scored = ((view.n, rounds), scores)
        return scores

    def rate_sd(self, a: np.ndarray, tested: np.ndarray, pair: float) -> np.ndarray:
        """[n] the standard deviation of rows' rate estimates: a row's own tested tokens, and the pair's rate it
        is shrunk towards (`Tuning.row_weight`), itself resting on all rows' tested tokens and a weak prior. Until the
        pair has been tested much, every row's estimate is that uncertain: lengths that could win on it are
        re-timed, which tests them (one row, or rows apart, never stop drafting on the prior alone)."""
        weight = self.tuning.row_weight
        w = weight / (tested + weight)
        own = tested * a * (1 - a) / (tested + weight) ** 2
        return np.sqrt(w ** 2 * pair * (1 - pair) / self.pair_tested + own)

    def split(self, c: int) -> tuple[int, int]:
        """Choice index -> (K, s)."""
        return c % (self.spec.max_draft_tokens + 1), c // (self.spec.max_draft_tokens + 1)

    def choose(self, view: BatchView) -> int:
        n, b, costs, t = view.n, bucket(view.n), self.costs, self.tuning
        probe = self.probe
        if probe is not None and probe.bucket == b and probe.samples_left > 0 and probe.rounds_left > 0:
            probe.rounds_left -= 1
            return self.take(probe.choice)
        scores = self.recent_scores(view)
        if self.decided is not None and self.decided[0] is scores and probe is None and costs.rounds < self.decided[2]:
            return self.take(self.decided[1])  # the same scores, and no re-timing due yet: the same choice
        tokens, sd, cost = scores
        known = np.flatnonzero(~np.isnan(cost))
        if not len(known):
            self.decided = (scores, 0, np.inf)
            return self.take(0)
        best = best_length(tokens, cost)
        mean, hope = tokens / cost, (tokens + t.optimism * sd) / cost
        if probe is not None and probe.bucket == b:  # a re-timing ended: did it change the choice? could it still?
            if best != probe.before:  # it did: every length's turn comes round again soon
                self.wait = {key: w for key, w in self.wait.items() if key[0] != b}
            elif hope[probe.choice] < mean[best]:  # it cannot: its own turn comes half as often
                self.wait[(b, probe.choice)] = min(2 * self.wait.get((b, probe.choice), t.refresh), t.max_wait)
        self.probe = None
        in_step = self.in_step(n)
        if in_step and best and mean[best] < (1 + t.step_margin) * mean[0]:
            best = 0  # a small gain does not pay for putting rows out of step (`Tuning.step_margin`)
        self.choice[b] = best
        ranked = [best] + sorted((int(k) for k in known if k != best), key=lambda k: hope[k], reverse=True)
        if best == 0 and in_step and costs.profile.prefill_fixed > 0:
            self.decided = (scores, best, np.inf)
            return self.take(best)  # a probe would put rows that share their admissions out of step for good
        k_best, s_best = self.split(best)
        near = {best - 1, best + 1, 0, *ranked[1:2], *(best + (s - s_best) * (self.spec.max_draft_tokens + 1)
                                                       for s in self.sibling_choices)}  # the same K at other widths
        due = np.inf  # the round the first of the lengths that could be re-timed falls stale
        for c in ranked[1:]:
            stamp = costs.stamp.get((b, *self.split(c)))
            # a neighbour never run live rests on one start-up timing alone (a loaded machine's, maybe): once
            if c in near and (stamp is None or hope[c] >= t.retime_within * mean[best]):
                stale_at = (stamp or 0) + self.wait.get((b, c), t.refresh) + 1
                if costs.rounds >= stale_at:
                    self.probe = _Probe(b, best, c, t.probe_samples, t.probe_rounds)
                    return self.take(c)
                due = min(due, stale_at)
        self.decided = (scores, best, due)
        return self.take(best)

    def take(self, c: int) -> int:
        """Plan choice c: its K (returned) and its siblings per node."""
        k, s = self.split(c)
        if self.siblings is not None:
            self.siblings = s
        return k

    def drafts_soon(self, view: BatchView) -> bool:
        b = bucket(view.n)
        if b not in self.choice:
            self.choose(view)
        return self.choice.get(b) != 0

    def widens_soon(self, view: BatchView) -> bool:
        return self.drafts_soon(view) and self.split(self.choice[bucket(view.n)])[1] > 0

    def plan(self, view: BatchView) -> int:
        if view.admitted and self.last is not None:  # rows admitted after this kind of round
            keep_last(self.groups[self.last > 0], view.admitted, self.tuning.kept)
        return self.choose(view)

    def observe(self, r: RoundResult) -> None:
        n, depth = r.n, r.depths
        k = int(depth.max()) if n else 0  # what ran: rows near max_new_tokens draft less than asked
        s = self.siblings or 0 if k else 0
        # the first drafting round after plain ones also feeds the draft every token those emitted: no sample
        if r.seconds is not None and n and not (k and self.last == 0):
            self.costs.observe(n, k, r.seconds, s, r.verify_width)
            if self.probe is not None and (self.probe.bucket, *self.split(self.probe.choice)) == (bucket(n), k, s):
                self.probe.samples_left -= 1
        self.last = k
        self.emitted[:n] += r.accepted + 1
        if k:
            tested = r.accepted + (r.accepted < depth)  # the first rejected level was tested too
            self.accepted[:n] += r.accepted
            self.tested[:n] += tested
            self.pair_accepted += float(r.accepted.sum())
            self.pair_tested += float(tested.sum())
            d = np.arange(1, self.levels.shape[2] + 1)[None, :]
            self.levels[s, 0] += ((depth[:, None] >= d) & (r.accepted[:, None] >= d - 1)).sum(0)
            self.levels[s, 1] += (r.accepted[:, None] >= d).sum(0)
            if s:
                self.fan[s][0] += float(r.drafted.sum())
                self.fan[s][1] += float(depth.sum())
        for i in np.flatnonzero(r.finished):
            keep_last(self.lengths, float(self.emitted[i]), self.tuning.kept)


def logit(p):
    p = np.clip(p, 1e-3, 0.999)
    return np.log(p) - np.log1p(-p)


def expit(x):
    return 1.0 / (1.0 + np.exp(-x))
