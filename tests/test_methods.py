"""The seeds' methods on tiny models in float32: AASD's token trees (lossless, and conditional
verification) and FSD's fuzzy verification, at their limits and in the direction of their knobs."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from engine_models import DEVICE, LOOKUP_NEW as NEW, noisy_copy, pair, tiny_llama
from specdec.sched.slots import Slots
from specdec.config import SamplingParams, SpecConfig
from specdec.engine import SpecEngine
from specdec.spec.sampling import Rows
from specdec.spec.trees import tree_inputs, verify_tree

def generate(target, draft, prompts, bs=8, fast_path=True, graphs=None, **spec):
    spec = {"num_draft_tokens": 4, "draft_length": "fixed", **spec}
    eng = SpecEngine(pair(target, draft), SamplingParams(max_new_tokens=NEW), SpecConfig(**spec), batch_size=bs,
                     fast_path=fast_path, step_graphs=graphs)
    out = eng.generate(prompts)
    if graphs:  # the static steps it ran (none fell back)
        runner = eng._runners["target"]
        assert not runner.eager, runner.eager
        generate.keys = set(runner.graphs.graphs)
    return out


def rate(results) -> float:
    return sum(r.accepted_tokens for r in results) / sum(r.drafted_tokens for r in results)


@pytest.mark.parametrize("bs", [1, 3, 8])
def test_prompt_lookup_with_and_without_trees_is_target_greedy(target, repeating, greedy, bs):
    runs = {}
    for s in (0, 2):
        # the lean forward, as static steps (a GPU's captured steps, trees' too, run eagerly) and transformers' modules
        for fast, graphs in ((True, None), (True, True), (False, None)) if bs == 8 else ((True, None), (True, True)):
            out = generate(target, None, repeating, bs, fast, graphs, method="prompt_lookup",
                           prompt_lookup={"alignment_sampling": s})
            assert [r.token_ids for r in out] == greedy
            assert all(r.verification == "lossless" for r in out)
            runs[s] = out
            if graphs:
                assert any(out == "tree" for *_, out in generate.keys) == (s > 0), generate.keys
    # the trees were real: more nodes verified, more tokens accepted, fewer target calls
    assert sum(r.drafted_tokens for r in runs[2]) > sum(r.drafted_tokens for r in runs[0])
    assert sum(r.accepted_tokens for r in runs[2]) > sum(r.accepted_tokens for r in runs[0])
    assert sum(r.rounds for r in runs[2]) < sum(r.rounds for r in runs[0])


def test_tree_mask_sees_the_cache_and_the_ancestors_only():
    # root 0; chain 1 -> 2 -> 3; node 4 a sibling of 2 (parent 1); node 5 a sibling of 1 (parent 0)
    parent = torch.tensor([[0, 1, 2, 1, 0]])
    depth = torch.tensor([[1, 2, 3, 2, 1]])
    positions, slots, mask = tree_inputs(parent, depth, torch.tensor([4]), kv_len=12, max_depth=3)
    assert positions.tolist() == [[4, 5, 6, 7, 6, 5]] and slots.tolist() == [[4, 5, 6, 7, 8, 9]]
    seen = [torch.nonzero(mask[0, 0, j]).flatten().tolist() for j in range(6)]
    assert seen == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5, 6, 7],
                    [0, 1, 2, 3, 4, 5, 8], [0, 1, 2, 3, 4, 9]]


def test_sampled_tree_verification_draws_from_the_target():
    """Every emitted token of a tree's round is a draw from p at its node, whatever the tree offers."""
    torch.manual_seed(0)
    n, vocab = 40000, 6
    logits = torch.randn(1, 4, vocab).expand(n, 4, vocab) * 1.5  # root and nodes 1..3
    p = torch.softmax(logits[0], -1)
    tokens = torch.tensor([[2, 3, 5]]).expand(n, 3)  # node 1 (2) and node 3 (5) children of the root, 2 (3) of 1
    parent, depth = torch.tensor([[0, 1, 0]]).expand(n, 3), torch.tensor([[1, 2, 1]]).expand(n, 3)
    rows = Rows.of(SamplingParams(temperature=1.0))
    v = verify_tree(logits, tokens, parent, depth, torch.full((n,), 3), 2, rows, torch.rand(n, 3))
    first = torch.where(v.accepted >= 1, tokens.gather(1, (v.path[:, :1] - 1).clamp(min=0)).squeeze(1), v.next_token)
    emp = torch.bincount(first, minlength=vocab).float() / n
    assert (emp - p[0]).abs().max() < 0.012
    # after the root emitted 2 (node 1), the next token is a draw from p at node 1
    after = v.accepted >= 1
    via = v.path[:, 0] == 1
    second = torch.where(v.accepted >= 2, torch.full_like(v.next_token, 3), v.next_token)[after & via]
    emp2 = torch.bincount(second, minlength=vocab).float() / len(second)
    assert (emp2 - p[1]).abs().max() < 0.03


def test_fuzzy_limits(target, repeating, greedy):
    draft = noisy_copy(target, 0.3)
    strict = generate(target, draft, repeating, verification="fuzzy", fuzzy={"threshold": 0.0})
    assert [r.token_ids for r in strict] == greedy
    assert all(r.verification == "fuzzy" for r in strict)
    same = generate(target, target, repeating, verification="fuzzy", fuzzy={"threshold": 1e-4})
    assert all(r.accepted_tokens == r.drafted_tokens > 0 for r in same)  # draft == target: every token passes
    # sampled, threshold 0 is the lossless rule itself: the same tokens from the same row seeds
    sp = SamplingParams(max_new_tokens=NEW, temperature=1.0, seed=7)
    runs = [SpecEngine(pair(target, draft), sp, SpecConfig(num_draft_tokens=3, draft_length="fixed", **extra))
            .generate(repeating) for extra in ({}, {"verification": "fuzzy", "fuzzy": {"threshold": 0.0}})]
    assert [r.token_ids for r in runs[0]] == [r.token_ids for r in runs[1]]


@pytest.mark.skipif(DEVICE == "cuda", reason="a GPU's padded steps may round apart from eager ones")
@pytest.mark.parametrize("sampling", ["rejection", "coupled"])
def test_sampled_token_trees_through_static_steps_are_the_eager_steps_rows(target, repeating, sampling):
    """Sampled AASD rows (temperature 0.9, a seed per job) through the static steps a GPU captures, trees' too, are the
    rows eager steps give: the same draws over the same logits (a CPU computes both alike, padding aside)."""
    spec = dict(method="prompt_lookup", prompt_lookup={"alignment_sampling": 2}, num_draft_tokens=3, sampling=sampling)
    sp = SamplingParams(max_new_tokens=NEW, temperature=0.9, seed=11)
    runs = []
    for graphs in (None, True):
        eng = SpecEngine(pair(target, None), sp, SpecConfig(draft_length="fixed", **spec), batch_size=4,
                         step_graphs=graphs)
        runs.append([r.token_ids for r in eng.generate(repeating)])
    assert any(key[3] == "tree" for key in eng._runners["target"].graphs.graphs)
    assert runs[0] == runs[1]


@pytest.mark.parametrize("divergence,thresholds", [("js", (0.3, 0.5, 0.7)), ("tv", (0.6, 0.8, 1.0)),
                                                   ("kl", (2.0, 4.0, 50.0))])
def test_fuzzy_acceptance_rises_with_the_threshold(target, repeating, divergence, thresholds):
    draft = noisy_copy(target, 0.3)
    lossless = rate(generate(target, draft, repeating))
    rates = [rate(generate(target, draft, repeating, verification="fuzzy",
                           fuzzy={"divergence": divergence, "threshold": t})) for t in (0.0, *thresholds)]
    assert rates == sorted(rates) and rates[0] == lossless < rates[-1] == 1.0, rates


def test_conditional_limits_and_beta(target, repeating, greedy):
    strict = generate(target, None, repeating, method="prompt_lookup", prompt_lookup={"alignment_sampling": 2},
                      verification="conditional", conditional={"alpha": 0.1, "beta": 1.0})
    assert [r.token_ids for r in strict] == greedy  # beta >= 1: only the argmax passes
    assert all(r.verification == "conditional" for r in strict)
    flat = tiny_llama(seed=0, init=0.02)  # flat distributions: a non-argmax token has a real probability
    runs = [generate(flat, None, repeating, method="prompt_lookup", prompt_lookup={"alignment_sampling": 2},
                     verification="conditional", conditional={"alpha": 0.0, "beta": beta}) for beta in (0.0, 0.01, 1.0)]
    # a tree's acceptance: levels accepted per round (accepted / nodes shrinks with the tree's width)
    per_round = [sum(r.accepted_tokens for r in out) / sum(r.rounds for r in out) for out in runs]
    assert per_round[0] > per_round[2] and per_round[0] >= per_round[1] >= per_round[2], per_round


def test_config_names_the_moved_and_inconsistent_keys():
    with pytest.raises(ValidationError, match=r"speculation.prompt_lookup_max_ngram is now speculation.prompt_lookup.max_ngram"):
        SpecConfig(method="prompt_lookup", prompt_lookup_max_ngram=3)
    with pytest.raises(ValidationError, match="verification fuzzy needs speculation.method draft_model"):
        SpecConfig(method="prompt_lookup", verification="fuzzy")
    with pytest.raises(ValidationError, match="verification conditional needs speculation.method prompt_lookup"):
        SpecConfig(method="draft_model", verification="conditional")
    with pytest.raises(ValidationError, match="speculation.fuzzy is set but speculation.verification is lossless"):
        SpecConfig(fuzzy={"threshold": 0.2})
    with pytest.raises(ValidationError, match="alignment_sampling"):
        SpecConfig(method="prompt_lookup", prompt_lookup={"alignment_sampling": 4})
    assert SpecConfig().verification == "lossless"  # relaxed verification is opt-in


def slots_of(rows: list[list[int]]) -> Slots:
    """A batch's slots holding these rows, admitted (their whole tokens as prompts)."""
    slots = Slots(len(rows), max(map(len, rows)), "cpu")
    slots.admit(0, len(rows))
    for i, tokens in enumerate(rows):
        slots.history[i], slots.prompt_lens[i] = tokens, len(tokens)
    return slots


def test_pool_merges_every_occurrence_into_one_tree():
    """The paper's pool: the continuations of every occurrence of the matched n-gram merge into one tree,
    shared prefixes once, the latest occurrence's chain first; s bounds the siblings per node, 0 the chain."""
    from specdec.config import PromptLookupConfig
    from specdec.spec.proposers.prompt_lookup import PromptLookupProposer

    tokens = [1, 2, 3, 9, 1, 2, 4, 9, 1, 2, 3, 5, 1, 2]  # "1 2" is followed by 3 9 1 / 4 9 1 / 3 5 1
    prop = PromptLookupProposer(slots_of([tokens]), PromptLookupConfig(alignment_sampling=2))
    prop.admit(0, 1)

    def tree(k, s):
        toks, parents, depths, _ = prop._row(0, k, s)
        return list(zip(toks, parents, depths))

    assert tree(3, 0) == [(3, 0, 1), (5, 1, 2), (1, 2, 3)]  # the latest occurrence alone
    assert tree(3, 2) == [(3, 0, 1), (5, 1, 2), (1, 2, 3),  # latest
                          (4, 0, 1), (9, 4, 2), (1, 5, 3),  # the middle one: a new branch at the root
                          (9, 1, 2), (1, 7, 3)]  # the first: shares "3" with the latest, branches below it
    assert tree(2, 1) == [(3, 0, 1), (5, 1, 2), (4, 0, 1), (9, 3, 2)]  # 1 sibling per node, 2 * 2 nodes at most


def test_prompt_lookup_reach_is_the_text_after_the_match():
    """How deep a row can draft now (goodput's `BatchView.reach`): a chain, the tokens after the latest
    occurrence of the matched n-gram; a tree, after the earliest; nothing where no n-gram occurred."""
    from specdec.config import PromptLookupConfig
    from specdec.spec.proposers.prompt_lookup import PromptLookupProposer

    prop = PromptLookupProposer(slots_of([[1, 2, 3, 9, 1, 2, 4, 9, 1, 2, 3, 5, 1, 2], [7, 8]]),
                                PromptLookupConfig(alignment_sampling=2))
    prop.admit(0, 2)
    assert prop.reach(2).tolist() == [[4, 12, 12], [0, 0, 0]]  # "1 2" is followed at 2, 6 and 10
    for k in (2, 4, 8):
        assert len(prop._row(0, k, 0)[0]) == min(k, 4) and max(prop._row(0, k, 2)[2]) == k


@pytest.mark.parametrize("bs", [1, 8])
def test_aasd_under_goodput_is_target_greedy(target, repeating, greedy, bs):
    """goodput choosing K and the tree width per round, over the merged pool and alignment siblings: lossless."""
    out = generate(target, None, repeating, bs, method="prompt_lookup", draft_length="goodput",
                   prompt_lookup={"alignment_sampling": 2})
    assert [r.token_ids for r in out] == greedy


def test_alignment_top_ids_are_each_rows_own(target, prompts):
    """Alignment sampling's top ids from a ragged prefill (the output head over each row's own positions only):
    the target's own top ids after each prefix of each prompt, and 0 past a row's length."""
    from specdec.plan.policies.simple import FixedLength

    eng = SpecEngine(pair(target, None), SamplingParams(max_new_tokens=4),
                     SpecConfig(method="prompt_lookup", prompt_lookup={"alignment_sampling": 2}), batch_size=4)
    batch = eng.new_batch(4, 64, FixedLength(eng.spec))
    rows = prompts[:4]  # 5, 17, 1 and 9 tokens
    t = max(map(len, rows))
    tokens = torch.tensor([p + [0] * (t - len(p)) for p in rows])
    ids = batch.target.prefill(tokens, 0, 4, 3, torch.tensor([len(p) for p in rows]))
    for i, p in enumerate(rows):
        with torch.inference_mode():
            want = target(input_ids=torch.tensor([p])).logits[0, :, : eng.vocab_size].topk(3, dim=-1).indices
        assert torch.equal(ids[i, : len(p)], want)
        assert not ids[i, len(p):].any()


def test_a_method_is_decided_in_its_table_entry_alone():
    """specdec/choices.py is the one place a method is compared by name: no other module of the engine, the workers,
    the jobs or the Python doors reads `.method ==`, `.method !=` or `.method in` (each asks the method's entry), and
    every entry answers what the others ask of it."""
    import re
    from pathlib import Path

    from specdec.choices import METHODS
    root = Path(__file__).resolve().parents[1]
    compared = [f"{path.relative_to(root)}:{i}" for folder in ("specdec", "workers", "jobs", "specbatch")
                for path in sorted((root / folder).rglob("*.py")) if path.name != "choices.py"
                for i, line in enumerate(path.read_text().splitlines(), 1)
                if re.search(r"\.method\s*(==|!=|\bin\b|\bnot in\b)", line)]
    assert compared == []
    spec = SpecConfig(method="prompt_lookup", max_draft_tokens=4, prompt_lookup={"alignment_sampling": 2})
    assert [(m.drafts, m.draft_model, m.max_nodes(spec.model_copy(update={"method": name}))) for name, m in
            METHODS.items()] == [(False, False, 0), (True, True, 4), (True, False, 12)]
    assert METHODS["prompt_lookup"].prompt_top_ids(spec) == 3 and METHODS["draft_model"].prompt_top_ids(spec) == 0
