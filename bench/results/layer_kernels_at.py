"""The kernels a decoder layer of a decode step runs through the lean forward with its compiled code, counted on a
CPU's inductor for any checkout (ROOT, default: this one): the compute ops torch.profiler records that run no
compute op inside (inductor's fused kernels, the matrix products, eager ops such as the cache writes and the
attention), over one warm forward of n rows x t tokens (t > 1: a speculative round's verification), at 2 and at 4
layers: half the difference is a layer's.
Counted, not timed. On a GPU, inductor's Triton fuses differently (bench/step_speed.py --kernels lists a step's).
`--fused`: the pieces of specdec/exec/fused.py instead (each of its Triton kernels counts one, what runs inside it
none; it needs triton and TRITON_INTERPRET=1 in the environment on a CPU).

    [ROOT=CHECKOUT] python bench/results/layer_kernels_at.py [--rows 1,4] [--tokens 1] [--fused]
"""

import argparse
import collections
import os
import sys

ROOT = os.environ.get("ROOT", os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import torch  # noqa: E402
import torch._inductor.config as inductor  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402
from engine_models import tiny_llama  # noqa: E402

from specdec.exec import graphs, llama  # noqa: E402
from specdec.exec.cache import RaggedKVCache  # noqa: E402

inductor.cpp.enable_kernel_profile = True  # each fused kernel an event of its own
FREE = {"as_strided", "view", "empty", "empty_strided", "resolve_conj", "resolve_neg", "scalar_tensor", "lift_fresh",
        "_reshape_alias", "reshape", "expand", "transpose", "slice", "select", "unsqueeze", "squeeze", "permute", "t",
        "detach", "alias", "unbind", "split", "split_with_sizes", "chunk", "narrow", "_unsafe_view", "to",
        "contiguous", "empty_like", "result_type", "item", "_local_scalar_dense", "unflatten", "flatten", "view_as",
        "expand_as", "matmul", "linear", "scaled_dot_product_attention"}  # no kernel of their own, or one inside


def compute(event) -> bool:
    if "cpp_fused" in event.name:
        return True
    return event.name.startswith("aten::") and event.name[6:] not in FREE


def inside(event):
    for child in event.cpu_children:
        yield child
        yield from inside(child)


FUSED = "fused kernel"  # a profiler range around each of fused.py's kernels


def counted(f):
    def call(*a, **kw):
        with torch.profiler.record_function(FUSED):
            return f(*a, **kw)
    return call


def kernels(layers: int, rows: int, width: int = 1, fused: bool = False) -> collections.Counter:
    """The innermost compute ops of one warm forward of `rows` rows x `width` tokens over the tests' tiny random
    model with `layers` layers (`fused`: each fused kernel one)."""
    model = tiny_llama(layers=layers)
    w, cache = llama.load_weights(model), RaggedKVCache(model, 4, 128)
    tokens, positions = torch.randint(0, 96, (rows, width)), 5 + torch.arange(width).expand(rows, width)
    if fused:
        from specdec.exec import fused as kit

        kit.product, kit.qkv_rope = counted(kit.product), counted(kit.qkv_rope)

        def run():
            return llama.forward(w, cache, tokens, positions, 64, kit.pieces())
    elif hasattr(graphs, "compiled_pieces"):  # since the pieces between attentions (2026-11-29)
        def run():
            return llama.forward(w, cache, tokens, positions, 64, graphs.compiled_pieces())
    else:  # the layer's two halves around its cache writes and attention
        def run():
            return llama.forward(w, cache, tokens, positions, 64, graphs.compiled_layer())
    with torch.inference_mode():
        for _ in range(2):
            run()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run()
    events = prof.events()
    hidden = {id(c) for e in events if e.name == FUSED for c in inside(e)}
    return collections.Counter(e.name for e in events if id(e) not in hidden and (
        e.name == FUSED or (compute(e) and not any(map(compute, inside(e))))))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--tokens", default="1", help="tokens a row (1: a decode step)")
    ap.add_argument("--fused", action="store_true", help="specdec/exec/fused.py's pieces")
    args = ap.parse_args()
    for rows, width in ((r, t) for t in map(int, args.tokens.split(",")) for r in map(int, args.rows.split(","))):
        two, four = kernels(2, rows, width, args.fused), kernels(4, rows, width, args.fused)
        per = {name: (four[name] - two[name]) / 2 for name in four.keys() | two.keys() if four[name] != two[name]}
        names = ", ".join(f"{n:g} {name.split('cpp_fused_')[-1][:48]}" for name, n in
                          sorted(per.items(), key=lambda kv: (-kv[1], kv[0])))
        print(f"rows {rows} x {width} tokens: {sum(per.values()):g} kernels a layer: {names}")


if __name__ == "__main__":
    main()
