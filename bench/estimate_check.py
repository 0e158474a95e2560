"""Does `specbatch estimate` predict another batch size? The real pair, held-out chat prompts, one worker:
run the job at batch 1, profile the pair, predict batch B from the batch-1 rows, run batch B, compare.

    python bench/estimate_check.py [--batch 8] [--policies fixed:2,goodput] [--max-new 64] [--out /tmp/estimate-check]

For each draft-length policy: the predicted (calibrated by the batch-1 run, and raw) and measured tokens/s
per worker at batch B (worker seconds: the parts' own wall time), and the prediction's error. A `fixed:K` job is replayed with its recorded
rounds (`recorded`: the same K every round); the default `goodput` job is replayed with the goodput
policy on the profile (at batch B it chooses its own K, as the engine does).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import yaml

sys.path.insert(0, os.path.dirname(__file__))
from engine_speed import DEFAULT_DRAFT, TARGET  # noqa: E402
from prompts import HELD_OUT  # noqa: E402

from jobs.driver import run_job  # noqa: E402
from jobs.estimate import estimate, job_rows, measured  # noqa: E402
from jobs.spec import load_spec  # noqa: E402
from specdec.plan.costmodel import Profile  # noqa: E402


def job(folder: str, batch: int, policy: str, max_new: int) -> str:
    os.makedirs(folder, exist_ok=True)
    inp = os.path.join(folder, "prompts.jsonl")
    with open(inp, "w") as f:
        for i, p in enumerate(HELD_OUT):
            f.write(json.dumps({"id": f"p{i}", "prompt": p}) + "\n")
    spec = {"method": "draft_model"}
    if policy.startswith("fixed:"):
        spec.update(draft_length="fixed", num_draft_tokens=int(policy.split(":")[1]))
    cfg = {"name": f"check-{batch}", "input": {"path": inp, "chat_template": True},
           "output": {"path": os.path.join(folder, f"out-b{batch}")},
           "models": {"target": {"path": TARGET.path, "gguf_file": TARGET.gguf_file},
                      "draft": {"path": os.path.abspath(DEFAULT_DRAFT)}},
           "generation": {"max_new_tokens": max_new}, "speculation": spec,
           "resources": {"num_workers": 1, "batch_size": batch, "shard_size": 64}}
    path = os.path.join(folder, f"job-b{batch}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--policies", default="fixed:2,goodput")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--out", default="/tmp/estimate-check")
    args = ap.parse_args()
    print(f"# python bench/estimate_check.py --batch {args.batch} --policies {args.policies} --max-new {args.max_new}")
    for policy in args.policies.split(","):
        folder = os.path.join(args.out, policy.replace(":", ""))
        small, big = job(folder, 1, policy, args.max_new), job(folder, args.batch, policy, args.max_new)
        spec_small, spec_big = load_spec(small), load_spec(big)
        run_job(spec_small, progress=False, overwrite=True)
        prof_path = os.path.join(folder, "profile.json")
        subprocess.run([sys.executable, "-m", "jobs.cli", "profile", big, "--out", prof_path], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        run_job(spec_big, progress=False, overwrite=True)
        rows, manifest_small = job_rows(spec_small.output.path)
        _, manifest_big = job_rows(spec_big.output.path)
        prof = Profile.load(prof_path)
        replayed = "recorded" if policy.startswith("fixed:") else policy
        est = estimate(rows, manifest_small, prof, args.batch, replayed)
        m1, mb = measured(manifest_small), measured(manifest_big)
        print(f"{policy:>8}: batch 1 measured {m1['tokens_per_s']:.1f} tok/s (the profile alone replays it "
              f"{est['calibration']:.2f}x faster: the calibration); batch {args.batch} predicted "
              f"{est['tokens_per_s']:.1f} tok/s (uncalibrated {est['uncalibrated_tokens_per_s']:.1f}), measured "
              f"{mb['tokens_per_s']:.1f}: error {est['tokens_per_s'] / mb['tokens_per_s'] - 1:+.1%} "
              f"(uncalibrated {est['uncalibrated_tokens_per_s'] / mb['tokens_per_s'] - 1:+.1%}); {prof.hardware}")

if __name__ == "__main__":
    main()
