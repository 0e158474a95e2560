"""What a captured decode step of the fused path dispatches on a CPU, under Triton's interpreter: its Triton launches
per layer and the tensor ops outside them (each a kernel inside a CUDA graph), at the SmolLM2 shape (random weights,
float32, one row, one token, a 64-slot window), with the fused attention (`Pieces.attend`) and without it (SDPA under
a mask tensor built once a step). Layers counted from two depths (1 and 2): per layer = the difference. On CUDA the
SDPA path's mask is made additive once a step (2 ops more outside the layers) and SDPA takes it as it is (the CPU's
per-layer `where` and `scalar_tensor` turn a boolean mask into an additive one).
    TRITON_INTERPRET=1 python bench/results/fused_step_ops.py   (triton installed)
"""
import collections
import dataclasses
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(here, "..", ".."), os.path.join(here, "..")]
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import step_speed  # noqa: E402
from specdec.exec import fused  # noqa: E402
from specdec.exec.cache import RaggedKVCache  # noqa: E402
from specdec.exec.runner import ModelRunner  # noqa: E402

FREE = {"view", "_unsafe_view", "reshape", "transpose", "t", "permute", "expand", "slice", "select", "unsqueeze",
        "squeeze", "split", "split_with_sizes", "chunk", "alias", "as_strided", "detach", "empty", "empty_strided",
        "unbind", "lift_fresh"}  # views and allocations: no kernel
WRAPPERS = ("product", "qkv_rope", "attend")


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops, self.inside = collections.Counter(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.inside and name not in FREE:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def count(layers: int, attention: bool) -> tuple[collections.Counter, collections.Counter]:
    mode, launches = Ops(), collections.Counter()
    saved = {name: getattr(fused, name) for name in WRAPPERS}
    for name in WRAPPERS:
        def wrapped(*a, _run=getattr(fused, name), _name=name, **kw):
            launches[_name] += 1
            mode.inside += 1
            try:
                return _run(*a, **kw)
            finally:
                mode.inside -= 1
        setattr(fused, name, wrapped)
    step_speed.SHAPES["counted"] = dict(step_speed.SHAPES["smollm2"], num_hidden_layers=layers)
    model = step_speed.random_model("counted", "cpu", torch.float32)
    ModelRunner.fuse_products = True
    runner = ModelRunner(model, RaggedKVCache(model, rows=1, max_len=256), model.lm_head.weight, graphs=True)
    if not attention:
        runner.fused = dataclasses.replace(runner.fused, attend=None)
    tokens, positions, last = torch.zeros((1, 1), dtype=torch.long), torch.full((1, 1), 5), torch.zeros(1).long()
    runner.step(tokens, positions, 64, last)  # the first: checked against eager
    launches.clear()
    with mode:
        runner.step(tokens, positions, 64, last)
    for name, run in saved.items():
        setattr(fused, name, run)
    return mode.ops, launches


for attention in (False, True):
    (ops1, l1), (ops2, l2) = count(1, attention), count(2, attention)
    layer = ops2 - ops1
    print(f"{'fused attention' if attention else 'SDPA (mask tensor)'}: a layer {sum(l2.values()) - sum(l1.values())} "
          f"Triton launches {dict(l2 - l1)} + {sum(layer.values())} ops {dict(layer)}; outside the layers "
          f"{sum((ops1 - layer).values())} ops {dict(ops1 - layer)} (3 of them the static inputs' copies, outside the "
          f"graph)")
