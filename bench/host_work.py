"""Host work per round: what a round of the engine spends outside its models' forwards, against transformers'
plain forward at the same batch (the model call alone) and a step of its `generate`.

    python bench/host_work.py [--batch 64] [--max-new 64] [--prompt-len 16] [--repeats 3] [--threads 1]

A random Llama of 2 layers, 64 wide, a 32k vocabulary (`small32k`), float32, on a CPU with one thread by default:
its forward is cheap, so what a round does besides it shows. Each setting runs `--repeats` times after an untimed
run, in turn. The engine's round = (generate's wall time - its prefills) / rounds; its forwards are the time inside
the runners' `step` (the target's verification, and the draft's steps at k > 0); its scans, the time inside
`verify.scan` (the argmax and non-finite check over every verified or drafted position's logits: tensor work the
size of the vocabulary, which a GPU does in microseconds and one CPU thread in milliseconds); host work = round -
forwards - scans: the round's Python, its small tensors and its one read-back; each setting again with rounds
that wait for each other (`overlap=False`: on a CPU overlap gives nothing, and must cost nothing).
transformers: one decode step of `model(...)` with its cache, timed alone, and `generate`'s time per new token.
Medians over the repeats, in ms.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from step_speed import random_model  # noqa: E402

from specdec.config import SamplingParams, SpecConfig  # noqa: E402
from specdec.engine import SpecEngine  # noqa: E402
from specdec.exec.models import ModelPair  # noqa: E402
from specdec.exec.runner import ModelRunner  # noqa: E402
from specdec.sched import rounds  # noqa: E402
from specdec.spec import verify  # noqa: E402
from specdec.spec.proposers import draft_model  # noqa: E402


class Timer:
    """Seconds spent inside ModelRunner.step, .prefill and verify.scan (the bench wraps them)."""

    def __init__(self):
        self.step = self.prefill = self.scan = 0.0

    def wrap(self):
        step, prefill = ModelRunner.step, ModelRunner.prefill

        def timed_step(runner, *a, **kw):
            t = time.perf_counter()
            out = step(runner, *a, **kw)
            self.step += time.perf_counter() - t
            return out

        def timed_prefill(runner, *a, **kw):
            t = time.perf_counter()
            out = prefill(runner, *a, **kw)
            self.prefill += time.perf_counter() - t
            return out

        def timed_scan(logits):
            t = time.perf_counter()
            out = verify.scan(logits)
            self.scan += time.perf_counter() - t
            return out

        ModelRunner.step, ModelRunner.prefill = timed_step, timed_prefill
        rounds.scan = draft_model.scan = timed_scan  # the names the round and the drafter call


def engine_round(target, draft, k: int, prompts, max_new: int, timer: Timer,
                 overlap: bool = True) -> tuple[float, float, float]:
    """(ms per round, ms of it inside the models' steps, and in the scans) of one generate() at `len(prompts)`
    rows; `overlap=False`: rounds that wait for each other."""
    spec = SpecConfig(method="none") if k == 0 else SpecConfig(method="draft_model", draft_length="fixed",
                                                               num_draft_tokens=k)
    eng = SpecEngine(ModelPair(target, draft if k else None, None, (), target.config.vocab_size),
                     SamplingParams(max_new_tokens=max_new), spec, batch_size=len(prompts), prefix_caching=False,
                     overlap=overlap)
    eng.generate(prompts)  # untimed: allocation, first steps
    timer.step = timer.prefill = timer.scan = 0.0
    t = time.perf_counter()
    out = eng.generate(prompts)
    wall = time.perf_counter() - t
    rounds = max(r.rounds for r in out)
    return 1e3 * (wall - timer.prefill) / rounds, 1e3 * timer.step / rounds, 1e3 * timer.scan / rounds


def hf_step(model, prompts, max_new: int) -> tuple[float, float]:
    """(ms of one decode forward alone, ms per new token of generate) at `len(prompts)` rows."""
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True)
        cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        times = []
        for _ in range(max_new):
            t = time.perf_counter()
            out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - t)
            cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, pad_token_id=0,
                       attention_mask=torch.ones_like(ids))
        per_token = (time.perf_counter() - t) / max_new
    return 1e3 * statistics.median(times), 1e3 * per_token


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--ks", default="0,2", help="draft lengths (0: autoregressive; k > 0: a 1-layer draft)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = random_model("small32k", torch.device("cpu"), torch.float32)
    draft = random_model("small32k", torch.device("cpu"), torch.float32)
    draft.model.layers = draft.model.layers[:1]
    draft.config.num_hidden_layers = 1
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, target.config.vocab_size, (args.batch, args.prompt_len), generator=g).tolist()
    timer = Timer()
    timer.wrap()
    ks = [int(k) for k in args.ks.split(",")]
    runs: dict[str, list[tuple[float, ...]]] = {f"{kind}={k}": [] for k in ks for kind in ("k", "serial")}
    runs["hf"] = []
    hf_step(target, prompts, 4)  # warm
    for _ in range(args.repeats):
        for k in ks:
            runs[f"k={k}"].append(engine_round(target, draft, k, prompts, args.max_new, timer))
            runs[f"serial={k}"].append(engine_round(target, draft, k, prompts, args.max_new, timer, overlap=False))
        runs["hf"].append(hf_step(target, prompts, args.max_new))
    med = {name: tuple(statistics.median(r[i] for r in rs) for i in range(len(rs[0]))) for name, rs in runs.items()}
    hf_forward, hf_generate = med["hf"]
    print(f"# small32k (2 layers, 64 wide, 32k vocabulary), float32, CPU, {torch.get_num_threads()} thread(s); "
          f"batch {args.batch}, {args.prompt_len}-token prompts, {args.max_new} new tokens; medians of "
          f"{args.repeats}, ms")
    print(f"transformers: forward alone {hf_forward:.2f}, generate per step {hf_generate:.2f}")
    print("engine                         | round | models' steps | scans | host work | host work / transformers' "
          "forward | round / transformers' forward")
    for key in [f"{kind}={k}" for k in ks for kind in ("k", "serial")]:
        round_ms, steps_ms, scan_ms = med[key]
        host = round_ms - steps_ms - scan_ms
        k = int(key.split("=")[1])
        name = "autoregressive" if k == 0 else f"draft model, fixed k={k}"
        print(f"{name + (', rounds not overlapped' if key.startswith('serial') else ''):30s} | {round_ms:5.2f} | "
              f"{steps_ms:13.2f} | {scan_ms:5.2f} | {host:9.2f} | {host / hf_forward:.2f} | "
              f"{round_ms / hf_forward:.2f}")


if __name__ == "__main__":
    main()
