"""Tensor-parallel targets on CPU (gloo), tiny models: each rank holds a 1/N slice; `tensor_parallel: 2`
gives the tokens of one process through the whole job path, with every proposer; a rank killed mid-shard
costs its group a restart and the shard a retry, never a row."""

from __future__ import annotations

import os

import pytest
import torch

from job_helpers import config, read_out, rows_of, run_cli
from jobs.driver import run_job
from jobs.report import Prices, build
from jobs.spec import load_spec
from specdec.config import TargetSource
from specdec.exec.shard import check_shardable, load_shard

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
    # trees at a fixed length: under goodput, whether a round drafts depends on this machine's measured costs
    {"method": "prompt_lookup", "num_draft_tokens": 3, "draft_length": "fixed",
     "prompt_lookup": {"alignment_sampling": 2}},
], ids=["draft-fixed", "lookup-tree-fixed"])
def test_two_ranks_give_the_tokens_of_one(tmp_path, tiny_pair, ray_session, one_process, speculation):
    """Every rank prefills in chunks of 5 tokens (one process took each admission whole): the same tokens."""
    path, _ = config(tmp_path, tiny_pair, rows_of(ROWS), resources__num_workers=1, resources__shard_size=6,
                     resources__prefill_chunk=5, **split(tiny_pair),
                     **{f"speculation__{k}": v for k, v in speculation.items()})
    summary = run_job(load_spec(path), progress=False)
    out, _ = read_out(tmp_path / "out")
    assert {k: r["token_ids"] for k, r in out.items()} == one_process
    assert summary["step_path"] == "lean-tp2"
    # a two-rank worker holds two devices: its seconds are charged twice
    figures = build(str(tmp_path / "out"), Prices.load(None, None, 3.0))[2]
    (device, hours), = figures["worker_hours"].items()
    assert hours > 0 and figures["device_hours"] == {device: pytest.approx(2 * hours)}
    assert figures["usd_per_million_tokens"] == pytest.approx(3.0 * 2 * hours / figures["generated_tokens"] * 1e6)
    assert summary["mean_accepted_length"] > 1  # speculation ran over the split target


def test_specbatch_run_prints_the_group_and_survives_a_rank_killed_mid_shard(tmp_path, tiny_pair, one_process):
    path, _ = config(tmp_path, tiny_pair, rows_of(ROWS), resources__num_workers=1, resources__shard_size=6,
                     speculation__draft_length="fixed", **split(tiny_pair))  # no profiling: the steps are a shard's

    marker = tmp_path / "rank-exit"
    os.environ["SPECBATCH_FAULT_RANK_EXIT"] = str(marker)  # rank 1 dies at its 5th step, once
    os.environ["NCCL_DEBUG"] = "WARN"  # a user's NCCL setting on the driver reaches every rank
    try:
        proc = run_cli(path, "--verbose")
        text, _ = proc.communicate(timeout=600)
    finally:
        del os.environ["SPECBATCH_FAULT_RANK_EXIT"], os.environ["NCCL_DEBUG"]
    assert proc.returncode == 0, text
    assert marker.exists()  # the fault fired
    assert "2 tensor-parallel ranks on node" in text and "rank 1 CPU" in text
    assert "every rank has NCCL_DEBUG=WARN" in text
    assert "restarting the worker's whole group" in text
    out, table = read_out(tmp_path / "out")
    assert table.num_rows == ROWS  # every row exactly once
    assert {k: r["token_ids"] for k, r in out.items()} == one_process


def test_a_rank_out_of_memory_restarts_the_group_with_half_the_batch(tmp_path, tiny_pair, one_process):
    """Rank 1 runs out of memory mid-shard: the group restarts, its worker comes back at batch size 2 instead
    of 4, and the job's rows come out once each with one process's tokens."""
    path, _ = config(tmp_path, tiny_pair, rows_of(ROWS), resources__num_workers=1, resources__shard_size=6,
                     speculation__draft_length="fixed", **split(tiny_pair))
    marker = tmp_path / "rank-oom"
    os.environ["SPECBATCH_FAULT_RANK_OOM"] = str(marker)
    try:
        proc = run_cli(path, "--verbose")
        text, _ = proc.communicate(timeout=600)
    finally:
        del os.environ["SPECBATCH_FAULT_RANK_OOM"]
    assert proc.returncode == 0, text
    assert marker.exists()
    assert "ran out of memory 1 time(s): batch size 4 -> 2" in text
    out, table = read_out(tmp_path / "out")
    assert table.num_rows == ROWS
    assert {k: r["token_ids"] for k, r in out.items()} == one_process


def test_ranks_bind_to_the_groups_gpus_on_their_node():
    """vLLM's binding: every rank on a node sees the group's GPUs there, in id order, and uses its own."""
    from workers.group import bind

    ranks = [{"node": "a", "gpus": ["6"]}, {"node": "a", "gpus": ["10"]}, {"node": "a", "gpus": ["2"]},
             {"node": "b", "gpus": ["0"]}]
    assert [bind(r["gpus"], ranks, r["node"]) for r in ranks] == [("2,6,10", 1), ("2,6,10", 2), ("2,6,10", 0),
                                                                   ("0", 0)]
    with pytest.raises(RuntimeError, match="holds no GPU"):
        bind([], ranks, "a")


def _reduce(rank: int, port: int, out) -> None:
    import datetime

    import torch.distributed as dist

    from specdec.exec.tp import Group

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    g = Group(rank, 2, torch.device("cpu"), 60)
    x = torch.tensor([1.0, 2.0 ** -9, 3.0])
    sums = {str(dt): g.all_reduce(x.to(dt) * (rank + 1)) for dt in (torch.bfloat16, torch.float16, torch.float32)}
    # plain values, not tensors: a tensor crosses the queue as a shared-memory handle the parent opens only
    # after this process may have exited (then the handle's socket is gone)
    out.put((rank, {k: (str(y.dtype), y.float().tolist()) for k, y in sums.items()}))
    dist.destroy_process_group()


def test_all_reduces_keep_bf16_and_sum_float16_in_float32():
    """bf16 goes over the wire as bf16 (half float32's bytes); float16 is summed in float32; float32 stays."""
    import torch.multiprocessing as mp

    from specdec.exec.tp import reduce_dtype
    assert reduce_dtype(torch.bfloat16) == torch.bfloat16 and reduce_dtype(torch.float16) == torch.float32
    assert reduce_dtype(torch.float32) == torch.float32
    from workers.group import _free_port
    ctx = mp.get_context("spawn")
    q, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_reduce, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        for r in range(2):
            dtype, y = got[r][str(dt)]
            assert dtype == str(dt)
            torch.testing.assert_close(torch.tensor(y), (torch.tensor([1.0, 2.0 ** -9, 3.0]).to(dt) * 3).float())


def test_one_process_commands_refuse_a_tensor_parallel_target(tmp_path, tiny_pair, capsys):
    """profile, train-head and calibrate load the whole target in one process: a split target is refused,
    naming the key and what to run instead."""
    from jobs.cli import main as cli
    path, _ = config(tmp_path, tiny_pair, rows_of(2), **split(tiny_pair))
    for argv in (["profile", path, "--out", str(tmp_path / "p.json")], ["train-head", path, "--out",
                 str(tmp_path / "head")], ["calibrate", path]):
        assert cli(argv) == 2
        err = capsys.readouterr().err
        assert f"specbatch {argv[0]} loads the whole target in one process" in err
        assert "models.target.tensor_parallel" in err and "--set models.target.tensor_parallel=1" in err
    assert not (tmp_path / "p.json").exists() and not (tmp_path / "head").exists()
