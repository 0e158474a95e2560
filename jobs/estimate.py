"""`specbatch profile` and `specbatch estimate`: what a job would cost at another batch size, under another
draft-length policy, or on another machine.

`profile` measures the pair's costs with the cost model goodput plans from (specdec/plan/costmodel.py), every
verification width included, plus prefill per prompt token. `estimate` replays a finished job's rows
through a profile: continuous batching of `batch_size` slots, longest prompt first (as the engine runs
them); each round costs the profile's draft work for the round's longest draft plus one target forward
over its width; an admission costs its prefill. Policies:
- `recorded`: every row's own recorded rounds (draft and accept lengths), as they happened;
- `none` or `fixed:K`: each row emits, per round, the expected tokens of K drafts at its own recorded
  per-token acceptance rate, (1 - a^(K+1)) / (1 - a);
- `goodput`: each round the K in 0..max that maximises the batch's expected tokens per second.
"""

from __future__ import annotations

import numpy as np

from specdec.plan.costmodel import Profile, best_length, bucket, expected_tokens

from .manifest import read_output


def profile_job(spec, out_path: str) -> Profile:
    """Measure the job's pair on this machine (its batch size and speculation settings) and save it."""
    import time

    import torch

    from specdec.engine import SpecEngine
    from specdec.exec.memory import Caches
    from specdec.exec.models import load_pair
    from workers.fetch import localize
    from workers.spec import models_used
    from workers.worker import device_name

    used = models_used(spec.models, spec.speculation)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    pair = load_pair(localize(used["models.target.path"]), localize(used.get("models.draft.path")), device)
    engine = SpecEngine(pair, spec.generation, spec.speculation, batch_size=spec.resources.batch_size)
    prof = engine.measure_profile(every_width=True)
    prof.hardware = f"{device_name(engine.device)}, {next(pair.target.parameters()).dtype}"
    # prefill per prompt token: one row of 256 tokens, beyond a prefill call's fixed cost
    tokens = torch.randint(0, pair.vocab_size, (1, 256), device=engine.device)
    engine.hold(Caches(1, 300))
    runner = engine.runner("target")
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        runner.prefill(tokens, 0, 1)
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    prof.prefill_token = max(0.0, min(times) - prof.prefill_fixed) / 256
    prof.save(out_path)
    return prof


def job_rows(path: str) -> tuple[list[dict], dict]:
    """The good rows of a job's output (prompt and output lengths, per-round lists) and its manifest."""
    out = read_output(path, ["prompt_tokens", "generated_tokens", "draft_lengths", "accept_lengths"])
    return [r for r in out.rows() if not r["error"]], out.manifest


def rate_of(row: dict) -> float:
    drafted = sum(row["draft_lengths"])
    return sum(row["accept_lengths"]) / drafted if drafted else 0.0


def replay(rows: list[dict], prof: Profile, batch_size: int, policy: str = "recorded", max_draft: int = 8) -> dict:
    """Predicted seconds and tokens of running `rows` at `batch_size` under `policy` with costs `prof`."""
    order = sorted(range(len(rows)), key=lambda i: -rows[i]["prompt_tokens"])
    queue, active = list(order), []
    left = {i: float(rows[i]["generated_tokens"]) for i in order}
    step = {i: 0 for i in order}  # recorded: the next round of each row
    rates = {i: rate_of(rows[i]) for i in order}
    fixed = 0 if policy == "none" else int(policy.split(":")[1]) if policy.startswith("fixed:") else None
    seconds, rounds = 0.0, 0
    per_token = prof.prefill_token
    while queue or active:
        if queue and len(active) < batch_size:
            joining = queue[: batch_size - len(active)]
            del queue[: len(joining)]
            seconds += prof.prefill_fixed + per_token * sum(rows[i]["prompt_tokens"] for i in joining)
            active += joining
        n, b = len(active), bucket(len(active))
        if policy == "recorded":
            lens = [rows[i]["draft_lengths"][step[i]] if step[i] < len(rows[i]["draft_lengths"]) else 0 for i in active]
            k = max(lens)
            emit = {i: (rows[i]["accept_lengths"][step[i]] + 1 if step[i] < len(rows[i]["accept_lengths"]) else 1)
                    for i in active}
        else:
            tokens = expected_tokens(np.array([rates[i] for i in active]), max(max_draft, fixed or 0))  # [n, K + 1]
            # goodput: the K with the most expected tokens per second at this batch
            k = fixed if fixed is not None else best_length(tokens.sum(0), prof.rounds(b, max_draft))
            emit = {i: float(t) for i, t in zip(active, tokens[:, k])}
        t = prof.round(b, k)
        if t is None:
            raise ValueError(f"the profile has no cost for {n} rows and {k} drafts")
        seconds += t
        rounds += 1
        for i in list(active):
            left[i] -= emit[i]
            step[i] += 1
            if left[i] <= 1e-9:
                active.remove(i)
    tokens = sum(r["generated_tokens"] for r in rows)
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds if seconds else None,
            "rounds": rounds, "batch_size": batch_size, "policy": policy}


def measured(manifest: dict) -> dict:
    """What the job itself took: its workers' seconds on parts, and its tokens."""
    parts = manifest["parts"].values()
    seconds = sum(p.get("wall_s", 0.0) for p in parts)
    tokens = sum(p.get("generated_tokens", 0) for p in parts)
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds if seconds else None}


def estimate(rows: list[dict], manifest: dict, prof: Profile, batch_size: int, policy: str) -> dict:
    """The replay at `batch_size` under `policy`, calibrated by the job's own run: where the profile was
    measured on the job's device, the job's measured worker-seconds over the replay of its own rounds at its
    own batch size (what the profile does not see: host bookkeeping per round, tokenizing, writing parts)
    scales the prediction."""
    spec = manifest["spec"]
    max_draft = spec["speculation"]["max_draft_tokens"]
    raw = replay(rows, prof, batch_size, policy, max_draft)
    own = replay(rows, prof, spec["resources"]["batch_size"], "recorded", max_draft)
    real = measured(manifest)
    devices = {(p.get("device"), p.get("devices", 1)) for p in manifest["parts"].values()}
    same = devices == {(prof.hardware.split(",")[0], 1)}  # a profile is of one process on one device
    scale = real["seconds"] / own["seconds"] if same and own["seconds"] and real["seconds"] else 1.0
    seconds = raw["seconds"] * scale
    return {**raw, "seconds": seconds, "tokens_per_s": raw["tokens"] / seconds if seconds else None,
            "uncalibrated_tokens_per_s": raw["tokens_per_s"], "calibration": scale, "calibrated": same,
            "measured": real}
