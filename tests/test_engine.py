"""Engine invariants: greedy losslessness, acceptance extremes, stats, stops, bad prompts."""

import pytest

from engine_models import MAX_NEW, check_stats, pair, run, tiny_llama
from specdec.config import SamplingParams, SpecConfig
from specdec.engine import SpecEngine

@pytest.mark.parametrize("bs", [1, 3, 8])
@pytest.mark.parametrize("kind", ["random", "noisy", "same"])
@pytest.mark.parametrize("k", [None, 4])  # the default policy, and a fixed length
def test_greedy_speculative_equals_autoregressive(target, drafts, prompts, reference, bs, kind, k):
    results = run(target, drafts[kind], prompts, bs=bs, k=k)
    for r, ref in zip(results, reference):
        assert r.token_ids == ref
        assert r.finish_reason == "length"
        check_stats(r)
    rate = sum(r.accepted_tokens for r in results) / sum(r.drafted_tokens for r in results)
    if kind == "same":
        assert all(r.acceptance_rate == 1.0 for r in results)
        assert all(r.mean_accepted_length > 4 for r in results)  # 4 or more accepted + the bonus, per round
    elif kind == "random":
        assert rate < 0.2
    else:
        assert 0.2 < rate < 0.95


@pytest.mark.parametrize("bs", [1, 8])
def test_method_none_and_prompt_lookup_are_lossless(target, prompts, reference, bs):
    for method in ("none", "prompt_lookup"):
        results = run(target, None, prompts, method=method, bs=bs, k=4)
        assert [r.token_ids for r in results] == reference
        for r in results:
            check_stats(r)
            if method == "none":
                assert r.rounds == MAX_NEW and r.drafted_tokens == 0 and r.mean_accepted_length == 1.0


def test_prompt_lookup_is_lossless_and_accepts(target, prompts):
    plain = run(target, None, prompts, method="none", max_new=80)
    looked = run(target, None, prompts, method="prompt_lookup", max_new=80)  # the default policy
    assert [r.token_ids for r in looked] == [r.token_ids for r in plain]
    assert sum(r.accepted_tokens for r in looked) > 0
    assert all(r.draft_forwards == 0 for r in looked)


def test_lookup_takes_latest_longest_match():
    from specdec.spec.proposers.prompt_lookup import NgramPool

    def lookup(seq, k, max_ngram, min_ngram):
        starts = NgramPool(max_ngram, min_ngram).lookup(list(seq))
        return list(seq[starts[-1] : starts[-1] + k]) if starts else []

    seq = [1, 2, 3, 9, 9, 2, 3, 4, 5, 7, 2, 3]
    assert lookup(seq, 3, max_ngram=3, min_ngram=1) == [4, 5, 7]  # latest "2 3" is followed by 4 5 7
    assert lookup([7, 1, 2, 8, 8, 1, 2], 2, 3, 1) == [8, 8]
    assert lookup([1, 2, 3], 4, 3, 1) == []  # no earlier occurrence of any suffix
    assert lookup([5, 1, 5], 4, 3, 2) == []  # min_ngram 2: a 1-gram hit does not count
    pool = NgramPool(6, 1)  # incremental: what was indexed stays, new tokens add their n-grams
    pool.extend([4, 5, 6])
    assert pool.lookup([4, 5, 6, 1, 4, 5]) == [2]  # "4 5" -> 6, indexed when 6 was appended
    assert pool.lookup([4, 5, 6, 1, 4, 5, 9, 1, 4]) == [5]  # the latest "1 4" now: followed by 5 at index 5
    assert NgramPool(6, 1).lookup([4, 5, 6, 1, 4, 5, 7, 4, 5]) == [2, 6]  # every occurrence, the latest last


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
    cut = run(target, drafts["noisy"], prompts, bs=4, k=4, draft_vocab=48)  # draft scores half the ids
    assert [r.token_ids for r in cut] == reference
    for policy in ("heuristic", "confidence"):
        results = run(target, drafts["noisy"], prompts, bs=4, draft_length=policy, max_draft_tokens=8)
        assert [r.token_ids for r in results] == reference
        for r in results:
            check_stats(r)
        lengths = {d for r in results for d in r.draft_lengths}
        assert len(lengths) > 2  # lengths really vary per round and row


def test_mismatched_pair_refused(target):
    from specdec.exec.models import PairMismatchError, check_vocab
    with pytest.raises(PairMismatchError, match="output sizes differ"):
        check_vocab(target, tiny_llama(vocab=50), None, None)


def test_verify_widths_explore_then_pad_only_when_measured_cheaper():
    from specdec.plan.costmodel import TUNING, VerifyWidths

    w = VerifyWidths(max_width=9)
    assert w.choose(1, 1) == 1  # a plain decoding step is never padded
    cost = {3: 0.081, 4: 0.064, 5: 0.065, 6: 0.070, 7: 0.086}  # a CPU's measured widths (bench/results/README.md)
    tried = []
    for _ in range(10):
        width = w.choose(1, 3)
        tried.append(width)
        w.observe(1, width, cost[width])
    reach = range(3, 3 + TUNING.pad + 1)  # widths 3..7
    assert tried == sorted(tried) and set(tried) == set(reach)  # the reachable widths, smallest first ...
    assert all(tried.count(width) == TUNING.width_samples for width in reach)  # ... each timed `width_samples` times
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
    widths = padded.context.widths
    widths.choose = lambda n, w0: w0 if w0 == 1 else min(w0 + 3, widths.max_width)
    a, b = plain.generate(prompts), padded.generate(prompts)
    assert plain.context.widths is None
    assert any(width > 4 for (_, width) in widths.times)  # rounds really ran wider
    for x, y in zip(a, b):
        assert (x.token_ids, x.draft_lengths, x.accept_lengths) == (y.token_ids, y.draft_lengths, y.accept_lengths)
