"""Rounds that overlap (specdec/sched/rounds.py): a round is queued on the device before the host reads the one
before it back, counted with the read-back's own hook (`Staging.trace`: when a round's device work is queued,
and when the host blocks on its results), not with a timer; and every token, statistic and finish reason is what
rounds that wait for each other give."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_models import MAX_NEW, engine, pair

from specdec.config import SamplingParams, SpecConfig
from specdec.engine import SpecEngine
from specdec.spec.proposers.base import Proposer


def traced(target, draft=None, overlap=True, bs=4, stop=(), max_new=MAX_NEW, kv_cache="dense", **spec):
    """An engine whose read-backs report to a list of (event, round)."""
    events = []
    eng = SpecEngine(pair(target, draft, stop), SamplingParams(max_new_tokens=max_new), SpecConfig(**spec),
                     batch_size=bs, overlap=overlap, kv_cache=kv_cache)
    eng.context.staging.trace = lambda event, r: events.append((event, r))
    return eng, events


def ahead(events) -> tuple[int, int]:
    """(rounds whose successor was queued before the host waited for them, rounds)."""
    at = {e: i for i, e in enumerate(events)}
    rounds = sorted(r for e, r in events if e == "wait")
    return sum(at.get(("launch", r + 1), len(events)) < at[("wait", r)] for r in rounds), len(rounds)


def pay_ahead(monkeypatch, pays: bool = True) -> None:
    """Draft ahead at a cost (`Proposer.ahead_pays`) as on a GPU (or, pays=False, never, as on a CPU)."""
    monkeypatch.setattr(Proposer, "ahead_pays", property(lambda self: pays))


def results(rs):
    return [(r.token_ids, r.finish_reason, r.rounds, r.draft_lengths, r.accept_lengths) for r in rs]


def test_plain_rounds_queue_the_next_before_reading_back(target, prompts, reference):
    """Four rows of plain decoding that all run to max_new_tokens: every round but the last is followed on the
    device before the host reads it back (in the last the host knows the rows reach max_new_tokens: no round
    follows it for them to ride); the tokens are transformers' greedy ones. Without overlap, no round is."""
    eng, events = traced(target, method="none")
    out = eng.generate(prompts[:4])
    assert [r.token_ids for r in out] == reference[:4]
    assert all(r.rounds == MAX_NEW and r.finish_reason == "length" for r in out)
    followed, rounds = ahead(events)
    assert rounds == MAX_NEW and followed == MAX_NEW - 1
    assert all(e == "launch" for e, _ in events[:2])  # round 1's read-back waited for round 2 to be queued

    eng, events = traced(target, method="none", overlap=False)
    assert results(eng.generate(prompts[:4])) == results(out)
    assert ahead(events) == (0, MAX_NEW)


@pytest.mark.parametrize("k", [1, 3])
def test_drafting_rounds_queue_the_next_before_reading_back(target, drafts, prompts, reference, k):
    """Four rows drafting k tokens a round with a draft model, 64 new tokens each: the next round (its draft's
    catch-up and its verification built on the device from this round's outputs, each row's draft within the room
    the device counts before max_new_tokens) is queued before the host reads this one back, in all but two rounds
    (the four rows leave with a round in flight); tokens, rounds and acceptance are those of rounds that
    wait for each other (their rounds too, but perhaps one: where the last rows reach max_new_tokens by accepting
    more than the host could foresee, the round queued after rides empty), and the first 24 tokens transformers'
    greedy ones."""
    runs = {}
    for overlap in (True, False):
        eng, events = traced(target, drafts["noisy"], overlap, method="draft_model", draft_length="fixed",
                             num_draft_tokens=k, max_new=64)
        out = eng.generate(prompts[:4])
        assert [r.token_ids[:MAX_NEW] for r in out] == reference[:4]
        runs[overlap] = results(out), *ahead(events)
    assert runs[True][0] == runs[False][0]
    followed, rounds = runs[True][1:]
    assert runs[False][1] == 0 and runs[False][2] <= rounds <= runs[False][2] + 1
    assert followed >= rounds - 2, (followed, rounds)  # rows leave with a round in flight: leaving costs none


@pytest.mark.parametrize("method, spec, kv_cache", [
    ("none", {}, "dense"),
    ("none", {}, "paged"),
    ("draft_model", {"draft_length": "fixed", "num_draft_tokens": 3}, "dense"),
    ("draft_model", {"draft_length": "fixed", "num_draft_tokens": 3}, "paged"),
    ("draft_model", {"draft_length": "fixed", "num_draft_tokens": 0}, "paged"),
    ("prompt_lookup", {"draft_length": "fixed", "num_draft_tokens": 2}, "dense"),
    ("prompt_lookup", {"draft_length": "fixed", "num_draft_tokens": 3}, "paged"),
])
def test_overlap_changes_no_token(target, drafts, prompts, method, spec, kv_cache, monkeypatch):
    """Eight prompts through a batch of 3 (dense rows, or a paged pool whose rows reserve only their own blocks: a
    rider writes within them) with stop tokens that end rows at rounds the host cannot foresee (they
    ride the round queued after theirs, and leave, and the next rows join, with that one still in flight), greedy
    and sampled: every row's tokens, finish reason, rounds and acceptance are those of rounds that wait for each
    other. Rounds are queued ahead, drafting or not; prompt lookup's on a GPU (forced here: `ahead_pays`), its
    chains found in the device's tokens."""
    pay_ahead(monkeypatch)
    stop = (23, 58)
    for sp in (SamplingParams(max_new_tokens=MAX_NEW), SamplingParams(max_new_tokens=MAX_NEW, temperature=0.8,
                                                                      seed=5)):
        runs = {}
        for overlap in (True, False):
            eng, events = traced(target, drafts["noisy"], overlap, bs=3, stop=stop, kv_cache=kv_cache, method=method,
                                 **spec)
            eng.sampling = sp
            out = eng.generate(prompts)
            runs[overlap] = (results(out), *ahead(events))
        assert runs[True][0] == runs[False][0]
        assert any(r[1] == "stop" for r in runs[True][0]) and any(r[1] == "length" for r in runs[True][0])
        assert runs[False][1] == 0
        assert runs[True][2] >= runs[False][2]  # rounds that stopped rows rode
        # rows leave and join with a round in flight: all but the last rounds are followed (and, drafting, those
        # where a joining 1-token prompt has no draft cache to catch up from the device)
        followed, rounds = runs[True][1:]
        assert followed >= rounds - (3 if method == "draft_model" and spec["num_draft_tokens"] else 2), \
            (followed, rounds)
        if method == "prompt_lookup":
            assert sum(r.accepted_tokens for r in out) > 0


def lookup_rows(target, n: int, max_len: int, **lookup):
    """A prompt lookup proposer over a batch of n rows of up to max_len tokens, and its slots."""
    from specdec.plan.policies import FixedLength

    spec = SpecConfig(method="prompt_lookup", prompt_lookup=lookup)
    eng = SpecEngine(pair(target), SamplingParams(max_new_tokens=8), spec, batch_size=n)
    b = eng.new_batch(n, max_len, FixedLength(eng.spec), prefixes=False)
    return b.proposer, b.slots


def random_rows(s, rng, n: int, max_len: int, vocab: int, room: int) -> np.ndarray:
    """Rows [0, n) of random tokens out of `vocab`, whose host lengths lag the device's by up to a random round in
    flight's bound, with random prompt lengths and up to `room` tokens of room before max_new_tokens; returns each
    row's room (the device's)."""
    s.in_flight = int(rng.integers(0, 4))
    lens = rng.integers(1, max_len - s.in_flight, n)
    lag = np.minimum(rng.integers(0, s.in_flight + 1, n), lens - 1)
    s.lens[:n], s.prompt_lens[:n] = lens - lag, rng.integers(1, lens + 1)
    for i in range(n):
        s.history[i] = rng.integers(0, vocab, lens[i]).tolist()
        s.seq[i, : lens[i]] = torch.tensor(s.history[i])
    s.lens_dev[:n] = torch.tensor(lens)
    s.ends_dev[:n] = torch.tensor(lens + rng.integers(0, room + 1, n))
    return np.maximum(s.ends_dev[:n].cpu().numpy() - lens - 1, 0)


@pytest.mark.parametrize("min_ngram, vocab", [(1, 3), (2, 12)])
def test_chains_found_on_the_device_are_the_hosts(target, min_ngram, vocab):
    """Prompt lookup's chains found in the device's tokens (`device_chains`, for a round queued ahead) are those
    its host pools draft (`_row`, no siblings): random rows of few distinct tokens (n-grams recur everywhere), short
    and long, whose host lengths lag the device's by up to the round in flight's bound, random limits and room
    before max_new_tokens; the same tokens, lengths and prompt flags."""
    n, max_len = 6, 96
    p, s = lookup_rows(target, n, max_len, max_ngram=4, min_ngram=min_ngram)
    rng = np.random.default_rng(min_ngram)
    for _ in range(40):
        room = random_rows(s, rng, n, max_len, vocab, 4)
        p.admit(0, n)
        limits = rng.integers(0, 6, n)
        got = p.device_chains(n, limits)
        for i in range(n):
            toks, _, _, relaxed = p._row(i, int(min(limits[i], room[i])), 0)
            m = int(got.lengths[i])
            assert (m, got.tokens[i, :m].tolist(), got.relaxed[i, :m].tolist()) == (len(toks), toks, relaxed), i
    s.in_flight = 0


@pytest.mark.parametrize("vocab", [2, 5])
def test_trees_built_on_the_device_are_the_hosts(target, vocab):
    """AASD's token trees built from the device's tokens (`device_trees`, for a round queued ahead) are those its
    host pools draft (`_row`): random rows of few distinct tokens (every start's continuation meets others'),
    host lengths lagging the device's, random limits, room, top ids (some rows without), 1 to 3 siblings: the same
    nodes in the same order, with the same parents, depths and relaxed flags."""
    n, max_len, most = 6, 80, 3
    p, s = lookup_rows(target, n, max_len, max_ngram=3, alignment_sampling=most)
    rng = np.random.default_rng(vocab)
    branched = aligned = 0
    for trial in range(30):
        room = random_rows(s, rng, n, max_len, vocab, 6)
        top = rng.integers(0, vocab + 1, (n, int(rng.integers(1, max_len)), most + 1))
        p.admit(0, n, None if trial % 4 == 0 else top)
        limits = rng.integers(0, 7, n)
        for sib in range(1, most + 1):
            got = p.device_trees(n, limits, sib)
            for i in range(n):
                want = p._row(i, int(min(limits[i], room[i])), sib)
                m = int(got.lengths[i])
                nodes = [got.tokens[i, :m].tolist(), got.tree.parent[i, :m].tolist(), got.tree.depth[i, :m].tolist(),
                         got.relaxed[i, :m].tolist()]
                assert nodes == [list(x) for x in want], (trial, sib, i)
                branched += max(want[2], default=0) < m
                own, p.top_ids[i] = p.top_ids[i], None
                aligned += len(p._row(i, int(min(limits[i], room[i])), sib)[0]) < m  # siblings from the top ids
                p.top_ids[i] = own
    assert branched > 100 and aligned > 30, (branched, aligned)  # trees, not chains; alignment siblings
    s.in_flight = 0


@pytest.mark.parametrize("kv_cache, rule, pays", [
    ("dense", {}, True),
    ("paged", {"verification": "conditional", "conditional": {"alpha": 0.1, "beta": 0.5}}, True),
    ("dense", {"sampling": "coupled"}, True),
    ("dense", {"verification": "conditional", "conditional": {"alpha": 0.1, "beta": 0.5}}, False),
])
def test_token_trees_go_ahead_and_keep_their_tokens(target, prompts, kv_cache, rule, pays, monkeypatch):
    """AASD (2 alignment siblings, depth 3; lossless, coupled, and conditional verification) over prompts that repeat
    a phrase, through a batch of 3 with stop tokens, greedy and sampled: every row's tokens, finish reason, rounds and
    acceptance are those of rounds that wait for each other. On a GPU's terms (`ahead_pays`) its token trees are
    built on the device while the round before is in flight (`device_trees`) and rounds are followed before they are
    read back; on a CPU's, rows leave and join with a tree in flight, and no drafting round goes ahead."""
    pay_ahead(monkeypatch, pays)
    phrase = [7, 61, 22, 40, 13, 88, 5, 31, 70]
    texts = [p[:6] + phrase * 3 + p[6:] for p in prompts]
    for sp in (SamplingParams(max_new_tokens=MAX_NEW), SamplingParams(max_new_tokens=MAX_NEW, temperature=0.8,
                                                                      seed=5)):
        runs = {}
        for overlap in (True, False):
            eng, events = traced(target, None, overlap, bs=3, stop=(23, 58), kv_cache=kv_cache,
                                 method="prompt_lookup", draft_length="fixed", num_draft_tokens=3,
                                 prompt_lookup={"alignment_sampling": 2}, **rule)
            eng.sampling = sp
            out = eng.generate(texts)
            runs[overlap] = results(out), *ahead(events)
        assert runs[True][0] == runs[False][0]
        assert runs[False][1] == 0
        followed, rounds = runs[True][1:]
        assert followed >= rounds - 2 if pays else followed == 0, (followed, rounds)
        assert max(d for r in out for d in r.draft_lengths) > 3 and sum(r.accepted_tokens for r in out) > 0


def test_rows_finished_by_arrays_equal_rows_finished_one_by_one(target):
    """`Rounds.finish_plain` (rows without stop strings, own stop ids, logprobs or formats, finished over the
    read-back at once) gives every row the tokens, finish reason and statistics `Rounds.finish` gives it row by row:
    random read-backs, stop tokens anywhere among x_1..x_a, y (or past them), rows near max_new_tokens."""
    import copy

    from specdec.config import SampleResult
    from specdec.plan.policies import FixedLength
    from specdec.sched.batch import Row
    from specdec.sched.rounds import Readback, Rounds

    n, w, max_new = 16, 5, 10
    eng = SpecEngine(pair(target, None, (5, 9)), SamplingParams(max_new_tokens=max_new), SpecConfig(method="none"),
                     batch_size=n)
    policy = FixedLength(eng.spec)
    batch = eng.new_batch(n, 64, policy, prefixes=False)
    loop = Rounds(eng.context, batch, policy, [], [])
    rng = np.random.default_rng(0)
    for _ in range(50):
        rows = []
        for i in range(n):
            done = int(rng.integers(0, max_new))
            res = SampleResult(key=i, prompt_tokens=3, token_ids=rng.integers(10, 20, done).tolist())
            rows.append(Row(i, res, [1, 2, 3] + res.token_ids, None, 0.0, eng.sampling))
        out = Readback(accepted=rng.integers(0, w, n), drafted=np.full(n, w - 1), target_non_finite=np.zeros(n, bool),
                       tokens=rng.choice([5, 9, 11, 12, 13, 14], size=(n, w), p=[0.1, 0.05, 0.25, 0.2, 0.2, 0.2]))
        got, want = [], []
        for finish, kept in ((lambda: loop.finish_plain(list(range(n)), out, 3), got),
                             (lambda: sum(loop.finish(i, out, 3) for i in range(n)), want)):
            batch.rows[:n] = copy.deepcopy(rows)
            assert loop.plain_rows(list(range(n)), out) == (list(range(n)), [])
            kept.append(finish())
            kept += [(r.tokens, r.result.token_ids, r.result.finish_reason, r.result.rounds, r.result.draft_forwards,
                      r.result.draft_lengths, r.result.accept_lengths) for r in batch.rows[:n]]
        assert got == want


@pytest.mark.parametrize("method, kv_cache", [("draft_model", "dense"), ("draft_model", "paged"),
                                               ("prompt_lookup", "dense")])
def test_the_default_policy_drafting_ahead_keeps_greedy_tokens(target, drafts, prompts, reference, method, kv_cache,
                                                               monkeypatch):
    """The default policy (goodput; under costs where drafting pays) plans round r + 1 before round r is read back,
    so its draft lengths may differ from rounds that wait; greedy tokens may not: transformers' own, rows joining
    through a batch of 3. Rounds that draft are queued ahead: a draft model's, and prompt lookup's as on a GPU
    (`ahead_pays` forced; its reach, which goodput plans by, a round old)."""
    pay_ahead(monkeypatch)
    eng = engine(target, drafts["noisy"], method=method, bs=3, kv_cache=kv_cache)
    events = []
    eng.context.staging.trace = lambda event, r: events.append((event, r))
    out = eng.generate([p * 3 for p in prompts] if method == "prompt_lookup" else prompts)
    if method == "draft_model":
        assert [r.token_ids for r in out] == reference
    else:  # the prompts repeat themselves: transformers' greedy tokens after them
        for p, r in zip(prompts, out):
            ids = target.generate(torch.tensor([p * 3], device=target.device), max_new_tokens=MAX_NEW,
                                  min_new_tokens=MAX_NEW, do_sample=False)
            assert r.token_ids == ids[0, 3 * len(p):].tolist()
    assert sum(r.drafted_tokens for r in out) > 0 and ahead(events)[0] > 0


@pytest.mark.parametrize("seed", range(12))
def test_rows_moving_with_a_round_in_flight_change_nothing(target, drafts, seed):
    """Random jobs of rows that leave and join while a round is in flight, against the same rounds waiting for each
    other: prompts of 1-40 tokens, some sharing a 20-token prefix (the prefix store), some with 2 samples (a copy
    of the first's caches), each row its own max_new_tokens (4-24), greedy or sampled, stop tokens; batches of 2-5,
    dense or paged, small prefill chunks, plain or drafting (fixed k=1..3). Every row's tokens, finish reason,
    rounds and acceptance are the same, and most rounds were queued ahead."""
    rng = np.random.default_rng(seed)
    head = rng.integers(0, 96, 20).tolist()
    prompts = [(head if rng.random() < 0.3 else []) + rng.integers(0, 96, int(rng.integers(1, 21))).tolist()
               for _ in range(int(rng.integers(6, 12)))]
    params = [SamplingParams(max_new_tokens=int(rng.integers(4, 25)), n=int(rng.choice([1, 1, 2])),
                             temperature=float(rng.choice([0.0, 0.8])), seed=seed) for _ in prompts]
    k = int(rng.integers(0, 4))
    spec = {"method": "draft_model", "draft_length": "fixed", "num_draft_tokens": k} if k else {"method": "none"}
    kv, bs, chunk = str(rng.choice(["dense", "paged"])), int(rng.integers(2, 6)), int(rng.choice([8, 32, 2048]))
    runs = {}
    for overlap in (True, False):
        events = []
        eng = SpecEngine(pair(target, drafts["noisy"], (23, 58)), SamplingParams(max_new_tokens=24), SpecConfig(**spec),
                         batch_size=bs, overlap=overlap, kv_cache=kv, prefill_chunk=chunk)
        eng.context.staging.trace = lambda event, r, events=events: events.append((event, r))
        runs[overlap] = (results(eng.generate(prompts, params=params)), *ahead(events))
    assert runs[True][0] == runs[False][0], (seed, kv, bs, chunk, spec)
    followed, rounds = runs[True][1:]
    assert followed >= rounds // 2, (followed, rounds, seed)


@pytest.mark.parametrize("method, spec", [("none", {}),
                                          ("draft_model", {"draft_length": "fixed", "num_draft_tokens": 2})])
def test_coupled_rounds_go_ahead_and_keep_their_tokens(target, drafts, prompts, method, spec):
    """Coupled sampling's noise is keyed by each row's output positions, taken from the device's lengths: rounds
    are queued ahead (rows leaving and joining with a round in flight), and every sampled row's tokens, rounds and
    acceptance are those of rounds that wait, 8 prompts through a batch of 3 with stop tokens."""
    runs = {}
    for overlap in (True, False):
        eng, events = traced(target, drafts["noisy"], overlap, bs=3, stop=(23, 58), method=method,
                             sampling="coupled", **spec)
        eng.sampling = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.8, seed=7)
        runs[overlap] = (results(eng.generate(prompts)), *ahead(events))
    assert runs[True][0] == runs[False][0]
    followed, rounds = runs[True][1:]
    assert runs[False][1] == 0 and followed >= rounds - 3, (followed, rounds)


@pytest.mark.parametrize("policy", ["confidence", "fed", "proposing"])
def test_rounds_of_policies_that_stop_on_the_drafts_outputs_go_ahead(target, drafts, prompts, policy, tmp_path,
                                                                     monkeypatch):
    """Where a read waits for every round in flight (a GPU), a policy that stops rows on the draft's outputs
    (confidence; SpecDec++'s head, reading the state that drew a token or the one after it was fed) drafts a round
    queued ahead to its limit without reading whether rows stopped: each row proposes what it would have, so every
    token, finish reason and statistic is what rounds that wait give, 8 prompts through a batch of 3 with stop
    tokens, greedy and sampled; a round queued ahead reads nothing but its results (counted as `HostReads`). Forced
    on this CPU, where reading is free and such rounds stop early, and wait."""
    from test_fastpath import HostReads

    from specdec.plan.head import AcceptanceHead, HeadConfig

    if policy == "confidence":
        spec = {"draft_length": "confidence", "confidence_threshold": 0.5}
    else:  # a random head: rows stop at different steps
        torch.manual_seed(11)
        head = AcceptanceHead(HeadConfig(hidden_size=64, num_layers=1, reads=policy))
        head.save(str(tmp_path))
        spec = {"draft_length": "acceptance_head", "acceptance_head": {"path": str(tmp_path), "threshold": 0.6}}
    for sp in (SamplingParams(max_new_tokens=MAX_NEW), SamplingParams(max_new_tokens=MAX_NEW, temperature=0.8,
                                                                      seed=5)):
        runs = {}
        for ahead_too in (True, False):
            pay_ahead(monkeypatch, ahead_too)
            eng, events = traced(target, drafts["noisy"], bs=3, stop=(23, 58), method="draft_model",
                                 max_draft_tokens=5, **spec)
            eng.sampling = sp
            with HostReads() as reads:
                out = results(eng.generate(prompts))
            runs[ahead_too] = (out, *ahead(events), reads.count - eng.context.staging.rounds)
        assert runs[True][0] == runs[False][0]
        lengths = {d for r in runs[True][0] for d in r[3]}
        assert len(lengths - {0}) > 1, lengths  # rows stopped at different steps
        followed, rounds, stops_read = runs[True][1:]
        assert runs[False][1] == 0 and followed >= rounds - 3, (followed, rounds)
        assert stops_read <= 4 * (rounds - followed) < runs[False][3], (stops_read, runs[False][3])  # 4: steps - 1
