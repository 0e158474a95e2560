"""SpecDec++ acceptance head: the loss, learning on synthetic data, train-head end to end, and the
acceptance_head policy staying lossless."""

from __future__ import annotations

import json
import os

import pytest
import torch
import yaml

from engine_models import pair as make_pair, noisy_copy, tiny_llama
from specdec.config import SamplingParams, SpecConfig
from specdec.engine import SpecEngine
from specdec.plan.head import AcceptanceHead, HeadConfig, auc, train_head, weighted_bce


def test_weighted_bce_matches_formula():
    logits = torch.tensor([[0.3, -0.2], [1.0, 2.0], [-1.0, 0.5]])
    y = torch.tensor([0.0, 1.0, 0.4])
    logp = torch.log_softmax(logits, -1)
    w = 6.0
    num = sum(w * (1 - y[i]) * -logp[i, 0] + y[i] * -logp[i, 1] for i in range(3))
    den = sum(w * (1 - y[i]) + y[i] for i in range(3))
    assert weighted_bce(logits, y, w).item() == pytest.approx((num / den).item(), rel=1e-6)


def test_auc_matches_pairwise_count():
    """AUC = P(an accepted token scores above a rejected one), ties half; soft labels weigh both ways."""
    g = torch.Generator().manual_seed(1)
    score = torch.randint(0, 6, (40,), generator=g).float()  # many ties
    y = torch.rand(40, generator=g).round()
    y[:5] = torch.rand(5, generator=g)  # a few soft labels
    num = den = 0.0
    for i in range(40):
        for j in range(40):
            w = float(y[i] * (1 - y[j]))
            num += w * (1.0 if score[i] > score[j] else 0.5 if score[i] == score[j] else 0.0)
            den += w
    assert auc(score, y) == pytest.approx(num / den, rel=1e-9)
    assert auc(y, y.round()) > auc(-y, y.round())  # a score that follows the labels ranks better


def test_head_learns_acceptance_from_hidden_state():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(6000, 16, generator=g)
    y = torch.sigmoid(3 * h[:, 0] - 1 * h[:, 1])  # acceptance depends on the state
    head, report = train_head(h, y, HeadConfig(hidden_size=16, num_layers=2), epochs=3, lr=1e-2)
    pred = head.p_accept(h[:500])
    # w_rej bends predictions towards rejection (optimum y / (y + w_rej (1 - y))): compare ranks
    ranks = torch.stack([pred.argsort().argsort(), y[:500].argsort().argsort()]).float()
    assert torch.corrcoef(ranks)[0, 1] > 0.95
    assert report["heldout_loss"] < weighted_bce(torch.zeros(600, 2), y[:600], 6.0).item()  # beats a constant
    observed = [c["observed"] for c in report["calibration"]]
    assert observed == sorted(observed)  # higher predicted bins really are accepted more
    best = auc(y, y)  # soft labels: the best any score can rank them (the labels themselves)
    assert auc(head.p_accept(h), y) > 0.97 * best and report["heldout_auc"] > 0.9 * best


def test_train_head_cli_and_policy_is_lossless(tmp_path, tiny_pair):
    from jobs.cli import main as cli

    rows = [{"id": i, "prompt": w} for i, w in enumerate(
        ["the water is hot", "how do you make a name", "write one word", "she can find it", "look at the man",
         "the day was long", "call him back", "what time is it"])]
    with open(tmp_path / "in.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    cfg = {"name": "h", "input": {"path": str(tmp_path / "in.jsonl"), "chat_template": True},
           "output": {"path": str(tmp_path / "out")},
           "models": {"target": {"path": tiny_pair["target"], "dtype": "float32"},
                      "draft": {"path": tiny_pair["draft"], "dtype": "float32"}},
           "generation": {"max_new_tokens": 24}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(cfg))
    out = str(tmp_path / "head")
    assert cli(["train-head", str(tmp_path / "job.yaml"), "--out", out, "--epochs", "2", "--no-progress"]) == 0
    meta = json.load(open(os.path.join(out, "head.json")))
    assert meta["report"]["train_examples"] > 100 and meta["report"]["calibration"]
    head = AcceptanceHead.load(out)
    assert head.cfg.hidden_size == 64 and head.cfg.reads == "proposing" and head.out.in_features == 66
    fed = str(tmp_path / "fed")
    assert cli(["train-head", str(tmp_path / "job.yaml"), "--out", fed, "--epochs", "1", "--no-progress",
                "--reads", "fed", "--max-prompts", "4"]) == 0
    assert AcceptanceHead.load(fed).cfg.reads == "fed" and AcceptanceHead.load(fed).out.in_features == 64

    # the policy with a head: lossless, and per-row lengths between the bounds
    target = tiny_llama(seed=0)
    draft = noisy_copy(target, 0.02)
    trained = str(tmp_path / "head2")
    flat = AcceptanceHead(HeadConfig(hidden_size=64, num_layers=1))
    torch.nn.init.zeros_(flat.out.weight)
    torch.nn.init.zeros_(flat.out.bias)
    flat.save(trained)  # P(accept) = 0.5 everywhere
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (5, 17, 1, 9)]
    sp = SamplingParams(max_new_tokens=20)
    ref = SpecEngine(make_pair(target), sp, SpecConfig(method="none")).generate(prompts)
    for threshold in (0.3, 0.9):
        spec = SpecConfig(draft_length="acceptance_head", acceptance_head={"path": trained, "threshold": threshold},
                          max_draft_tokens=8)
        res = SpecEngine(make_pair(target, draft), sp, spec, batch_size=4).generate(prompts)
        assert [r.token_ids for r in res] == [r.token_ids for r in ref]
        lengths = [d for r in res for d in r.draft_lengths]  # rounds near max_new may be cut shorter
        # 1 - 0.5^2 = 0.75 > 0.3; 1 - 0.5^3 <= 0.9 < 1 - 0.5^4; then the token the last fed forward drew, free
        want = (2 if threshold == 0.3 else 4) + 1
        assert max(lengths) == want and lengths.count(want) > 0.7 * len(lengths)


def _flat_head(folder: str, reads: str) -> str:
    """A head predicting P(accept) = 0.5 everywhere."""
    head = AcceptanceHead(HeadConfig(hidden_size=64, num_layers=1, reads=reads))
    torch.nn.init.zeros_(head.out.weight)
    torch.nn.init.zeros_(head.out.bias)
    head.save(folder)
    return folder


def test_proposing_head_is_lossless_and_saves_the_extra_draft_forward(tmp_path):
    target = tiny_llama(seed=0)
    draft = noisy_copy(target, 0.02)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (6, 13, 2)]
    sp = SamplingParams(max_new_tokens=24)
    ref = SpecEngine(make_pair(target), sp, SpecConfig(method="none")).generate(prompts)
    forwards = {}
    for reads in ("fed", "proposing"):
        spec = SpecConfig(draft_length="acceptance_head",
                          acceptance_head={"path": _flat_head(str(tmp_path / reads), reads), "threshold": 0.3},
                          max_draft_tokens=8)
        res = SpecEngine(make_pair(target, draft), sp, spec, batch_size=1).generate(prompts)
        assert [r.token_ids for r in res] == [r.token_ids for r in ref]
        full = [(r.draft_forwards, r.rounds) for r in res]
        # 1 - 0.5^2 > 0.3: the 2-token minimum; the fed head's third forward also draws a third token, which
        # SpecDec++ proposes (its free token)
        want = 3 if reads == "fed" else 2
        assert all(d == want for r in res for d in r.draft_lengths[:-1])
        forwards[reads] = sum(f for f, _ in full) / sum(n for _, n in full)
    # at batch 1 a 2-token round costs 2 draft forwards (catch-up + one step); the fed head needs a third,
    # for a third token (rounds cut short by max_new_tokens need fewer)
    assert forwards["proposing"] == pytest.approx(2.0, abs=0.15)
    assert forwards["fed"] - forwards["proposing"] > 0.75


def test_proposing_examples_read_the_state_that_drew_the_token():
    from specdec.plan.head import build_examples

    target = tiny_llama(seed=0)
    draft = noisy_copy(target, 0.05)
    prompt, response = [3, 14, 15, 9, 2], [6, 5, 35, 8, 91, 9, 3, 2]
    cfg = HeadConfig(hidden_size=64, reads="proposing")
    x, y = build_examples(target, draft, prompt, response, SamplingParams(max_new_tokens=8), cfg,
                          torch.Generator().manual_seed(0), vocab=96)
    assert x.shape == (len(response), 64 + 2) and y.shape == (len(response),)
    with torch.no_grad():
        seq = torch.tensor([prompt + response])
        lt, ld = target(seq).logits[0, 4:-1], draft(seq).logits[0, 4:-1]
        hd = draft.get_decoder()(input_ids=seq).last_hidden_state[0, 4:-1]
    assert torch.equal(y, (lt.argmax(-1) == ld.argmax(-1)).float())  # greedy label: the argmaxes agree
    assert torch.allclose(x[:, :64], hd, atol=1e-5)
    q_top = torch.softmax(ld, -1).max(-1).values
    assert torch.allclose(x[:, 64], q_top, atol=1e-5) and torch.allclose(x[:, 65], q_top.log(), atol=1e-4)


def test_proposing_head_starts_from_the_draft_confidence():
    """Untrained, a proposing head ranks tokens exactly as q(x) does, whatever the draft state: training
    refines the draft's own confidence instead of starting from noise."""
    from specdec.plan.head import AcceptanceHead, proposing_features

    head = AcceptanceHead(HeadConfig(hidden_size=32, reads="proposing"))
    g = torch.Generator().manual_seed(0)
    q = torch.rand(200, generator=g) * 0.98 + 0.01
    p = head.p_accept(proposing_features(torch.randn(200, 32, generator=g) * 5, q))
    assert torch.equal(p.argsort(), q.argsort())
    assert torch.allclose(p, q / (1 + q), atol=1e-6)  # sigmoid(log q)


def test_acceptance_head_rounds_reach_specdecpp_length_unless_set(tmp_path):
    """SpecDec++ bounds a round at 20 drafts: the head policy gets that bound unless max_draft_tokens is set."""
    head = {"path": _flat_head(str(tmp_path / "h"), "fed")}
    assert SpecConfig(draft_length="acceptance_head", acceptance_head=head).max_draft_tokens == 20
    assert SpecConfig(draft_length="acceptance_head", acceptance_head=head, max_draft_tokens=6).max_draft_tokens == 6
    assert SpecConfig().max_draft_tokens == 8
