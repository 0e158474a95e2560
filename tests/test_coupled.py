"""Coupled sampling (`speculation.sampling: coupled`): a sampled row's tokens are those of plain decoding with its
seed, whatever the method and draft lengths, and they follow the target's distribution."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from engine_models import engine, pair, tiny_llama
from specdec.config import SamplingParams, SpecConfig
from specdec.engine import SpecEngine
from test_sampling import NEW as NEW3, PROMPT, V, empirical, exact_distribution, noise_bound, tv

NEW = 24
SETTINGS = {  # method, draft model, spec
    "k1": ("draft_model", "noisy", {"draft_length": "fixed", "num_draft_tokens": 1}),
    "k4": ("draft_model", "noisy", {"draft_length": "fixed", "num_draft_tokens": 4}),
    "goodput": ("draft_model", "noisy", {}),
    "lookup": ("prompt_lookup", None, {"draft_length": "fixed", "num_draft_tokens": 3}),
    "lookup-trees": ("prompt_lookup", None, {"draft_length": "fixed", "num_draft_tokens": 3,
                                             "prompt_lookup": {"alignment_sampling": 2}}),
}


def sampled(prompts):
    """Mostly sampled rows (one with top-p), one greedy row."""
    params = [SamplingParams(max_new_tokens=NEW, temperature=0.8, seed=1) for _ in prompts]
    params[1] = SamplingParams(max_new_tokens=NEW, temperature=1.0, top_p=0.9, seed=2)
    params[2] = SamplingParams(max_new_tokens=NEW)
    return params


def outputs(target, drafts, prompts, name, sampling="coupled", bs=8):
    method, draft, spec = SETTINGS.get(name, ("none", None, {}))
    eng = engine(target, drafts[draft] if draft else None, method, bs, NEW, sampling=sampling, **spec)
    return eng.generate(prompts * 2, params=sampled(prompts) * 2, keys=[f"r{i}" for i in range(2 * len(prompts))])


def test_coupled_tokens_do_not_depend_on_the_method_or_draft_lengths(target, drafts, prompts):
    plain = [r.token_ids for r in outputs(target, drafts, prompts, "none", bs=3)]
    assert plain[0] != plain[len(prompts)]  # rows of one prompt with other keys drew other samples
    for name in SETTINGS:
        results = outputs(target, drafts, prompts, name)
        assert [r.token_ids for r in results] == plain, name
        assert sum(r.accepted_tokens for r in results) > 0, name  # speculation ran and was accepted
    # under rejection sampling the draws depend on the draft lengths: what coupling removes
    k1, k4 = (outputs(target, drafts, prompts, k, sampling="rejection") for k in ("k1", "k4"))
    assert [r.token_ids for r in k1] != [r.token_ids for r in k4]


@pytest.mark.parametrize("method", ["draft_model", "prompt_lookup"])
def test_coupled_output_has_the_target_distribution(method):
    target, draft = tiny_llama(vocab=V, seed=0, init=0.15), tiny_llama(vocab=V, layers=1, seed=11, init=0.15)
    sp = SamplingParams(max_new_tokens=NEW3, temperature=0.9, top_k=6, seed=7)
    eng = SpecEngine(pair(target, draft if method == "draft_model" else None), sp,
                     SpecConfig(method=method, num_draft_tokens=2, draft_length="fixed", sampling="coupled",
                                prompt_lookup={"min_ngram": 1, "max_ngram": 2}), batch_size=512)
    n = 4000
    results = eng.generate([PROMPT] * n, keys=[f"row{i}" for i in range(n)])
    p_target = exact_distribution(target, sp)
    assert tv(empirical(results), p_target) <= noise_bound(p_target, n)
    drafted, accepted = sum(r.drafted_tokens for r in results), sum(r.accepted_tokens for r in results)
    assert 0 < accepted < drafted  # drafts were accepted and rejected


def test_coupled_sampling_needs_lossless_verification():
    with pytest.raises(ValidationError, match="speculation.sampling coupled needs speculation.verification lossless"):
        SpecConfig(method="prompt_lookup", verification="conditional", sampling="coupled")
