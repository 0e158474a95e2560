"""One model's forwards over its ragged KV cache: prefill, and the steps a round repeats.

Two paths behind one interface:
- the lean path, for Llama-family models (specdec/exec/llama.py): one function of plain tensors; on a GPU
  every step (verification of chains or token trees, draft steps, the draft's catch-up) replays a CUDA graph
  captured per (row bucket, width bucket, cache-length bucket, outputs), with the decoder layer compiled. Rows
  and widths are padded to powers of two (junk rows compute on free cache rows, junk columns on slots past their
  row's tokens; their results are dropped) and the attention reads a power-of-two bucket of slots, so a handful
  of graphs serve a whole job, and `capture` takes them all before the job's rows join.
- the generic path: transformers' own modules over the cache (any decoder-only model), eager.

`kv_len` is always given by the caller, who knows the rows' lengths on the host: no forward reads a
value back from the device.

The fast path cannot fail a job: the first step of each shape on it (a graph, or the compiled layer) runs
again eagerly and is compared; a failure (capture or compilation raising), non-finite logits or logits
beyond tolerance of eager's send that shape to the eager path for good, said once in the log and in
`path` ("...+eager-fallback"). Running a step twice is harmless: it writes the same cache slots.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from operator import itemgetter
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from . import fused, llama
from .cache import KVCache, forward_hidden
from .graphs import StepGraphs, compiled_pieces, fused_pieces, pow2_at_least

if TYPE_CHECKING:
    from .inputs import Join

log = logging.getLogger(__name__)
_said: set[str] = set()  # fallback reasons already logged by this process


class ModelRunner:
    max_graph_width = 32  # wider steps (a draft catching up on many tokens) run eagerly
    max_tree_width = 32  # and wider token trees' steps (the engine sets both to what its memory plan counts)
    # the most positions a row of a static step has logits at ("all" and "tree" steps; None: the widest step)
    logits_width: int | None = None
    min_kv_bucket = 64
    # once a job's steps are captured (`sealed`), a step of a shape not captured yet runs through a captured one that
    # covers it (`cover`) the first COVER_STEPS times it is met, and is captured after that: shapes a job meets a few
    # times (its last rows) cost no capture inside it, shapes it meets often pay theirs once
    COVER_STEPS = 32

    # run the lean forward's pieces between the attentions through torch.compile: None on GPUs only (on CPU it is
    # slower), True / False always / never (bench/step_speed.py compares: fast, fast-uncompiled, fast-compiled)
    compile_layers: bool | None = None
    # where they are compiled, forwards no graph captures (prefills, rows joining a round) run through them too
    # (False: eagerly; bench/step_speed.py's fast-joins-eager)
    compile_prefills: bool = True
    # captured steps of at most fused.MAX_TOKENS tokens run their matrix products through fused Triton kernels
    # (specdec/exec/fused.py; CUDA): off until a GPU measures them (bench/step_speed.py's fast-fused)
    fuse_products: bool = False

    def __init__(self, model, cache: KVCache, head_weight: torch.Tensor, head_bias: torch.Tensor | None = None,
                 lean: bool = True, graphs: bool | None = None, weights: llama.LlamaWeights | None = None,
                 fault: Callable[[tuple], str | None] | None = None):
        """`lean`: use the lean forward where the model allows it. `graphs`: replay captured steps (default:
        on a GPU with the lean forward; True on a CPU runs the same padded static steps eagerly). `weights`:
        the lean weights to run (a tensor-parallel shard, specdec/exec/tp.py) instead of the model's own.
        `fault`: a test's hook (workers/faults.py), called with a step's key the first time a fast step of that key
        runs; it returns None, "raise" (its capture or compilation fails) or "nan" (its logits come out
        non-finite)."""
        self.model = model
        self.cache = cache
        self.head_weight = head_weight
        self.head_bias = head_bias
        self.device = cache.k[0].device
        if weights is None and lean and llama.unsupported(model, cache.max_len) is None:
            weights = llama.load_weights(model)
        self.lean = weights
        cuda = self.device.type == "cuda"
        self.fault = fault
        if graphs is None:  # an injected fault (a test, on CPU) takes the static steps, to have them fail
            graphs = (cuda or fault is not None) and self.lean is not None
        self.graphs = StepGraphs(self.device) if graphs else None
        compile = cuda if self.compile_layers is None else self.compile_layers
        self.pieces = compiled_pieces() if compile and self.lean is not None else llama.EAGER
        fusable = self.fuse_products and self.graphs is not None and self.lean is not None \
            and self.lean.layers[0].reduce is None and fused.available(self.device) is None
        self.fused = fused_pieces(compile) if fusable else None  # static steps of few tokens: their pieces
        self.checked: set[tuple] = set()  # shapes whose fast step matched eager
        self.eager: dict[tuple, str] = {}  # shapes sent to the eager path, with the reason
        self.errors: dict[tuple, float] = {}  # each checked shape's relative error against eager (`relative_error`)
        self.sealed = False  # steps of shapes not captured yet run through covering ones for a while (`cover`)
        self.met: dict[tuple, int] = {}  # how often each shape not captured yet was met since `sealed`

    @property
    def path(self) -> str:
        """What runs the steps: 'graphs', 'lean' (eager) or 'generic'; '+fused' where steps of few tokens take the
        fused products; '+eager-fallback' when some shapes fell back from the fast path."""
        if self.graphs is not None and self.graphs.capture:
            base = "graphs"
        else:
            base = "lean" if self.lean is not None else "generic"
        return base + ("+fused" if self.fused else "") + ("+eager-fallback" if self.eager else "")

    def prefill(self, tokens: torch.Tensor, start: int, end: int, top_ids: int = 0,
                lengths: torch.Tensor | None = None, offsets: np.ndarray | None = None) -> torch.Tensor | None:
        """Cache tokens [end - start, t] at positions 0..t-1 of rows [start, end) (right-padded rows write
        junk past their length, masked until overwritten). `offsets` [end - start] (host): row i's tokens go at
        positions offsets[i].. instead, after the slots its cache row already holds (a reused prefix,
        specdec/exec/prefix.py; a prefill in chunks, specdec/exec/prefill.py). With `top_ids` > 0, returns the model's
        `top_ids` most likely next ids at every given token [end - start, t, top_ids], computed where the token's
        column < lengths[row] (None: every column) and 0 past it."""
        if offsets is not None:
            hidden = self._extend(tokens, start, end, offsets)
        elif self.lean is not None:
            hidden = self._compiled(*tokens.shape, lambda pieces: llama.prefill(
                self.lean, self.cache, tokens, start, pieces))
        else:
            t = tokens.shape[1]
            positions = torch.arange(t, device=self.device)[None, :].expand(end - start, t)
            hidden = forward_hidden(self.model, self.cache, tokens, positions, start, end, t)
        if not top_ids:
            return None
        n, t = tokens.shape
        valid = torch.ones(n, t, dtype=torch.bool, device=self.device) if lengths is None else \
            torch.arange(t, device=self.device)[None, :] < lengths.to(self.device)[:, None]
        flat = hidden[valid]  # the rows' own positions only: the output head over padding would be waste
        chunk = max(1, (1 << 26) // self.head_weight.shape[0])  # [chunk, vocab] logits stay near 64M floats
        out = torch.zeros(n, t, top_ids, dtype=torch.int64, device=self.device)
        out[valid] = torch.cat([self.logits(h).topk(top_ids, dim=-1).indices for h in flat.split(chunk)])
        return out

    def _extend(self, tokens: torch.Tensor, start: int, end: int, offsets: np.ndarray) -> torch.Tensor:
        """Rows [start, end) go on from offsets[i] cached slots: their tokens attend to those and to each other.
        Returns the hidden states [end - start, t, d]."""
        t = tokens.shape[1]
        positions = torch.from_numpy(np.asarray(offsets, dtype=np.int64)).to(self.device)[:, None] \
            + torch.arange(t, device=self.device)
        kv_len = min(int(np.max(offsets)) + t, self.cache.max_len)
        if self.lean is not None:
            return self._compiled(end - start, t, lambda pieces: llama.forward(
                self.lean, self.cache, tokens, positions, kv_len, pieces, start=start))
        return forward_hidden(self.model, self.cache, tokens, positions, start, end, kv_len)

    @property
    def _prefill_compiled(self) -> bool:
        """Whether forwards no graph captures run the compiled pieces: they are compiled, and `compile_prefills`."""
        return self.pieces is not llama.EAGER and self.compile_prefills

    def _compiled(self, n: int, t: int, forward: Callable):
        """forward(pieces), a forward no graph captures (a prefill, rows joining a round) whose pieces see n rows x
        t tokens: through the compiled pieces where `_prefill_compiled`, checked as a step of their compilation is
        (`_checked`, under the key a step of n x t has off the graphs); else eagerly."""
        eager = partial(forward, llama.EAGER)
        if not self._prefill_compiled:
            return eager()
        return self._checked(("layer", n > 1, t > 1, False), lambda: forward(self.pieces), eager, compared=_rows)

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The output head over hidden states [..., d] -> [..., vocab]; into the first elements of `out` (flat) where
        given (the same product F.linear makes)."""
        if out is None:
            return F.linear(hidden, self.head_weight, self.head_bias)
        flat, w, b = hidden.reshape(-1, hidden.shape[-1]), self.head_weight, self.head_bias
        into = out[: flat.shape[0] * w.shape[0]].view(flat.shape[0], w.shape[0])
        torch.mm(flat, w.t(), out=into) if b is None else torch.addmm(b, flat, w.t(), out=into)
        return into.view(*hidden.shape[:-1], w.shape[0])

    def _shared_logits(self, rows: int, width: int) -> torch.Tensor | None:
        """The buffer every static step writes its logits into (`StepGraphs.shared`: rows x `logits_width` x vocab),
        where a step of `rows` x `width` positions fits in it (else None: the step keeps its own)."""
        width_most = self.logits_width or max(self.max_graph_width, self.max_tree_width)
        vocab = self.head_weight.shape[0]
        if rows * width > self.cache.rows * width_most:
            return None
        return self.graphs.shared(self.cache.rows * width_most * vocab, self.head_weight.dtype)

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, kv_len: int, last: torch.Tensor | None = None,
             slots: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward rows [0, n) (tokens, positions [n, t]; every position < kv_len). Returns logits at every
        position [n, t, vocab] and the hidden states [n, t, d]; or, given `last` [n], each row's logits
        [n, vocab] and hidden state [n, d] at its position last[i]. Graph outputs: read them before the
        runner's next step (every static step writes its logits into one buffer). A token tree's step gives its cache
        `slots` and `mask` (specdec/spec/trees.py)."""
        return self._forward(tokens, positions, kv_len, last, slots, mask)

    def _forward(self, tokens, positions, kv_len, last=None, slots=None, mask=None, exact=False):
        n, t = tokens.shape
        kv_len = min(kv_len, self.cache.max_len)
        eager = partial(self._step, tokens, positions, last, kv_len=kv_len, slots=slots, mask=mask,
                        pieces=llama.EAGER)
        out = "tree" if mask is not None else "all" if last is None else "last"
        graphed = self.graphs is not None and t <= self._widest(out)
        if graphed:
            key = self.key(n, t, kv_len, out)
            key = rows, width, kv, _ = key if exact else self.cover(key)
            if mask is not None:
                inputs = _tree_inputs(rows, width, kv, tokens, positions, slots, mask)
            else:
                inputs = _padded(width, tokens, positions) + (() if last is None else (last,))

            def fast():
                few = self.fused is not None and rows * width <= fused.MAX_TOKENS
                into = self._shared_logits(rows, 1 if last is not None else width)
                step = partial(self._step, kv_len=kv, attend=True, pieces=self.fused if few else None, out=into)
                if mask is not None:  # a token tree: its slots and mask are inputs too
                    step = partial(_tree_step, step)
                logits, hidden = self.graphs.run(key, step, rows, *inputs)
                return (logits[:n], hidden[:n]) if last is not None else (logits[:n, :t], hidden[:n, :t])
        else:
            key = ("layer", n > 1, t > 1, mask is not None)  # the compiled layer's specializations
            fast = partial(self._step, tokens, positions, last, kv_len=kv_len, slots=slots, mask=mask)
        if not graphed and self.pieces is llama.EAGER:
            return eager()
        return self._checked(key, fast, eager, self._checks(graphed))

    def _checked(self, key: tuple, fast: Callable, eager: Callable, check: bool = True,
                 compared: Callable = itemgetter(0)):
        """fast() where `key`'s fast path stood for eager's at its first run (that run checked now, `_first`, unless
        `check` is off), eager() where it did not. `compared`: the logits (or hidden states) of a run's result."""
        if key in self.eager:
            return eager()
        if key in self.checked or not check:
            return fast()
        return self._first(key, fast, eager, compared)

    def key(self, n: int, t: int, kv_len: int, out: str) -> tuple[int, int, int, str]:
        """The captured step that serves a step of n rows x t tokens attending over kv_len slots whose `out` is
        "all" (logits at every position), "last" (each row's last) or "tree" (every position's, a token tree's
        step: its slots and mask are inputs): (rows, width, window, out), each padded to its bucket."""
        return (min(pow2_at_least(n), self.cache.rows), min(pow2_at_least(t), self._widest(out)),
                min(pow2_at_least(max(kv_len, self.min_kv_bucket)), self.cache.max_len), out)

    def _widest(self, out: str) -> int:
        """The widest step of outputs `out` (`key`) the static steps take; wider ones run eagerly."""
        return self.max_tree_width if out == "tree" else self.max_graph_width

    def cover(self, key: tuple[int, int, int, str]) -> tuple[int, int, int, str]:
        """The captured step to run a step of `key` through: `key` itself where it is captured, not `sealed`, or met
        more than COVER_STEPS times (then captured now); else the captured step of the fewest rows x tokens (then the
        shortest window) with as many rows, tokens and slots or more and the same outputs, where there is one.
        Padding is what buckets do: junk rows on free cache rows, junk columns past each row's tokens."""
        if not self.sealed or key in self.graphs.graphs or key in self.eager:
            return key
        self.met[key] = self.met.get(key, 0) + 1
        if self.met[key] > self.COVER_STEPS:
            return key
        rows, width, kv, out = key
        covers = [k for k in self.graphs.graphs if k[3] == out and k[0] >= rows and k[1] >= width and k[2] >= kv
                  and k not in self.eager]
        return min(covers, key=lambda k: (k[0] * k[1], k[2]), default=key)

    def capture(self, keys: list[tuple[int, int, int, str]], deadline: float) -> int:
        """Run now each step of `keys` ((rows, width, window, out), in order) that has not run on the fast path,
        over junk inputs, until `time.perf_counter()` passes `deadline`: captured on a GPU and checked against
        eager (what `step` runs, not a step of the job's), so that the rounds meet it ready. Its rows [0, rows)
        write slots 0 .. width - 1 of their cache rows (table rows a paged cache's rows do not own point at its
        scratch block): call it before rows join. Returns how many ran."""
        ran = 0
        for key in keys:
            if self.graphs is None or time.perf_counter() >= deadline:
                break
            if key in self.graphs.graphs or key in self.eager:
                continue
            rows, width, kv, out = key
            tokens = torch.zeros((rows, width), dtype=torch.int64, device=self.device)
            positions = torch.arange(width, device=self.device).expand(rows, width)
            last = torch.zeros(rows, dtype=torch.int64, device=self.device) if out == "last" else None
            causal = torch.arange(kv, device=self.device) <= positions[:, :, None] if out == "tree" else None
            self._forward(tokens, positions, kv, last, None if causal is None else positions,
                          None if causal is None else causal[:, None], exact=True)
            ran += 1
        return ran

    def warm_pieces(self) -> None:
        """Compile now, and check against eager, what prefills and joining rows meet of the compiled pieces (one row
        or more, several tokens): over junk tokens in cache rows [0, 2), before rows join (as `capture` writes)."""
        if not self._prefill_compiled:
            return
        for n in sorted({1, min(2, self.cache.rows)}):
            junk = torch.zeros((n, 2), dtype=torch.int64, device=self.device)
            self._extend(junk, 0, n, np.zeros(n, dtype=np.int64))

    def step_joined(self, tokens: torch.Tensor, positions: torch.Tensor, kv_len: int,
                    join: Join) -> tuple[torch.Tensor, torch.Tensor]:
        """A step over rows [0, n) as `step` (it may have none) and, in the same forward, the rows `join` names:
        each weight is read once for both (the lean path; the generic one runs the two forwards in turn). Returns
        the step's logits [n, t, vocab] and the joining rows' at the columns `join.at` [m, w, vocab]."""
        n, most = tokens.shape[0], self.cache.max_len
        parts = ([(tokens, positions, min(kv_len, most), 0)] if n else []) \
            + [(join.tokens, join.positions, min(join.kv_len, most), join.start)]
        if self.lean is not None:
            hidden = self._compiled(1, sum(t.numel() for t, _, _, _ in parts),
                                    lambda pieces: llama.forward_parts(self.lean, self.cache, parts, pieces))
        else:
            hidden = [forward_hidden(self.model, self.cache, t, p, start, start + t.shape[0], kv)
                      for t, p, kv, start in parts]
        step = self.logits(hidden[0]) if n else None
        return step, self.logits(hidden[-1].gather(1, join.at[:, :, None].expand(-1, -1, hidden[-1].shape[-1])))

    def _checks(self, graphed: bool) -> bool:
        """Whether a shape's first fast step is checked: where graphs are captured, the pieces compiled or fused
        (on CPU the static steps are otherwise the eager computation), or when a test injects a fault."""
        return (graphed and self.graphs.capture) or self.pieces is not llama.EAGER or self.fused is not None \
            or self.fault is not None

    def _first(self, key: tuple, fast, eager, compared: Callable = itemgetter(0)):
        """A shape's first fast step, checked against eager's (their `compared` parts); returns eager's result."""
        why = None
        try:
            mode = self.fault(key) if self.fault is not None else None
            if mode == "raise":
                raise RuntimeError("injected fault: capture failed")
            logits = compared(fast())
            if mode == "nan":
                logits = torch.full_like(logits, float("nan"))
        except Exception as exc:  # noqa: BLE001 - any failure of the fast path falls back, but memory is the caller's
            if "out of memory" in str(exc).lower():
                raise
            why = f"{type(exc).__name__}: {str(exc).strip()[:200]}"
        ref = eager()
        if why is None:
            want = compared(ref)
            self.errors[key] = relative_error(logits, want)
            why = verdict(self.errors[key], want.dtype)
        if why is None:
            self.checked.add(key)
        else:
            self.eager[key] = why
            if why not in _said:
                _said.add(why)
                log.warning("specbatch: the fast path failed for a step of shape %s (%s); that shape runs eagerly",
                            key, why)
        return ref

    def _step(self, tokens, positions, last=None, *, kv_len: int, slots=None, mask=None, pieces=None, attend=False,
              out=None):
        if self.lean is not None:
            hidden = llama.forward(self.lean, self.cache, tokens, positions, kv_len, pieces or self.pieces, slots,
                                   mask, attend=attend)
        else:
            hidden = forward_hidden(self.model, self.cache, tokens, positions, 0, tokens.shape[0], kv_len, slots, mask)
        if last is not None:
            hidden = hidden[torch.arange(tokens.shape[0], device=tokens.device), last]
        return (self.logits(hidden) if out is None else self.logits(hidden, out)), hidden


def _continued(x: torch.Tensor, width: int) -> torch.Tensor:
    """Positions or slots [n, t] continued to `width` columns, each row's next ones after its last."""
    t = x.shape[1]
    return x if width == t else torch.cat([x, x[:, -1:] + torch.arange(1, width - t + 1, device=x.device)], 1)


def _padded(width: int, tokens: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's tokens and positions [n, t] padded to `width` columns: junk columns after each row's last, at the
    next positions (slots no token reads yet)."""
    t = tokens.shape[1]
    return (tokens, positions) if width == t else (F.pad(tokens, (0, width - t)), _continued(positions, width))


def _tree_inputs(rows: int, width: int, kv: int, tokens, positions, slots, mask) -> tuple[torch.Tensor, ...]:
    """A token tree's step inputs (tokens, positions, slots [n, t], mask [n, 1, t, >= kv_len]) as a captured step of
    `rows` rows x `width` tokens over `kv` slots takes them: junk columns after each row's last node, at the next
    positions and slots, each seeing what the row's last node sees; junk rows at slot 0, seeing it alone (a query
    that saw nothing would write NaN into the free cache rows junk rows run on)."""
    n, t = tokens.shape
    tokens, positions = _padded(width, tokens, positions)
    mask = mask[..., :kv]
    if width > t:
        mask = torch.cat([mask, mask[:, :, -1:].expand(n, 1, width - t, mask.shape[-1])], 2)
    if kv > mask.shape[-1]:
        mask = F.pad(mask, (0, kv - mask.shape[-1]))
    parts = [tokens, positions, _continued(slots, width), mask]
    if rows > n:
        sees = torch.arange(kv, device=mask.device) == 0
        junk = [tokens.new_zeros((rows - n, width))] * 3 + [sees.expand(rows - n, 1, width, kv)]
        parts = [torch.cat([x, j]) for x, j in zip(parts, junk)]
    return tuple(parts)


def _tree_step(step: Callable, tokens, positions, slots, mask):
    """step(tokens, positions) of a token tree: writing at `slots`, under `mask`."""
    return step(tokens, positions, slots=slots, mask=mask)


def _rows(hidden: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
    """A forward's hidden states (a tensor, or one per window) as `_first` compares them."""
    return torch.cat([h.flatten(0, -2) for h in hidden]) if isinstance(hidden, list) else hidden


def relative_error(fast: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest relative error ||fast - ref|| / ||ref|| of a fast step's logits at a position against eager's
    (inf where fast's are not finite). One read of the device."""
    f, r = fast.float().flatten(0, -2), ref.float().flatten(0, -2)
    err = (f - r).norm(dim=-1) / r.norm(dim=-1).clamp_min(1e-6)
    return float(torch.where(torch.isfinite(f).all(-1), err, torch.inf).max())


def mismatch(fast: torch.Tensor, ref: torch.Tensor) -> str | None:
    """Why a fast step's logits cannot stand for eager's, or None when they can (`verdict` on `relative_error`)."""
    return verdict(relative_error(fast, ref), ref.dtype)


def verdict(worst: float, dtype: torch.dtype) -> str | None:
    """Why logits `worst` (`relative_error`) from eager's cannot stand for them, or None when they can:
    non-finite, or beyond tolerance (1e-3 in float32; 0.2 in 16-bit floats, where fused kernels round differently:
    a broken step is off by ~1)."""
    if worst == float("inf"):
        return "non-finite logits"
    tol = 1e-3 if dtype == torch.float32 else 0.2
    return f"logits differ from eager's by {worst:.3g} (relative; tolerance {tol})" if worst > tol else None
