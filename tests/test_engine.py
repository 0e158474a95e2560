"""Engine invariants: greedy losslessness, acceptance extremes, stats, stops, bad prompts."""

import re

import numpy as np
import pytest
import torch

from engine_models import noisy_copy, pair, tiny_llama
from specdec.config import SamplingParams, SpecConfig
from specdec.engine import SpecEngine

MAX_NEW = 24


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0)


@pytest.fixture(scope="module")
def drafts(target):
    return {
        "random": tiny_llama(layers=1, seed=7),  # unrelated: almost nothing accepted
        "noisy": noisy_copy(target, 0.02),  # partial acceptance
        "same": target,  # everything accepted
    }


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(3)
    lengths = [5, 17, 1, 9, 30, 3, 12, 8]
    return [torch.randint(0, 96, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def reference(target, prompts):
    """Plain greedy from transformers' own generate, one prompt at a time."""
    out = []
    for p in prompts:
        ids = target.generate(torch.tensor([p], device=target.device), max_new_tokens=MAX_NEW,
                              min_new_tokens=MAX_NEW, do_sample=False)
        out.append(ids[0, len(p):].tolist())
    return out


def run(target, draft, prompts, method="draft_model", bs=8, k=4, max_new=MAX_NEW, stop=(), **spec):
    eng = SpecEngine(pair(target, draft, stop), SamplingParams(max_new_tokens=max_new),
                     SpecConfig(method=method, num_draft_tokens=k, **spec), batch_size=bs)
    return eng.generate(prompts)


def check_stats(r):
    assert sum(r.accept_lengths) == r.accepted_tokens
    assert sum(r.draft_lengths) == r.drafted_tokens
    assert len(r.draft_lengths) == len(r.accept_lengths) == r.rounds
    assert all(0 <= a <= d for a, d in zip(r.accept_lengths, r.draft_lengths))
    assert r.generated_tokens <= r.accepted_tokens + r.rounds
    assert r.mean_accepted_length == pytest.approx(r.generated_tokens / r.rounds)


@pytest.mark.parametrize("bs", [1, 3, 8])
@pytest.mark.parametrize("kind", ["random", "noisy", "same"])
def test_greedy_speculative_equals_autoregressive(target, drafts, prompts, reference, bs, kind):
    results = run(target, drafts[kind], prompts, bs=bs)
    for r, ref in zip(results, reference):
        assert r.token_ids == ref
        assert r.finish_reason == "length"
        check_stats(r)
    rate = sum(r.accepted_tokens for r in results) / sum(r.drafted_tokens for r in results)
    if kind == "same":
        assert all(r.acceptance_rate == 1.0 for r in results)
        assert all(r.mean_accepted_length > 4 for r in results)  # k=4 accepted + bonus per round
    elif kind == "random":
        assert rate < 0.2
    else:
        assert 0.2 < rate < 0.95


@pytest.mark.parametrize("bs", [1, 8])
def test_method_none_and_prompt_lookup_are_lossless(target, prompts, reference, bs):
    for method in ("none", "prompt_lookup"):
        results = run(target, None, prompts, method=method, bs=bs)
        assert [r.token_ids for r in results] == reference
        for r in results:
            check_stats(r)
            if method == "none":
                assert r.rounds == MAX_NEW and r.drafted_tokens == 0 and r.mean_accepted_length == 1.0


def test_prompt_lookup_is_lossless_and_accepts(target, prompts):
    plain = run(target, None, prompts, method="none", max_new=80)
    looked = run(target, None, prompts, method="prompt_lookup", max_new=80)
    assert [r.token_ids for r in looked] == [r.token_ids for r in plain]
    assert sum(r.accepted_tokens for r in looked) > 0
    assert all(r.draft_forwards == 0 for r in looked)


def test_lookup_takes_latest_longest_match():
    from specdec.proposers.prompt_lookup import lookup
    seq = np.array([1, 2, 3, 9, 9, 2, 3, 4, 5, 7, 2, 3])
    assert lookup(seq, 3, max_ngram=3, min_ngram=1) == [4, 5, 7]  # latest "2 3" is followed by 4 5 7
    assert lookup(np.array([7, 1, 2, 8, 8, 1, 2]), 2, 3, 1) == [8, 8]
    assert lookup(np.array([1, 2, 3]), 4, 3, 1) == []  # no earlier occurrence of any suffix
    assert lookup(np.array([5, 1, 5]), 4, 3, 2) == []  # min_ngram 2: a 1-gram hit does not count


def test_more_rows_than_batch_and_per_row_lengths(target, drafts, prompts, reference):
    # 8 prompts through 3 slots: rows join as others leave; each row's rounds are its own
    results = run(target, drafts["noisy"], prompts * 2, bs=3, k=3)
    assert [r.token_ids for r in results] == reference * 2
    assert len({tuple(r.accept_lengths) for r in results}) > 1


def test_stop_token_inside_accepted_draft(target, prompts, reference):
    # stop at a token the greedy output reaches: output ends right after it, finish_reason stop
    i, stop = next((i, ref[6]) for i, ref in enumerate(reference) if ref[6] not in ref[:6])
    r = run(target, target, [prompts[i]], k=8, stop=(stop,))[0]
    assert r.token_ids == reference[i][:7]
    assert r.finish_reason == "stop"
    check_stats(r)


def test_bad_prompts_become_error_rows(target, prompts, reference):
    bad = [[], [10**6], list(range(50)) * 20]
    results = run(target, target, [prompts[0]] + bad, max_new=MAX_NEW)
    assert results[0].token_ids == reference[0]
    assert [r.finish_reason for r in results[1:]] == ["error"] * 3
    assert "empty" in results[1].error and "range" in results[2].error and "positions" in results[3].error


def test_draft_length_policies_stay_lossless(target, drafts, prompts, reference):
    cut = run(target, drafts["noisy"], prompts, bs=4, draft_vocab=48)  # draft scores half the ids
    assert [r.token_ids for r in cut] == reference
    for policy in ("heuristic", "confidence"):
        results = run(target, drafts["noisy"], prompts, bs=4, draft_length=policy, max_draft_tokens=8)
        assert [r.token_ids for r in results] == reference
        for r in results:
            check_stats(r)
        lengths = {d for r in results for d in r.draft_lengths}
        assert len(lengths) > 2  # lengths really vary per round and row


def test_mismatched_pair_refused(target):
    from specdec.models import PairMismatchError, check_vocab
    with pytest.raises(PairMismatchError, match="output sizes differ"):
        check_vocab(target, tiny_llama(vocab=50), None, None)


def test_goodput_is_lossless_and_follows_acceptance(target, drafts, prompts, reference):
    spec = dict(draft_length="goodput", max_draft_tokens=4)
    for kind in ("random", "same", "noisy"):
        results = run(target, drafts[kind], prompts, bs=4, **spec)
        assert [r.token_ids for r in results] == reference
        for r in results:
            check_stats(r)
    # (whether speculation pays on these tiny models is the machine's business; choosing from given
    # times and rates is tested on a fake clock below)


@pytest.mark.parametrize("rate,draft_cost,expected", [
    (0.02, 0.3, 0),  # a useless draft: speculation off
    (0.98, 0.1, 6),  # a near-perfect cheap draft: the longest length
    (0.7, 0.2, 3),   # tokens/time: k=2 2.19/1.4=1.56, k=3 2.53/1.6=1.58, k=4 2.77/1.8=1.54
])
def test_goodput_choice_from_measured_times(rate, draft_cost, expected):
    from specdec.policy import GoodputLength, Slots
    slots = Slots(8, "cpu")
    memory = {"goodput_times": {(8, k): [1.0 + draft_cost * k] * 3 for k in range(7)}}  # K=0: 1 s, others x
    pol = GoodputLength(SpecConfig(draft_length="goodput", max_draft_tokens=6), slots, memory)
    pol.admit(0, 8)
    pol.tested[:8] = 1000.0
    pol.accepted[:8] = 1000.0 * rate
    pol.total[:] = [8000.0 * rate, 8000.0]  # the pair's rate is over the same rows
    assert pol.choose(8) == expected
    assert memory["goodput_best"] == {8: expected}
    # a batch-size bucket not timed yet borrows bucket 8's times (scaled): same choice, no exploration
    assert pol.bucket(3) == 4 and pol.choose(3) == expected
    # with nothing timed, the plain round (the baseline) is timed first
    fresh = GoodputLength(SpecConfig(draft_length="goodput", num_draft_tokens=3, max_draft_tokens=6), slots, {})
    assert fresh.choose(8) == 0


def drive_goodput(pol, n, cost, rate, rounds, gen):
    """Run `rounds` rounds of a goodput policy against a simulated batch: round time cost[K] (seconds,
    on the policy's clock) and per-token acceptance `rate`; returns the K of every round."""
    from unittest import mock

    import specdec.policy as policy_mod
    clock = [0.0]
    chosen = []
    with mock.patch.object(policy_mod.time, "perf_counter", lambda: clock[0]):
        for _ in range(rounds):
            k = int(pol.limits(n))
            clock[0] += cost[k]
            passes = torch.rand((n, max(k, 1)), generator=gen) < rate
            accepted = torch.cumprod(passes.long(), dim=1)[:, :k].sum(1)
            pol.observe(n, torch.full((n,), k), accepted)
            chosen.append(k)
    return chosen


def test_goodput_explores_only_lengths_that_could_win():
    """Where one drafted token already costs more than it can earn (a compute-bound target), the longer
    lengths are never tried: they would cost at least as much and earn at most (1 - a^(K+1))/(1 - a)."""
    from specdec.policy import GoodputLength, Slots
    gen = torch.Generator().manual_seed(0)
    cost = {0: 0.004, 1: 0.012, 2: 0.016, 3: 0.020, 4: 0.024}  # K=1: 1.5 tokens for 3x the time
    pol = GoodputLength(SpecConfig(draft_length="goodput", max_draft_tokens=4), Slots(8, "cpu"), {})
    pol.admit(0, 8)
    chosen = drive_goodput(pol, 8, cost, 0.5, 120, gen)
    # plain rounds first (the baseline); a length's first round after plain ones is not a sample of it
    # (a draft model catches up on the plain rounds' tokens), so the first timing from K=0 takes two
    # rounds; K=1 then earns half of K=0's tokens per second, too far behind to be worth re-timing
    assert chosen[:6] == [0, 0, 0, 1, 1, 0] and chosen[6:] == [0] * 114
    # memory-bound (each drafted token nearly free) and a good draft: the search walks up to the top
    cheap = {k: 0.004 + 0.0004 * k for k in range(5)}
    pol = GoodputLength(SpecConfig(draft_length="goodput", max_draft_tokens=4), Slots(8, "cpu"), {})
    pol.admit(0, 8)
    chosen = drive_goodput(pol, 8, cheap, 0.9, 40, gen)
    assert chosen[:8] == [0, 0, 0, 1, 1, 2, 3, 4] and pol.best[8] == 4
    assert chosen[8:].count(4) >= 0.85 * len(chosen[8:])  # but for re-timings of K=3


@pytest.mark.parametrize("method", ["draft_model", "prompt_lookup"])
def test_startup_profile_times_every_bucket_and_leaves_no_trace(target, drafts, prompts, reference, method):
    """A goodput engine times rounds at start-up on synthetic rows: every batch-size bucket up to
    batch_size gets its plain-round level (3 samples) and K=1 as a ratio to it, verify padding gets
    widths to choose from; the synthetic rows leave nothing behind (output equals plain greedy)."""
    eng = SpecEngine(pair(target, drafts["noisy"]), SamplingParams(max_new_tokens=MAX_NEW),
                     SpecConfig(method=method, draft_length="goodput", max_draft_tokens=4), batch_size=3)
    times = eng.policy_memory["goodput_times"]
    assert eng.profile_s > 0
    for b in (1, 2, 4):  # n = 1, 2 and 3 rows
        assert len(times[(b, 0)]) == 3 and (b, 1) in times
        assert {w for (bb, w) in eng.widths.times if bb == b} >= {1, 2}
    joining = eng.policy_memory["goodput_admission"]  # a row joining alone: a prefill call's fixed cost ...
    assert joining["fixed"] >= 0 and joining["row_tokens"] == MAX_NEW
    assert (joining["draft"] > 0) == (method == "draft_model")  # ... and its draft prefill, if there is a draft
    results = eng.generate(prompts)
    assert [r.token_ids for r in results] == reference
    for r in results:
        check_stats(r)
    fixed = SpecEngine(pair(target, drafts["noisy"]), SamplingParams(max_new_tokens=MAX_NEW),
                       SpecConfig(method=method), batch_size=3)
    assert fixed.profile_s == 0 and not fixed.policy_memory  # only policies that plan from times profile


def test_profile_times_only_lengths_that_could_win():
    """The start-up profile times a longer length only if it could win at an optimistic acceptance
    (0.8 per token) and at the cost of the dearest length timed plus one more draft forward."""
    from specdec.policy import GoodputLength, Slots
    pol = GoodputLength(SpecConfig(draft_length="goodput", max_draft_tokens=8), Slots(1, "cpu"), {})
    # tokens per round at 0.8: K=1 1.8, K=2 2.44. Compute-bound: K=1 costs 2.5 plain rounds
    assert not pol.worth_timing(2, {0: 1.0, 1: 2.5}, 2.6)  # 2.44 / 2.6 < 1 token per plain round
    assert pol.worth_timing(2, {0: 1.0, 1: 1.05}, 1.1)  # memory-bound: 2.44 / 1.1 > 1.8 / 1.05


def test_profiled_goodput_starts_at_its_choice():
    """Given the profile's round times, the first live rounds run the length they favour: no plain
    rounds first and no walk through the lengths (compare test_goodput_explores_only_lengths_that_could_win)."""
    from specdec.policy import GoodputLength, Slots
    gen = torch.Generator().manual_seed(0)

    def profiled(cost):
        pol = GoodputLength(SpecConfig(draft_length="goodput", max_draft_tokens=4), Slots(8, "cpu"), {})
        for k, seconds in cost.items():
            for _ in range(3 if k == 0 else 1):  # as SpecEngine.profile hands them over
                pol.record(8, k, seconds)
        pol.admit(0, 8)
        return pol

    compute_bound = {0: 0.004, 1: 0.012}  # K=1: 1.5 tokens for 3x the time; longer K never timed
    chosen = drive_goodput(profiled(compute_bound), 8, {**compute_bound, 2: 0.016, 3: 0.02, 4: 0.024}, 0.5, 30, gen)
    assert chosen[: GoodputLength.refresh] == [0] * GoodputLength.refresh  # no exploration round at all
    cheap = {k: 0.004 + 0.0004 * k for k in range(5)}  # memory-bound, and a good draft
    chosen = drive_goodput(profiled(cheap), 8, cheap, 0.9, 30, gen)
    first = chosen[: GoodputLength.refresh]  # before the first re-timing of a neighbour
    assert 0 not in first and chosen[0] >= 2 and first[-10:] == [4] * 10


@pytest.mark.parametrize("kind", ["same", "noisy"])
def test_rows_joining_while_goodput_is_off_skip_the_draft_prefill(target, drafts, prompts, reference, kind,
                                                                  monkeypatch):
    """While goodput's choice is K=0, admitted rows are not prefilled in the draft; the first drafting
    round feeds them whole. With the target as its own draft every drafted token must then be accepted
    (a wrong draft cache would propose other tokens), and output stays equal to plain greedy."""
    from specdec.policy import GoodputLength
    bs = 3
    b = GoodputLength.bucket(bs)
    eng = SpecEngine(pair(target, drafts[kind]), SamplingParams(max_new_tokens=MAX_NEW),
                     SpecConfig(method="draft_model", draft_length="goodput", max_draft_tokens=4), batch_size=bs)
    eng.policy_memory.clear()  # what the start-up profile measured: this test sets the policy's state itself
    eng.policy_memory.update({"goodput_best": {b: 0},  # off when the first rows join ...
                              "goodput_total": [99.0, 100.0],  # ... but drafting pays from the first round
                              "goodput_times": {(b, 0): [1.0] * 3, **{(b, k): [1.0 + 0.01 * k] for k in range(1, 5)}}})
    from specdec.proposers.draft_model import DraftModelProposer
    joined = []
    admit = DraftModelProposer.admit

    def spy(self, start, end):
        admit(self, start, end)
        joined.append(self.d_len[start:end].tolist())

    monkeypatch.setattr(DraftModelProposer, "admit", spy)
    results = eng.generate(prompts)
    assert joined[0] == [0] * bs  # the first rows joined unprefilled
    assert any(v > 0 for later in joined[1:] for v in later)  # once drafting, rows are prefilled on joining
    assert [r.token_ids for r in results] == reference
    for r in results:
        check_stats(r)
        assert r.draft_lengths[0] > 0
    if kind == "same":
        assert all(r.accepted_tokens == r.drafted_tokens > 0 for r in results)


def test_goodput_acceptance_estimate_is_unbiased_for_long_drafts():
    """Per-token acceptance comes from tested tokens (accepted + the first rejected one): with K=4
    drafts and a true rate of 0.6, accepted / drafted would say ~0.3 and shun long drafts."""
    from specdec.policy import GoodputLength, Slots
    a, k, n = 0.6, 4, 8
    pol = GoodputLength(SpecConfig(draft_length="goodput", max_draft_tokens=k), Slots(n, "cpu"), {})
    pol.admit(0, n)
    gen = torch.Generator().manual_seed(0)
    drafted = torch.full((n,), k)
    for _ in range(400):
        passes = torch.rand((n, k), generator=gen) < a
        accepted = torch.cumprod(passes.long(), dim=1).sum(1)  # leading run of accepted tokens
        pol.observe(n, drafted, accepted)
    per_row = pol.expected_tokens(n, k)[k] / n
    assert per_row == pytest.approx((1 - a ** (k + 1)) / (1 - a), rel=0.05)


def test_goodput_retimes_a_stale_neighbour():
    """A length measured once, slowly (a busy machine, a first call at a new shape), must not stay
    shunned for good: once `refresh` rounds stale it is timed again, until the median is fresh
    samples', and the new measurement counts. A re-timing that confirms the choice doubles the wait
    before the next one."""
    from specdec.policy import GoodputLength, Slots
    memory = {"goodput_times": {(8, 0): [1.0] * 3, (8, 1): [1.6], (8, 2): [2.2]},  # K>0: ratios to K=0
              "goodput_stamp": {(8, 0): 0, (8, 1): 0, (8, 2): 0}, "goodput_round": 0,
              "goodput_total": [4000.0, 10000.0]}
    pol = GoodputLength(SpecConfig(draft_length="goodput", max_draft_tokens=2), Slots(8, "cpu"), memory)
    pol.admit(0, 8)
    pol.tested[:8], pol.accepted[:8] = 1000.0, 400.0  # a = 0.4: K=1 earns 1.4 tokens, K=2 1.56
    refresh = GoodputLength.refresh
    # in truth K=1 takes 1.2 s: 1.4 tokens per 1.2 s beats 1 per 1.0 s (and 1.56 per 2.2 s)
    chosen = drive_goodput(pol, 8, {0: 1.0, 1: 1.2, 2: 2.2}, 0.4, 250, torch.Generator().manual_seed(0))
    assert chosen[: refresh + 1] == [0] * (refresh + 1)  # 1.4 per 1.6 s loses, until K=1 is stale
    # K=1 again: its first round is the draft's catch-up, two more are samples, which outvote the slow one
    assert chosen[refresh + 1: refresh + 4] == [1, 1, 1]
    after = "".join(map(str, chosen[refresh + 4:]))
    assert after.count("1") >= 0.9 * len(after)  # K=1 from then on, but for re-timings of K=0 and K=2
    probes = [(m.start(), m.group()) for m in re.finditer("0+|2+", after)]
    # two fresh samples each (not after plain rounds); K=2 (1.56 per 2.2 s) is too far behind to re-time
    assert {p for _, p in probes} == {"00"}
    gaps = [b - a for (a, _), (b, _) in zip(probes, probes[1:])]
    assert len(probes) >= 3 and gaps == sorted(gaps)  # each confirmation doubles the wait
    assert memory["goodput_wait"][8] >= 4 * refresh


@pytest.mark.parametrize("k1", [1.9, 1.85])
def test_goodput_retimes_the_runner_up_after_plain_rounds_win(k1):
    """Where K=1 is the worst drafting length (one draft forward for at most one token; on the CPU,
    verify shapes of 2 and 3 tokens cost more than 5) and K=2 was once timed slowly, K=0 wins; the
    runner-up, K=2 (0.89 of K=0's tokens per second), is re-timed and takes over. Its neighbour K=1 is
    either too far behind to re-time (k1 = 1.9: 0.84) or close but less promising (1.85: 0.86), and
    then re-timed after K=2: a re-timing that confirms K=0 doubles the wait of both, so K=1 first would
    leave K=2, the one that wins, waiting twice as long."""
    from specdec.policy import GoodputLength, Slots
    memory = {"goodput_times": {(8, 0): [1.0] * 3, (8, 1): [k1] * 3, (8, 2): [2.2] * 3},
              "goodput_stamp": {(8, 0): 0, (8, 1): 0, (8, 2): 0}, "goodput_round": 0,
              "goodput_total": [6000.0, 10000.0]}
    pol = GoodputLength(SpecConfig(draft_length="goodput", max_draft_tokens=2), Slots(8, "cpu"), memory)
    pol.admit(0, 8)
    pol.tested[:8], pol.accepted[:8] = 1000.0, 600.0  # a = 0.6: K=1 earns 1.6 tokens, K=2 1.96
    cost = {0: 1.0, 1: k1, 2: 1.7}  # K=2 really: 1.96 per 1.7 s beats 1 per 1.0 s
    chosen = drive_goodput(pol, 8, cost, 0.6, 200, torch.Generator().manual_seed(0))
    runs = "".join(map(str, chosen))
    # once stale, the runner-up (not K=1's "111"): its first round catches the draft up, two more are samples
    assert runs.startswith("0" * 25 + "222")
    assert runs[28:].count("2") >= 0.9 * len(runs[28:])  # and it wins from then on


def test_goodput_charges_the_admissions_speculation_brings_on():
    """Rows in step finish, and join, together; speculation puts them out of step, so each joins alone,
    paying a prefill call's fixed cost (and its draft prefill). Goodput charges a length for the
    admissions it brings on: a length that wins by round times alone loses where rows wait and those
    costs outweigh its gain, and is free of them where they do not apply."""
    from specdec.policy import GoodputLength, Slots
    cost = {0: 1.0, 1: 1.35}  # a = 0.5: K=1 earns 1.5 tokens for 1.35 plain rounds, 11% more per second
    # at 8 rows: K=1 finishes 12/64 rows a round, each joining alone (2 s), where K=0's 8/64 share one call
    # (2/8 s): 12 / (1.35 + 0.375) tokens a second against 8 / 1.03

    def run(n, waiting, fixed, in_step=True):
        memory = {"goodput_times": {(8, 0): [1.0] * 3, (8, 1): [1.35] * 3, (1, 0): [1.0] * 3, (1, 1): [1.35] * 3},
                  "goodput_stamp": {(8, 0): 0, (8, 1): 0, (1, 0): 0, (1, 1): 0}, "goodput_total": [5000.0, 10000.0]}
        pol = GoodputLength(SpecConfig(draft_length="goodput", max_draft_tokens=1), Slots(8, "cpu"), memory)
        pol.record_admission(fixed, 0.01, 64)
        pol.admit(0, n)
        pol.waiting = waiting
        if not in_step:
            pol.emitted[:n] = torch.arange(n, dtype=torch.float64)  # rows that joined at different rounds
        return drive_goodput(pol, n, cost, 0.5, 60, torch.Generator().manual_seed(0))

    assert run(8, waiting=100, fixed=0.0).count(1) >= 55  # no fixed cost: the round times decide
    assert run(8, waiting=100, fixed=2.0) == [0] * 60  # rows in step stay in step: not even a probe
    assert run(8, waiting=0, fixed=2.0) == [0] * 60  # none waits, but speculating would spread the finish
    assert run(8, waiting=0, fixed=2.0, in_step=False).count(1) >= 55  # the drain of rows out of step
    assert run(1, waiting=100, fixed=2.0).count(1) >= 55  # one row joins alone whatever the length


def test_goodput_weight_follows_how_much_rows_differ():
    """A row's acceptance is shrunk towards the pair's by a weight estimated from the rows: rows that
    differ only by sampling noise get a large one (a row's lucky streak is not its rate), rows from two
    populations (code and chat, say) the smallest, so each follows its own."""
    from specdec.policy import GoodputLength, Slots
    gen = torch.Generator().manual_seed(0)
    pol = GoodputLength(SpecConfig(draft_length="goodput", max_draft_tokens=4), Slots(8, "cpu"), {})
    assert pol.weight(0) == pol.prior_weight  # no rows yet
    for _ in range(32):
        pol.rows.append((float((torch.rand(60, generator=gen) < 0.5).sum()), 60.0))
    assert pol.weight(0) >= 200
    pol.rows[:] = [(float((torch.rand(60, generator=gen) < rate).sum()), 60.0) for rate in [0.2, 0.8] * 16]
    assert pol.weight(0) == pol.min_weight  # rho = 0.09 / 0.25: a weight of 1.8, kept at the minimum
    # active rows count too, finished ones are kept when their slot is reused
    pol.rows.clear()
    pol.admit(0, 8)
    pol.tested[:8] = 60.0
    pol.accepted[:8] = torch.tensor([12.0, 48.0] * 4)
    assert pol.weight(8) == pol.min_weight
    pol.retire(3)
    assert pol.rows == [(48.0, 60.0)]


def test_goodput_ratios_follow_the_level():
    """Rounds slow down as rows grow: a length kept as a ratio to the plain round's time stays
    comparable to plain rounds timed much later (an absolute time from early on would look cheap)."""
    from specdec.policy import GoodputLength, Slots
    pol = GoodputLength(SpecConfig(draft_length="goodput", max_draft_tokens=1), Slots(8, "cpu"), {})
    pol.admit(0, 8)
    pol.tested[:8], pol.accepted[:8] = 1000.0, 400.0
    pol.times[(8, 0)] = [0.100] * 3
    pol.times[(8, 1)] = [1.6]  # 0.16 s when plain rounds took 0.10
    assert pol.estimate(8, 1) == pytest.approx(0.16)
    pol.times[(8, 0)] = [0.140] * 3  # rows are longer now
    assert pol.estimate(8, 1) == pytest.approx(0.224)
    assert pol.choose(8) == 0  # 1.4 / 0.224 < 1 / 0.14; with 0.16 absolute it would have been K=1
    # a bucket with nothing of its own borrows the nearest level (scaled by batch size) and ratios
    assert pol.estimate(16, 1) == pytest.approx(0.224 * 2)


def test_goodput_ratio_against_a_plain_round_of_as_many_rows(monkeypatch):
    """A draining batch: plain rounds cost about the same at 5 rows as at 8 (memory-bound). A K=1
    round at 5 rows is kept as a ratio to the plain round at 5 rows (1.5), not to the 8-row level scaled
    down by 5/8, which would make it look 2.4x a plain round and shut speculation off."""
    import specdec.policy as policy_mod
    clock = [0.0]
    monkeypatch.setattr(policy_mod.time, "perf_counter", lambda: clock[0])
    pol = policy_mod.GoodputLength(SpecConfig(draft_length="goodput", max_draft_tokens=1),
                                   policy_mod.Slots(8, "cpu"), {})
    pol.admit(0, 8)

    def round_of(n, seconds, k):
        pol._round = clock[0]  # what limits() records
        clock[0] += seconds
        pol.observe(n, torch.full((n,), k), torch.zeros(n, dtype=torch.int64))

    for _ in range(3):
        round_of(8, 0.100, 0)
    round_of(5, 0.090, 0)
    round_of(5, 0.300, 1)  # the first after plain rounds: the draft catches up on their tokens, no sample
    round_of(5, 0.135, 1)
    assert pol.times[(8, 1)] == [pytest.approx(1.5)]
    # no recent plain round at 3 rows: the 8-row level scaled to 3 rows is the reference
    round_of(3, 0.075, 1)
    assert pol.times[(4, 1)] == [pytest.approx(0.075 / (0.100 * 3 / 8))]
    for _ in range(policy_mod.GoodputLength.refresh + 1):  # the 5-row timing goes stale
        round_of(8, 0.100, 0)
    round_of(5, 0.300, 1)
    round_of(5, 0.135, 1)
    assert pol.times[(8, 1)][-1] == pytest.approx(0.135 / (0.100 * 5 / 8))


def test_verify_widths_explore_then_pad_only_when_measured_cheaper():
    from specdec.widths import VerifyWidths

    w = VerifyWidths(max_width=9)
    assert w.choose(1, 1) == 1  # a plain decoding step is never padded
    cost = {3: 0.081, 4: 0.064, 5: 0.065, 6: 0.070, 7: 0.086}  # the CPU shapes of the module docstring
    tried = []
    for _ in range(10):
        width = w.choose(1, 3)
        tried.append(width)
        w.observe(1, width, cost[width])
    assert tried[:10] == [3, 3, 4, 4, 5, 5, 6, 6, 7, 7]  # each reachable width timed twice, smallest first
    assert w.choose(1, 3) == 4  # 64 ms < 0.95 * 81 ms
    for width in (5, 6, 7, 8, 9):
        for _ in range(2):
            w.observe(1, width, {5: 0.065, 6: 0.062, 7: 0.086, 8: 0.09, 9: 0.1}[width])
    assert w.choose(1, 5) == 5  # 6 is cheaper, but by less than the 5% margin
    assert w.choose(1, 9) == 9  # no room past max_draft_tokens + 1
    # other batch sizes are timed apart, as if their bucket were full
    assert w.choose(8, 3) == 3 and w.choose(6, 3) == 3
    w.observe(6, 3, 0.06)
    assert w.times[(8, 3)] == [pytest.approx(0.08)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_padded_verification_changes_nothing_but_the_shape(target, drafts, prompts, temperature):
    """Forcing every round 3 positions wider: the same tokens and statistics as unpadded."""
    sp = SamplingParams(max_new_tokens=MAX_NEW, temperature=temperature, seed=4)
    spec = dict(method="draft_model", num_draft_tokens=3, draft_length="heuristic", max_draft_tokens=8)
    plain = SpecEngine(pair(target, drafts["noisy"]), sp, SpecConfig(verify_padding=False, **spec), batch_size=4)
    padded = SpecEngine(pair(target, drafts["noisy"]), sp, SpecConfig(**spec), batch_size=4)
    padded.widths.choose = lambda n, w0: w0 if w0 == 1 else min(w0 + 3, padded.widths.max_width)
    a, b = plain.generate(prompts), padded.generate(prompts)
    assert plain.widths is None
    assert any(width > 4 for (_, width) in padded.widths.times)  # rounds really ran wider
    for x, y in zip(a, b):
        assert (x.token_ids, x.draft_lengths, x.accept_lengths) == (y.token_ids, y.draft_lengths, y.accept_lengths)
