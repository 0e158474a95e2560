"""Attention over a paged KV cache against the engine's dense per-row views, one layer of a model's shape.

    python bench/paged_attention.py [--device cpu] [--shapes smollm2] [--batches 1,8,32] [--kv 320,1088]
        [--queries 1,3] [--page 128] [--mixed] [--paths gather,engine,engine128,flex] [--flex static|dynamic]
        [--deadline 0] [--out FILE]

Per (batch, longest row, queries per row):
- `dense`: SDPA over the engine's layout, `[rows, kv_heads, max_len, head_dim]` sliced to the longest row, a
  boolean mask (specdec/exec/cache.py; what every step does now);
- `gather`: SDPA over the rows' blocks gathered from a pool `[kv_heads, slots, head_dim]` by their block tables
  (index_select, then the same mask): a copy of every row's keys and values per layer per step;
- `engine`: what the engine's captured steps run with `paged_attention="flex"`: its `PagedKVCache` (blocks of 16
  slots anywhere in the pool; `engineB`: of B slots) and `_FlexView` (compiled FlexAttention over the pool in place,
  its mask built as the device's kernel wants it: on CUDA for the case's rows, on a CPU its queries padded to the
  cache's rows, as many as the largest of `--batches`), one pool for every case of a `--kv`, so a compilation per
  queries' width (and on CUDA per rows); `P mask`: building its block mask (once a step, for every layer);
- `flex`: FlexAttention over the pool through torch's PagedAttention (pages of `--page` slots, page tables turned
  into a block mask, compiled; blocks past a row's length are skipped): `--flex static` compiles each case's shapes
  anew, `--flex dynamic` once for every case (dynamic shapes; where that fails, the case says why and later cases
  compile static).
`compile s`: each compiled path's first call, compilation included. Every path's output is checked against dense's
first. Rows hold the longest row's tokens, or with `--mixed` lengths drawn uniformly from [longest / 20, longest]
(dense still attends up to the longest, masked). Prints ms per layer call and each path's ratio to dense; a path
that fails prints why. `--deadline`: seconds after which no new case starts (0: none).
"""

from __future__ import annotations

import argparse
import random
import time

import torch
import torch.nn.functional as F

SHAPES = {  # (query heads, kv heads, head_dim)
    "smollm2": (9, 3, 64),
    "llama8b": (32, 8, 128),
    "tiny": (4, 2, 16),
}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str, repeats: int) -> float:
    """Mean ms of `repeats` calls after three warm ones."""
    for _ in range(3):
        fn()
    sync(device)
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync(device)
    return (time.perf_counter() - t) / repeats * 1e3


def case(shape: str, n: int, longest: int, t: int, page: int, mixed: bool, device: str, dtype, repeats: int,
         paths: tuple[str, ...], cache_rows: int, dynamic: bool = False):
    from specdec.exec.cache import BLOCK

    qh, kvh, hd = SHAPES[shape]
    rng = random.Random(n * 7919 + longest)
    lens = [longest if not mixed else rng.randint(max(t, longest // 20), longest) for _ in range(n)]
    room, longest = longest, max(lens)  # dense attends up to the batch's longest row
    max_len = -(-longest // page) * page + page
    lens_t = torch.tensor(lens, device=device)
    q = torch.randn(n, qh, t, hd, device=device, dtype=dtype)
    # query j of row b sits at position lens[b] - t + j and sees slots up to it
    slot = torch.arange(longest, device=device)
    mask = (slot[None, None, :] <= (lens_t[:, None, None] - t + torch.arange(t, device=device)[None, :, None]))[:, None]
    dense = [torch.randn(n, kvh, max_len, hd, device=device, dtype=dtype) for _ in range(2)]

    def attend():
        return F.scaled_dot_product_attention(q, dense[0][:, :, :longest], dense[1][:, :, :longest], attn_mask=mask,
                                              enable_gqa=True)

    out = {"dense": timed(attend, device, repeats), "compile": {}, "mask": {}}
    want = attend()
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    for p in paths:
        if p.startswith("engine"):
            try:
                out[p], out["mask"][p], out["compile"][p] = engine(q, dense, lens_t, longest, room, cache_rows,
                                                                   int(p[6:] or BLOCK), want, tol, device, repeats)
            except Exception as exc:  # noqa: BLE001 - a path that cannot run is a result
                out[p] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    pages_of = [-(-n_tok // page) for n_tok in lens]
    n_pages = sum(pages_of) + 1
    perm = torch.randperm(n_pages, generator=torch.Generator().manual_seed(n)).tolist()  # blocks anywhere
    table = torch.zeros(n, max(pages_of), dtype=torch.long)
    at = 0
    for b, m in enumerate(pages_of):
        table[b, :m] = torch.tensor(perm[at:at + m])
        at += m
    pool = [torch.zeros(kvh, n_pages * page, hd, device=device, dtype=dtype) for _ in range(2)]
    slots = (table[:, :, None] * page + torch.arange(page)).reshape(n, -1)[:, :longest]
    for b, m in enumerate(lens):  # the pool holds what the dense rows hold, in each row's blocks
        for p, d in zip(pool, dense):
            p[:, slots[b, :m].to(device)] = d[b, :, :m]
    dense.clear()  # the dense rows freed, now in the pool (attend is not called again)
    flat = slots.reshape(-1).clamp(max=n_pages * page - 1).to(device)

    def gather():
        k = pool[0].index_select(1, flat).view(kvh, n, longest, hd).transpose(0, 1)
        v = pool[1].index_select(1, flat).view(kvh, n, longest, hd).transpose(0, 1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    if "gather" in paths:
        assert torch.allclose(gather(), want, **tol), "gathered blocks attend otherwise than the dense rows"
        out["gather"] = timed(gather, device, repeats)
    if "flex" in paths:
        try:
            fn = flex(q, pool, table, lens_t, pages_of, page, max_len, n_pages, device, dynamic)
            t0 = time.perf_counter()
            first = fn()
            sync(device)
            out["compile"]["flex"] = time.perf_counter() - t0
            assert torch.allclose(first, want, **tol), "FlexAttention over pages attends otherwise than the dense rows"
            out["flex"] = timed(fn, device, repeats)
        except Exception as exc:  # noqa: BLE001 - a path that cannot run is a result
            out["flex"] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    return lens, out


_POOLS: dict = {}  # the engine paths' caches, one per (shape, rows, room, block): their compilations carry over


def engine(q, dense, lens_t, longest, room, rows, block, want, tol, device, repeats):
    """The engine's FlexAttention over its paged cache (`_FlexView`) of `block`-slot blocks: ms per layer call, ms
    to build the step's block mask, and the first call's seconds. The cache holds `rows` rows of up to `room` slots
    (a block's more); the case's rows
    take its first table rows, their blocks drawn in a shuffled order, and hold what the dense rows hold."""
    from types import SimpleNamespace

    from specdec.exec.cache import PagedKVCache, blocks_for
    from specdec.exec.graphs import compiled_flex

    n, heads, t, hd = q.shape
    kv_heads = dense[0].shape[1]
    key = (heads, kv_heads, hd, rows, room, block)
    if key not in _POOLS:
        config = SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hd,
                                 hidden_size=heads * hd, num_hidden_layers=1)
        model = SimpleNamespace(config=config, parameters=lambda: iter([q]))  # shapes, dtype and device: all it reads
        cache = _POOLS[key] = PagedKVCache(model, rows, room + block, rows * blocks_for(room + block, block) + 1,
                                           block)
        cache.flex = compiled_flex()
    cache = _POOLS[key]
    for row in range(rows):
        cache.release(row)
    random.Random(n).shuffle(cache.free)
    lens = lens_t.tolist()
    cache.reserve_rows(list(range(n)), lens)
    for b, m in enumerate(lens):
        at = cache.physical(cache.table[b:b + 1], torch.arange(m, device=q.device)[None])[0]
        cache.k[0][at], cache.v[0][at] = dense[0][b, :, :m].transpose(0, 1), dense[1][b, :, :m].transpose(0, 1)
    positions = lens_t[:, None] - t + torch.arange(t, device=q.device)
    view = cache.view(0, n, positions, longest, attend=True)
    t0 = time.perf_counter()
    first = view.attend(0, q)
    sync(device)
    seconds = time.perf_counter() - t0
    assert torch.allclose(first, want.transpose(1, 2).reshape(n, t, heads * hd), **tol), \
        "the engine's FlexAttention attends otherwise than the dense rows"
    mask = timed(lambda: cache.view(0, n, positions, longest, attend=True), device, repeats)
    return timed(lambda: view.attend(0, q), device, repeats), mask, seconds


_DYNAMIC: dict = {}  # flex_attention compiled with dynamic shapes, once (--flex dynamic)


def flex(q, pool, table, lens_t, pages_of, page, max_len, n_pages, device, dynamic: bool = False):
    """FlexAttention of `q` over the rows' pages, compiled (a callable). The block mask's query blocks are 128
    tokens (one partial block per row): inductor's CUDA kernels take only configs whose BLOCK_M (16 and up) divides
    the query block size, so a block of 1 or 3 queries left them none ("NoValidChoicesError: No choices to select",
    the H200, 2026-11-27); its CPU kernel has no such rule."""
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from specdec.exec.graphs import _many_compilations

    n, t = q.shape[0], q.shape[2]
    paged = PagedAttention(n_pages, page, n, device=device)
    paged.page_table[:n, : table.shape[1]] = torch.where(
        torch.arange(table.shape[1])[None, :] < torch.tensor(pages_of)[:, None], table, -1).to(device)
    paged.capacity[:n] = torch.tensor(pages_of, device=device) * page
    for b, m in enumerate(pages_of):
        paged.physical_to_logical[b, table[b, :m].to(device)] = torch.arange(m, device=device)

    def causal(b, h, qi, ki):
        return ki <= lens_t[b] - t + qi

    logical = create_block_mask(causal, n, None, t, max_len, device=device, BLOCK_SIZE=(128, page))
    physical = paged.convert_logical_block_mask(logical)  # its mask_mod reads the page tables too
    if dynamic:
        if "run" not in _DYNAMIC:
            _DYNAMIC["run"] = torch.compile(flex_attention, dynamic=True)
        run = _DYNAMIC["run"]
    else:
        _many_compilations()  # a compile per case's shapes: torch's limit of 8 would send the ninth to eager
        run = torch.compile(flex_attention, dynamic=False)
    k, v = (p[None] for p in pool)  # [1, kv_heads, slots, head_dim]: one shared sequence of pages
    return lambda: run(q, k, v, block_mask=physical, enable_gqa=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", default="smollm2")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--kv", default="320,1088", help="the longest row's tokens")
    ap.add_argument("--queries", default="1,3", help="query tokens per row: 1 a decode step, k + 1 a verify")
    ap.add_argument("--page", type=int, default=128)
    ap.add_argument("--mixed", action="store_true")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--paths", default="gather,engine,flex",
                    help="what to set beside dense: gather, engine (engineB: blocks of B slots), flex")
    ap.add_argument("--flex", choices=("static", "dynamic"), default="static")
    ap.add_argument("--deadline", type=float, default=0)
    ap.add_argument("--out")
    args = ap.parse_args()
    paths = tuple(args.paths.split(","))
    engines = [p for p in paths if p.startswith("engine")]
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    t0 = time.perf_counter()
    lines = [f"# {args.device} {torch.cuda.get_device_name() if args.device.startswith('cuda') else ''} {dtype}, "
             f"torch {torch.__version__}, threads {torch.get_num_threads()}, page {args.page}, "
             f"{'mixed lengths' if args.mixed else 'every row the longest'}, flex {args.flex}; ms per layer call, "
             f"ratio to dense",
             f"{'shape':8s} {'rows':>4s} {'kv':>5s} {'q':>2s} {'mean kv':>7s} {'dense':>8s} "
             + " ".join(f"{p:>15s}" for p in paths) + "".join(f" {p + ' mask':>11s}" for p in engines)
             + "".join(f" {p + ' s':>10s}" for p in paths if p != "gather")]
    lines[0] += " (`P mask`: ms to build engine path P's block mask, once a step; `P s`: path P's first call)"
    dynamic = args.flex == "dynamic"
    cache_rows = max(map(int, args.batches.split(",")))
    print("\n".join(lines), flush=True)
    for shape in args.shapes.split(","):
        for t in map(int, args.queries.split(",")):  # widths outermost: the engine compiles once per width
            for n in map(int, args.batches.split(",")):
                for kv in map(int, args.kv.split(",")):
                    if args.deadline and time.perf_counter() - t0 > args.deadline:
                        lines.append(f"# deadline: {shape} {n} {kv} {t} and after not run")
                        print(lines[-1], flush=True)
                        break
                    lens, out = case(shape, n, kv, t, args.page, args.mixed, args.device, dtype, args.repeats,
                                     paths, cache_rows, dynamic)
                    d = out["dense"]
                    cells = [f"{out[p]:7.3f} {out[p] / d:6.2f}x" if isinstance(out[p], float) else out[p]
                             for p in paths]
                    lines.append(f"{shape:8s} {n:4d} {kv:5d} {t:2d} {sum(lens) / n:7.0f} {d:8.3f} "
                                 + " ".join(f"{c:>15s}" for c in cells)
                                 + "".join(f" {out['mask'].get(p, float('nan')):11.3f}" for p in engines)
                                 + "".join(f" {out['compile'].get(p, float('nan')):10.1f}" for p in paths
                                           if p != "gather"))
                    print(lines[-1], flush=True)
                    if dynamic and not isinstance(out.get("flex", 0.0), float):
                        dynamic = False
                        lines.append("# flex with dynamic shapes failed: later cases compile static")
                        print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
