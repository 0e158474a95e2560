"""bench/shape_pair.py on a CPU at a tiny shape (the script issue 55 measures on a GPU at the Llama-8B and Llama-1B
shapes): the draft's proposals replaced by the target's greedy tokens, each kept with probability alpha, give an
acceptance of alpha by construction and rows equal to autoregressive's, under the defaults and every fixed K."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_shape_pair_accepts_alpha_and_stays_lossless(tmp_path):
    out = tmp_path / "shape_pair.json"
    cmd = [sys.executable, "bench/shape_pair.py", "--device", "cpu", "--shapes", "tiny", "--alpha", "0.8",
           "--batches", "1,8", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert set(got) == {"1", "8"}
    for batch, r in got.items():
        assert set(r) == {"ar_tok_s", "defaults_tok_s", "best_fixed_k", "best_fixed_tok_s", "tokens_per_call",
                          "alpha_measured", "equal_to_ar", "new_shapes"}
        assert abs(r["alpha_measured"] - 0.8) <= 0.05, (batch, r)
        assert r["equal_to_ar"] is True and r["best_fixed_k"] in (1, 2, 3, 4, 6), (batch, r)
        assert r["ar_tok_s"] > 0 and r["defaults_tok_s"] > 0 and r["tokens_per_call"] >= 1.0
    assert "alpha measured" in proc.stdout and "every row equal to autoregressive's: True" in proc.stdout
