"""CUDA graphs for the steps whose shapes repeat, and the lean forward's compiled pieces.

A decoding step of a small model on a GPU is launch-bound: transformers' eager modules spend about
1 ms per layer in Python and kernel launches whatever the model's size. `StepGraphs` records a step
once per key (its shapes) and replays it after that: one launch for the whole forward. Inputs are
copied into the graph's own buffers, outputs are the graph's own tensors (valid until the same key
runs again) or written into one buffer every key shares (`shared`: valid until any step runs). All graphs
share one memory pool: they never run at the same time. On a CPU the same object keeps the same static
buffers and runs the step eagerly on them, so the tests exercise the buffer and padding logic where no GPU is.

`compiled_pieces()` is what the lean forward (specdec/exec/llama.py) runs between its attentions through
`torch.compile`: one graph from a layer's attention output to the next layer's attention input (o_proj, the
residual, the MLP, the next norm, q/k/v, RoPE and the cache writes), which inductor fuses into a few kernels around
the matrix products; every layer of every Llama-family model in the process shares them, and so do the forwards no
graph captures (prefills, rows joining a round). The attention runs eagerly between them (inside a graph that costs
no launches): inductor's CUDA attention lowering over a cache slice of symbolic length fails its own stride checks.
Shapes are symbolic: each piece compiles four times per model shape and cache layout (one row or more, one token
or more: PyTorch specializes sizes 0 and 1), not per batch size or width; sizes are not "duck-shaped" (a width
that happened to equal the number of KV heads would otherwise be guarded as equal). On CPU the compiled pieces are
slower than eager and take minutes to compile, so only GPUs use them (bench/results/README.md has the figures).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_COMPILED: dict[str, Callable] = {}
_SIDE: dict[int, torch.cuda.Stream] = {}  # side_stream()'s, by device index


def pow2_at_least(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1): the buckets steps' rows and attention windows are padded to."""
    return 1 << max(0, x - 1).bit_length()


def width_buckets(width: int, most: int | None = None) -> list[int]:
    """The widths steps of up to `width` tokens per row are padded to: powers of two, and `width` (`most`: those
    that steps of up to `most` tokens take)."""
    return sorted({min(pow2_at_least(w), width) for w in range(1, min(width, most or width) + 1)})


def _symbolic() -> None:
    """What compilations with symbolic shapes need: sizes not "duck-shaped", and room for many compilations."""
    import torch.fx.experimental._config as fx_config

    fx_config.use_duck_shape = False
    _many_compilations()


def _many_compilations() -> None:
    # shapes are specialized (a model's weights, a step's rows): every model shape in the process (a target and its
    # draft, a bench's several) adds its own compilations; torch's default limit of 8 would send the ninth to eager
    dynamo = torch._dynamo.config
    dynamo.recompile_limit = max(getattr(dynamo, "recompile_limit", 8), 64)


def compiled_flex() -> Callable:
    """torch's flex_attention compiled, once per process (one compilation per shape it meets: its dynamic shapes do
    not compile on a CPU)."""
    if "flex" not in _COMPILED:
        from torch.nn.attention.flex_attention import flex_attention

        _many_compilations()
        _COMPILED["flex"] = torch.compile(flex_attention, dynamic=False)
    return _COMPILED["flex"]


def compiled_pieces():
    """The lean forward's pieces between its attentions (`llama.Pieces`) through torch.compile, once per process:
    the captured steps', and the eager forwards' (prefills, rows joining a round)."""
    from . import llama

    if "pieces" not in _COMPILED:
        _symbolic()
        _COMPILED["pieces"] = llama.Pieces(*(torch.compile(f, dynamic=True, fullgraph=True)
                                             for f in (llama._first, llama._between, llama._last)))
    return _COMPILED["pieces"]


def fused_pieces(compile: bool):
    """The pieces of steps of at most `fused.MAX_TOKENS` tokens with the fused kernels (specdec/exec/fused.py), once
    per process: the final norm through torch.compile where `compile`."""
    from . import fused, llama

    key = f"fused-{compile}"
    if key not in _COMPILED:
        if compile:
            _symbolic()
            _COMPILED[key] = fused.pieces(torch.compile(llama.rms_norm, dynamic=True, fullgraph=True))
        else:
            _COMPILED[key] = fused.pieces()
    return _COMPILED[key]


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The one stream every capture in the process warms up and records on, per device. torch keeps a cuBLAS
    workspace (tens of MiB) for each stream that runs a matmul, for good: a fresh stream per capture (torch's pool
    hands out 32 in turn) would leave up to 32 of them allocated, outside the memory plan."""
    key = torch.device(device).index or 0
    if key not in _SIDE:
        _SIDE[key] = torch.cuda.Stream(device)
    return _SIDE[key]


class StepGraphs:
    """Captured steps keyed by the caller's key (which must fix every shape the step sees)."""

    warmup = 2  # eager runs before capture: compilation, cuBLAS handles and workspaces

    def __init__(self, device: torch.device):
        self.device = device
        self.capture = device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, list[torch.Tensor], object]] = {}
        self._shared: torch.Tensor | None = None

    def shared(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat buffer of `numel` elements every step may write an output into (allocated once: the first call's
        size and dtype): steps run one at a time, and the caller reads such an output before the next step."""
        if self._shared is None:
            self._shared = torch.empty(numel, dtype=dtype, device=self.device)
        assert self._shared.numel() == numel and self._shared.dtype == dtype
        return self._shared

    def run(self, key: tuple, fn: Callable, rows: int, *inputs: torch.Tensor):
        """fn(*static) through the graph captured for `key` (captured now if new), where the static inputs
        have `rows` rows and `inputs` fill their first rows; the rest keep what they held (the caller's
        junk rows: their results are to be ignored)."""
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.graphs[key] = self._capture(fn, rows, inputs)
        graph, static, out = entry
        for buf, x in zip(static, inputs):
            buf[: x.shape[0]].copy_(x)
        if graph is None:
            return fn(*static)
        graph.replay()
        return out

    def _capture(self, fn: Callable, rows: int, inputs: tuple[torch.Tensor, ...]):
        static = [x.new_zeros((rows, *x.shape[1:])) for x in inputs]
        for buf, x in zip(static, inputs):
            buf[: x.shape[0]].copy_(x)
        if not self.capture:
            return None, static, None
        side = side_stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                fn(*static)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool, stream=side):
                out = fn(*static)
        except Exception:
            # a capture that failed midway can leave its pool marked as recording, and every later capture
            # into it fails ("already recording to mempool"): later shapes get a pool of their own
            self.pool = torch.cuda.graph_pool_handle()
            raise
        return graph, static, out

    def clear(self) -> None:
        self.graphs.clear()

    def nbytes(self) -> int:
        """Bytes the captured steps keep (static inputs and outputs, the shared buffer)."""
        from torch.utils._pytree import tree_flatten

        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in tree_flatten([self._shared, *self.graphs.values()])[0] if isinstance(t, torch.Tensor)}
        return sum(storages.values())

    def __len__(self) -> int:
        return len(self.graphs)
