"""The GPU memory plan's arithmetic at a peer's shapes, for any checkout (ROOT, default: this one): the Llama-8B
shape as target (bf16; with the Llama-1B shape as draft), on a 141 GiB H200 at gpu_memory_fraction 0.9 with 17 GiB
in use (the weights), prefills in chunks of 2,048 tokens (the engine's default), captured steps up to 9 tokens wide
(k = 8) and, for AASD, token trees up to 25 (k = 8, two siblings; 3 prompt top ids): the bytes of the caches, the
captured steps and the activations at a batch, and the most rows the plan admits at that many slots a row
(`memory.largest`). Arithmetic, no device: the same on any machine.

    [ROOT=CHECKOUT] python bench/results/plan_rows_at.py
"""

import os
import sys

sys.path.insert(0, os.environ.get("ROOT", os.path.join(os.path.dirname(__file__), "..", "..")))
from specdec.exec import memory  # noqa: E402

GiB = memory.GiB
LLAMA_8B = memory.Shape(32, 32, 8, 128, 4096, 14336, 128256, 2)
LLAMA_1B = memory.Shape(16, 32, 8, 64, 2048, 8192, 128256, 2)
CASES = [("8B, chains", [memory.Role("target", LLAMA_8B, True)], 0),
         ("8B, AASD trees", [memory.Role("target", LLAMA_8B, True)], 25),
         ("8B + 1B draft", [memory.Role("target", LLAMA_8B, True), memory.Role("draft", LLAMA_1B, True)], 0)]

for name, roles, tree in CASES:
    plan = memory.MemoryPlan(roles, 0.9, 141 * GiB, 17 * GiB, 9, 64, tree_width=tree, prompt_top_ids=3 if tree else 0,
                             prefill_chunk=2048)
    for rows, slots in ((64, 4096), (64, 1024), (256, 2048)):
        need = plan.need(rows, slots, rows, slots, 128)
        most = memory.largest(lambda r: plan.fits(plan.need(r, slots, r, slots, 128)), 4096)
        print(f"{name:15s} {rows:3d} rows x {slots:4d} slots: caches {need.kv / GiB:5.1f} GiB, captured steps "
              f"{need.graphs / GiB:5.1f} GiB, activations {need.activations / GiB:5.1f} GiB; rows admitted: {most}")
