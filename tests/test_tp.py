"""Tensor-parallel targets on CPU (gloo), tiny models: each rank holds a 1/N slice; `tensor_parallel: 2`
gives the tokens of one process through the whole job path, with every proposer; a rank killed mid-shard
costs its group a restart and the shard a retry, never a row."""

from __future__ import annotations

import os

import pytest
import torch

from job_helpers import config, read_out, rows_of, run_cli
from jobs.driver import run_job
from jobs.spec import load_spec
from specdec.config import TargetSource
from specdec.shard import check_shardable, load_shard

ROWS = 12


def split(tiny_pair, ranks: int = 2) -> dict:
    return {"models__target": {"path": tiny_pair["target"], "dtype": "float32", "tensor_parallel": ranks}}


def test_each_rank_holds_a_slice(tiny_pair):
    from transformers import AutoModelForCausalLM

    src = TargetSource(path=tiny_pair["target"], dtype="float32")
    full = AutoModelForCausalLM.from_pretrained(tiny_pair["target"], dtype=torch.float32)
    whole = sum(p.numel() * p.element_size() for p in full.parameters())
    norms = sum(p.numel() * p.element_size() for n, p in full.named_parameters() if "norm" in n)
    shards = [load_shard(src, r, 2, "cpu") for r in range(2)]
    for s in shards:  # half of everything but the norms (replicated), and at most a padding row of the vocabulary
        assert abs(s.weight_bytes() - norms - (whole - norms) / 2) <= 2 * full.config.hidden_size * 4
        assert s.config.num_attention_heads == 2 and s.config.num_key_value_heads == 1
    # the slices put together are the model: rank 0's q rows then rank 1's are q_proj
    q = full.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(torch.cat([s.weights.layers[0].qkv[: q.shape[0] // 2] for s in shards]), q)
    down = full.model.layers[1].mlp.down_proj.weight
    assert torch.equal(torch.cat([s.weights.layers[1].down for s in shards], dim=1), down)


def test_unsplittable_targets_are_refused(tiny_pair):
    with pytest.raises(ValueError, match="tensor_parallel 3 must divide the target's 4 attention heads and 2 KV"):
        check_shardable(TargetSource(path=tiny_pair["target"]), 3)
    with pytest.raises(ValueError, match="GGUF target"):
        check_shardable(TargetSource(path=tiny_pair["target"], gguf_file="x.gguf"), 2)


@pytest.fixture(scope="module")
def one_process(tiny_pair, tmp_path_factory, ray_session):
    """The rows' greedy tokens with the target in one process."""
    tmp = tmp_path_factory.mktemp("tp1")
    path, _ = config(tmp, tiny_pair, rows_of(ROWS), resources__num_workers=1, resources__shard_size=6)
    run_job(load_spec(path), progress=False)
    out, _ = read_out(tmp / "out")
    return {k: r["token_ids"] for k, r in out.items()}


@pytest.mark.parametrize("speculation", [
    {"method": "draft_model", "num_draft_tokens": 3, "draft_length": "fixed"},
    {"method": "prompt_lookup", "draft_length": "goodput", "prompt_lookup": {"alignment_sampling": 2}},
], ids=["draft-fixed", "lookup-tree-goodput"])
def test_two_ranks_give_the_tokens_of_one(tmp_path, tiny_pair, ray_session, one_process, speculation):
    path, _ = config(tmp_path, tiny_pair, rows_of(ROWS), resources__num_workers=1, resources__shard_size=6,
                     **split(tiny_pair), **{f"speculation__{k}": v for k, v in speculation.items()})
    summary = run_job(load_spec(path), progress=False)
    out, _ = read_out(tmp_path / "out")
    assert {k: r["token_ids"] for k, r in out.items()} == one_process
    assert summary["step_path"] == "lean-tp2"
    assert summary["mean_accepted_length"] > 1  # speculation ran over the split target


def test_specbatch_run_prints_the_group_and_survives_a_rank_killed_mid_shard(tmp_path, tiny_pair, one_process):
    path, _ = config(tmp_path, tiny_pair, rows_of(ROWS), resources__num_workers=1, resources__shard_size=6,
                     speculation__draft_length="fixed", **split(tiny_pair))  # no profiling: the steps are a shard's

    marker = tmp_path / "rank-exit"
    os.environ["SPECBATCH_FAULT_RANK_EXIT"] = str(marker)  # rank 1 dies at its 5th step, once
    try:
        proc = run_cli(path, "--verbose")
        text, _ = proc.communicate(timeout=600)
    finally:
        del os.environ["SPECBATCH_FAULT_RANK_EXIT"]
    assert proc.returncode == 0, text
    assert marker.exists()  # the fault fired
    assert "2 tensor-parallel ranks on node" in text and "rank 1 CPU" in text
    assert "restarting the worker's whole group" in text
    out, table = read_out(tmp_path / "out")
    assert table.num_rows == ROWS  # every row exactly once
    assert {k: r["token_ids"] for k, r in out.items()} == one_process
