"""FSD calibration (specdec/plan/calibrate.py, `specbatch calibrate`): the matched threshold accepts what the lossless
rule accepts, the thresholds step up from it, and each gives a speed-quality point from real engine runs."""

import json

import numpy as np
import pytest
import torch
import yaml

from engine_models import noisy_copy, pair, tiny_llama
from specdec.plan.calibrate import calibrate, teacher_forced, thresholds
from specdec.config import SamplingParams, SpecConfig
from specdec.engine import SpecEngine

NEW = 24


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(seed=0)
    return target, noisy_copy(target, 0.05)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 96, (n,), generator=g).tolist() for n in (5, 17, 9, 30, 3, 12)]


def test_matched_threshold_accepts_the_lossless_share(models, prompts):
    target, draft = models
    sp = SamplingParams(max_new_tokens=NEW)
    answers = [r.token_ids for r in SpecEngine(pair(target), sp, SpecConfig(method="none")).generate(prompts)]
    divs, accepts, _ = teacher_forced(pair(target, draft), prompts, answers, sp, "js")
    rate = accepts.mean()
    assert 0.1 < rate < 0.9 and len(divs) == len(prompts) * NEW  # a pair that disagrees, every token scored
    ts = thresholds(divs, rate, steps=3, step=0.1)
    assert ts == sorted(ts) and len(ts) == 4
    assert (divs <= ts[0]).mean() == pytest.approx(rate, abs=2 / len(divs))  # T0 accepts the lossless share
    assert (divs <= ts[-1]).mean() == pytest.approx(min(rate + 0.3, 0.99), abs=2 / len(divs))
    same, _, _ = teacher_forced(pair(target, target), prompts, answers, sp, "js")
    assert np.abs(same).max() < 1e-6  # a draft equal to the target diverges nowhere


def test_calibrate_gives_points_from_lossless_upwards(models, prompts):
    target, draft = models
    lines = []
    k, points = calibrate(pair(target, draft), prompts, SamplingParams(max_new_tokens=NEW),
                          SpecConfig(max_draft_tokens=4), batch_size=3, steps=2, step=0.1, log=lines.append)
    assert 1 <= k <= 4 and "best length" in lines[0]
    lossless, *fuzzy = points
    assert lossless.threshold is None and lossless.same == 1.0  # greedy float32: lossless is the target's output
    assert len(fuzzy) == 3 and [p.threshold for p in fuzzy] == sorted(p.threshold for p in fuzzy)
    assert fuzzy[-1].accept > lossless.accept and fuzzy[-1].per_call > lossless.per_call
    assert fuzzy[-1].same < 1.0  # relaxed: some rows leave the target's output


def test_calibrate_cli(tmp_path, tiny_pair):
    from jobs.cli import main as cli

    with open(tmp_path / "in.jsonl", "w") as f:
        f.writelines(json.dumps({"id": i, "prompt": w}) + "\n" for i, w in enumerate(
            ["the water is hot", "how do you make a name", "write one word", "she can find it"]))
    cfg = {"name": "c", "input": {"path": str(tmp_path / "in.jsonl"), "chat_template": True},
           "output": {"path": str(tmp_path / "out")},
           "models": {"target": {"path": tiny_pair["target"], "dtype": "float32"},
                      "draft": {"path": tiny_pair["draft"], "dtype": "float32"}},
           "generation": {"max_new_tokens": 12}, "speculation": {"max_draft_tokens": 3}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(cfg))
    assert cli(["calibrate", str(tmp_path / "job.yaml"), "--prompts", "4", "--steps", "1"]) == 0
