"""Sampled speculative output has the target's distribution (measured), and seeding is per row."""

import itertools

import numpy as np
import pytest
import torch

from engine_models import pair, tiny_llama
from specdec.spec import sampling
from specdec.config import SamplingParams, SpecConfig
from specdec.engine import SpecEngine
from specdec.sched.slots import RowSettings, Slots

V, NEW, N = 8, 3, 4000
PROMPT = [1, 5, 2, 7]


def exact_distribution(model, sp):
    """P(x1 x2 x3 | PROMPT) for all V**3 continuations, from the model's processed conditionals."""
    pairs = list(itertools.product(range(V), repeat=2))
    ids = torch.tensor([PROMPT + [a, b] for a, b in pairs], device=model.device)
    with torch.no_grad():
        probs = sampling.probs(model(ids).logits, sampling.Rows.of(sp, model.device)).double().cpu()  # [V*V, L+2, V]
    L = len(PROMPT)
    dist = np.zeros((V, V, V))
    for row, (a, b) in enumerate(pairs):
        dist[a, b, :] = (probs[row, L - 1, a] * probs[row, L, b] * probs[row, L + 1, :]).numpy()
    dist = dist.reshape(-1)
    return dist / dist.sum()


def empirical(results):
    counts = np.zeros(V**NEW)
    for r in results:
        a, b, c = r.token_ids
        counts[(a * V + b) * V + c] += 1
    return counts / counts.sum()


def tv(p, q):
    return 0.5 * np.abs(p - q).sum()


def noise_bound(dist, n, trials=300, seed=0):
    """The 99.7th percentile of TV(sample of n, dist) under exact sampling: what pure noise looks like."""
    rng = np.random.default_rng(seed)
    return np.quantile([tv(rng.multinomial(n, dist) / n, dist) for _ in range(trials)], 0.997)


@pytest.fixture(scope="module")
def models():
    return tiny_llama(vocab=V, seed=0, init=0.15), tiny_llama(vocab=V, layers=1, seed=11, init=0.15)


@pytest.mark.parametrize(
    "method,sp",
    [
        ("draft_model", SamplingParams(max_new_tokens=NEW, temperature=1.0, seed=1)),
        ("draft_model", SamplingParams(max_new_tokens=NEW, temperature=0.7, top_k=5, top_p=0.9, seed=2)),
        ("prompt_lookup", SamplingParams(max_new_tokens=NEW, temperature=1.0, seed=3)),
        ("lookup_tree", SamplingParams(max_new_tokens=NEW, temperature=1.0, seed=5)),
        ("draft_vocab", SamplingParams(max_new_tokens=NEW, temperature=1.0, seed=4)),
    ],
    ids=["draft-t1", "draft-topk-topp", "lookup-t1", "lookup-tree-t1", "draft-vocab-cut"],
)
def test_sampled_output_has_target_distribution(models, method, sp):
    target, draft = models
    p_target, p_draft = exact_distribution(target, sp), exact_distribution(draft, sp)
    cut = method == "draft_vocab"  # the draft scores only ids 0..4: q is zero on 5..7
    tree = method == "lookup_tree"  # AASD's token trees: 2 siblings where the prompt's token is not the top one
    method = {"draft_vocab": "draft_model", "lookup_tree": "prompt_lookup"}.get(method, method)
    eng = SpecEngine(pair(target, draft if method == "draft_model" else None), sp,
                     SpecConfig(method=method, num_draft_tokens=2, draft_length="fixed", draft_vocab=5 if cut else 0,
                                prompt_lookup={"min_ngram": 1, "max_ngram": 2, "alignment_sampling": 2 if tree else 0}),
                     batch_size=512)
    results = eng.generate([PROMPT] * N, keys=[f"row{i}" for i in range(N)])
    assert all(r.generated_tokens == NEW for r in results)
    emp = empirical(results)
    if cut:  # every output token >= 5 was a recovered or bonus token from the target, never drafted
        assert any(t >= 5 for r in results for t in r.token_ids)
    bound = noise_bound(p_target, N)
    assert tv(emp, p_target) <= bound
    assert tv(emp, p_draft) > 3 * bound  # the draft's distribution is far away: we are not sampling it
    # speculation really happened: some drafts accepted, some rejected (the residual path ran)
    drafted = sum(r.drafted_tokens for r in results)
    accepted = sum(r.accepted_tokens for r in results)
    assert 0 < accepted < drafted


def test_convergence_is_to_target_not_draft(models):
    target, draft = models
    sp = SamplingParams(max_new_tokens=NEW, temperature=1.0, seed=5)
    p_target, p_draft = exact_distribution(target, sp), exact_distribution(draft, sp)
    eng = SpecEngine(pair(target, draft), sp, SpecConfig(num_draft_tokens=3, draft_length="fixed"), batch_size=512)
    small = empirical(eng.generate([PROMPT] * 250, keys=[f"a{i}" for i in range(250)]))
    large = empirical(eng.generate([PROMPT] * N, keys=[f"b{i}" for i in range(N)]))
    assert tv(large, p_target) < 0.7 * tv(small, p_target)  # error shrinks with samples ...
    assert tv(large, p_target) < tv(large, p_draft) / 3  # ... towards the target, far from the draft


def test_seeded_rows_repeat_and_do_not_depend_on_batch(models):
    target, draft = models
    sp = SamplingParams(max_new_tokens=12, temperature=1.0, seed=9)
    spec = SpecConfig(num_draft_tokens=3, draft_length="fixed")
    prompts = [PROMPT, [2, 2], [7, 1, 0, 3, 3, 6], [4]] * 4
    keys = [f"k{i}" for i in range(len(prompts))]
    a = SpecEngine(pair(target, draft), sp, spec, batch_size=16).generate(prompts, keys)
    b = SpecEngine(pair(target, draft), sp, spec, batch_size=16).generate(prompts, keys)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    alone = [SpecEngine(pair(target, draft), sp, spec, batch_size=1).generate([p], [k])[0]
             for p, k in zip(prompts[:4], keys[:4])]
    assert [r.token_ids for r in alone] == [r.token_ids for r in a[:4]]
    other_seed = SpecEngine(pair(target, draft), SamplingParams(max_new_tokens=12, temperature=1.0, seed=10),
                            spec, batch_size=16).generate(prompts, keys)
    assert [r.token_ids for r in other_seed] != [r.token_ids for r in a]
    # the same prompt under different row ids gives different samples
    assert len({tuple(r.token_ids) for r in a[::4]}) > 1


@pytest.mark.parametrize("method", ["draft_model", "prompt_lookup"])
def test_rows_with_their_own_settings_share_a_batch(models, method):
    """A batch of rows with different settings: greedy rows give greedy output, rows at temperature 0.7 with
    top-k follow that distribution, rows at temperature 1 theirs; one batch, each row by its own rule."""
    target, draft = models
    hot = SamplingParams(max_new_tokens=NEW, temperature=1.0, seed=1)
    warm = SamplingParams(max_new_tokens=NEW, temperature=0.7, top_k=5, seed=2)
    cold = SamplingParams(max_new_tokens=NEW)
    params = [hot, warm, cold] * N
    eng = SpecEngine(pair(target, draft if method == "draft_model" else None), cold,
                     SpecConfig(method=method, num_draft_tokens=2, draft_length="fixed"), batch_size=600)
    results = eng.generate([PROMPT] * len(params), keys=[f"r{i}" for i in range(len(params))], params=params)
    greedy = SpecEngine(pair(target), cold, SpecConfig(method="none")).generate([PROMPT])[0].token_ids
    assert all(r.token_ids == greedy for r in results[2::3])
    for rows, sp in ((results[0::3], hot), (results[1::3], warm)):
        p = exact_distribution(target, sp)
        assert tv(empirical(rows), p) <= noise_bound(p, N)


def plain_processed(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """One setting's processing, written plainly: temperature, then top-k, then top-p (greedy: as they are)."""
    x = logits.float()
    if sp.greedy:
        return x
    x = x / sp.temperature
    if 0 < sp.top_k < x.shape[-1]:
        x = x.masked_fill(x < torch.topk(x, sp.top_k, dim=-1).values[..., -1:], float("-inf"))
    if sp.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        p = torch.softmax(sorted_x, dim=-1)
        sorted_x = sorted_x.masked_fill(p.cumsum(-1) - p >= sp.top_p, float("-inf"))
        x = torch.empty_like(x).scatter_(-1, order, sorted_x)
    return x


def test_row_processing_equals_the_plain_one_setting_processing():
    """A batch whose rows have settings of their own processes each row as the plain one-setting processing
    does; `Rows.of` (one setting for any number of rows) broadcasts it over any shape."""
    logits = torch.randn(5, 3, 40) * 3
    sps = [SamplingParams(temperature=0.8, top_k=7), SamplingParams(temperature=1.3, top_p=0.6),
           SamplingParams(temperature=0.5, top_k=4, top_p=0.9), SamplingParams(), SamplingParams(temperature=0.7)]
    settings = RowSettings(Slots(5, 1, "cpu"))
    for i, sp in enumerate(sps):
        settings.set(i, sp)
    mixed = sampling.probs(logits, settings.view(5))
    for i, sp in enumerate(sps):
        want = torch.softmax(plain_processed(logits[i], sp), dim=-1)
        assert torch.allclose(mixed[i], want, atol=1e-6)
        assert torch.allclose(sampling.probs(logits[i], sampling.Rows.of(sp)), want, atol=1e-6)
        assert torch.allclose(sampling.probs(logits[i, 0], sampling.Rows.of(sp)), want[0], atol=1e-6)


@pytest.mark.parametrize("vocab", [1000, 2048])
def test_one_scan_gives_the_argmax_and_the_non_finite_check(vocab):
    """`scan` replaces argmax + isfinite(all logits): the same argmax (first of ties, within a block of 128 logits
    and across blocks: a vocabulary of 2048 takes the blocked scan on a CPU), and a position is flagged where a NaN
    or +inf sits anywhere or every logit is -inf; a -inf among finite ones (a masked token) is not."""
    from specdec.spec.verify import scan
    logits = torch.randn(3, 5, vocab, generator=torch.Generator().manual_seed(0))[:, 1:]  # a view, as a round's
    logits[0, 0, 10] = logits[0, 0, 20] = logits[0, 0].max() + 1  # a tie: the first wins, as argmax's
    logits[1, 0, 300] = logits[1, 0, 900] = logits[1, 0].max() + 1  # a tie across blocks
    logits[0, 1, 5] = float("nan")
    logits[1, 2, 999] = float("inf")
    logits[2, 3] = float("-inf")
    logits[2, 0, :500] = float("-inf")
    best, finite = scan(logits)
    expect = torch.ones(3, 4, dtype=torch.bool)
    expect[0, 1] = expect[1, 2] = expect[2, 3] = False
    assert torch.equal(finite, expect)
    assert torch.equal(best[expect], logits.argmax(-1)[expect]) and best[0, 0] == 10 and best[1, 0] == 300
    old = torch.isfinite(logits).all(-1)  # the check it replaces differs only at the partly masked position
    assert torch.equal(old ^ finite, torch.zeros_like(old).index_put_((torch.tensor(2), torch.tensor(0)),
                                                                      torch.tensor(True)))
