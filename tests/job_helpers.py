"""Job-test helpers: a job config over tiny models, rows, reading the output back, running the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import yaml

COLUMNS = ["id", "completion", "sample_index", "token_ids", "prompt_tokens", "cached_prompt_tokens", "generated_tokens",
           "finish_reason", "error", "rounds", "draft_forwards", "drafted_tokens", "accepted_tokens", "draft_lengths", "accept_lengths",
           "acceptance_rate", "mean_accepted_length", "forced_tokens", "verification", "logprobs", "top_logprobs",
           "wall_s", "tokens", "parsed", "warnings", "chat", "control"]
TEXTS = ["the water is hot", "he said that the day was long", "how do you make a good name",
         "write one word", "look at the little man over there and call him back", "she can find it"]


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


def config(tmp_path, tiny_pair, rows, **over):
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    cfg = {
        "name": "t",
        "input": {"path": inp, "prompt_column": "prompt", "chat_template": True},
        "output": {"path": str(tmp_path / "out")},
        "models": {"target": {"path": tiny_pair["target"], "dtype": "float32"},
                   "draft": {"path": tiny_pair["draft"], "dtype": "float32"}},
        "generation": {"max_new_tokens": 12},
        "speculation": {"method": "draft_model", "num_draft_tokens": 3},
        "resources": {"num_workers": 2, "batch_size": 4, "shard_size": 3},
    }
    for key, value in over.items():
        section, _, name = key.partition("__")
        cfg[section][name] = value
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path), cfg


def rows_of(n):
    return [{"id": f"r{i}", "prompt": TEXTS[i % len(TEXTS)] + " " + " ".join(["the"] * (i % 4))} for i in range(n)]


def read_out(folder):
    table = pq.read_table(str(folder), schema=None)
    return {r["id"]: r for r in table.to_pylist()}, table


def run_cli(path, *extra):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "jobs.cli", "run", path, "--no-progress", *extra], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def free_port() -> int:
    """A loopback port free now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def moto_s3(secret: str, key_id: str = "AKIDTESTING", bucket: str = "bucket"):
    """A real S3-compatible server (moto in server mode) on loopback with a bucket `bucket`, its endpoint and
    credentials in this process's environment (and so in the CLI's and Ray workers') for as long as the
    generator runs: `yield from moto_s3(SECRET)` in a module fixture. Yields the environment it set."""
    import boto3
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": key_id,
           "AWS_SECRET_ACCESS_KEY": secret, "AWS_DEFAULT_REGION": "us-east-1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        boto3.client("s3").create_bucket(Bucket=bucket)
        yield env
    finally:
        server.stop()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
