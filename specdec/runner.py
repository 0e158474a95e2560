"""One model's forwards over its ragged KV cache: prefill, and the steps a round repeats.

Two paths behind one interface:
- the lean path, for Llama-family models (specdec/llama.py): one function of plain tensors; on a GPU
  every step (verification, draft steps, the draft's catch-up) replays a CUDA graph captured per
  (row bucket, width, cache-length bucket), with the decoder layer compiled. Rows are padded to a
  power of two (junk rows compute on free cache rows; their results are dropped) and the attention
  reads a power-of-two bucket of slots, so a handful of graphs serve a whole job.
- the generic path: transformers' own modules over the cache (any decoder-only model), eager.

`kv_len` is always given by the caller, who knows the rows' lengths on the host: no forward reads a
value back from the device.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from . import llama
from .cache import RaggedKVCache, forward_hidden
from .costmodel import pow2_at_least
from .graphs import StepGraphs, compiled_layer


class ModelRunner:
    max_graph_width = 32  # wider steps (a draft catching up on many tokens) run eagerly
    min_kv_bucket = 64

    # run the lean layer through torch.compile: None on GPUs only (on CPU it is slower), True / False always /
    # never (bench/gpu_speed.py compares)
    compile_layers: bool | None = None

    def __init__(self, model, cache: RaggedKVCache, head_weight: torch.Tensor, head_bias: torch.Tensor | None = None,
                 lean: bool = True, graphs: bool | None = None, weights: llama.LlamaWeights | None = None):
        """`lean`: use the lean forward where the model allows it. `graphs`: replay captured steps (default:
        on a GPU with the lean forward; True on a CPU runs the same padded static steps eagerly). `weights`:
        the lean weights to run (a tensor-parallel shard, specdec/tp.py) instead of the model's own."""
        self.model = model
        self.cache = cache
        self.head_weight = head_weight
        self.head_bias = head_bias
        self.device = cache.k[0].device
        if weights is None and lean and llama.unsupported(model, cache.max_len) is None:
            weights = llama.load_weights(model)
        self.lean = weights
        cuda = self.device.type == "cuda"
        if graphs is None:
            graphs = cuda and self.lean is not None
        self.graphs = StepGraphs(self.device) if graphs else None
        compile = cuda if self.compile_layers is None else self.compile_layers
        self.layer = compiled_layer() if compile and self.lean is not None else llama.layer_forward

    @property
    def path(self) -> str:
        """What runs the steps: 'graphs', 'lean' (eager) or 'generic'."""
        if self.graphs is not None and self.graphs.capture:
            return "graphs"
        return "lean" if self.lean is not None else "generic"

    def prefill(self, tokens: torch.Tensor, start: int, end: int, top: int = 0) -> torch.Tensor | None:
        """Cache tokens [end - start, t] at positions 0..t-1 of rows [start, end) (right-padded rows write
        junk past their length, masked until overwritten). With `top` > 0, returns the model's `top` most
        likely next ids at every position [end - start, t, top]."""
        if self.lean is not None:
            rows = torch.arange(start, end, device=self.device)
            hidden = llama.prefill(self.lean, self.cache.k, self.cache.v, tokens, rows)
        else:
            t = tokens.shape[1]
            positions = torch.arange(t, device=self.device)[None, :].expand(end - start, t)
            hidden = forward_hidden(self.model, self.cache, tokens, positions, start, end, t)
        if not top:
            return None
        # a chunk of positions at a time: [rows, chunk, vocab] logits stay near 64M floats
        chunk = max(1, (1 << 26) // (hidden.shape[0] * self.head_weight.shape[0]))
        return torch.cat([self.logits(h).topk(top, dim=-1).indices for h in hidden.split(chunk, dim=1)], dim=1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output head over hidden states [..., d] -> [..., vocab]."""
        return F.linear(hidden, self.head_weight, self.head_bias)

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, kv_len: int, last: torch.Tensor | None = None,
             slots: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward rows [0, n) (tokens, positions [n, t]; every position < kv_len). Returns logits at every
        position [n, t, vocab] and the hidden states [n, t, d]; or, given `last` [n], each row's logits
        [n, vocab] and hidden state [n, d] at its position last[i]. Graph outputs: read them before the
        next step of the same shape. A token tree's step gives its cache `slots` and `mask` (specdec/trees.py;
        it runs eagerly)."""
        n, t = tokens.shape
        if self.graphs is None or t > self.max_graph_width or mask is not None:
            return self._step(tokens, positions, last, kv_len=min(kv_len, self.cache.max_len), slots=slots, mask=mask)
        rows = min(pow2_at_least(n), self.cache.rows)
        kv = min(pow2_at_least(max(kv_len, self.min_kv_bucket)), self.cache.max_len)
        inputs = (tokens, positions) if last is None else (tokens, positions, last)
        logits, hidden = self.graphs.run((rows, t, kv, last is None), partial(self._step, kv_len=kv), rows, *inputs)
        return logits[:n], hidden[:n]

    def _step(self, tokens, positions, last=None, *, kv_len: int, slots=None, mask=None):
        if self.lean is not None:
            hidden = llama.forward(self.lean, self.cache.k, self.cache.v, tokens, positions, kv_len, self.layer,
                                   slots, mask)
        else:
            hidden = forward_hidden(self.model, self.cache, tokens, positions, 0, tokens.shape[0], kv_len, slots, mask)
        if last is not None:
            hidden = hidden[torch.arange(tokens.shape[0], device=tokens.device), last]
        return self.logits(hidden), hidden
