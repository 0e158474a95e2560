"""Calibrating FSD's threshold for a pair and a set of prompts (Holsman et al.'s protocol).

A divergence threshold means nothing across pairs and data: the paper calibrates it per pair and data
set. `calibrate` does so on a sample of prompts:
1. the target answers them (its lossless output); along each answer both models are teacher-forced, so
   every position gives Div(p, q) of their raw distributions (as FSD's rule reads them) and the
   lossless rule's chance of accepting the draft's token there (greedy: argmax q = argmax p; sampling:
   sum min(p, q) of the processed distributions);
2. the best length K for that acceptance from the engine's measured costs (specdec/plan/costmodel.py);
3. the matched threshold T0: the one under which the divergence rule alone accepts as many tokens as
   the lossless rule does (the acceptance-rate quantile of the divergences); then thresholds stepping
   up, each accepting `step` more of the tokens;
4. each threshold runs through the engine at K (fuzzy verification), giving a speed-quality point:
   tokens per target call, acceptance, the cost model's predicted speed-up over plain decoding and
   tokens/s measured over the lossless point's (one run each: noisy on a shared machine), rows identical to the lossless output, and the target's mean log-probability
   per token of what was generated.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from ..spec import sampling
from ..config import SamplingParams, SpecConfig
from .costmodel import best_length, bucket, expected_tokens
from ..engine import SpecEngine
from ..spec.verify import divergence


@dataclass
class Point:
    threshold: float | None  # None: lossless
    per_call: float  # tokens per target call
    accept: float  # drafted tokens accepted
    predicted: float  # the cost model's tokens/s over plain decoding's
    tok_s: float  # measured tokens/s over the lossless point's
    same: float  # rows identical to the lossless output
    loglik: float  # the target's mean log-probability per generated token


@torch.inference_mode()
def teacher_forced(pair, prompts: list[list[int]], answers: list[list[int]], sp: SamplingParams, kind: str,
                   draft_vocab: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per answer token: Div(p, q) of the raw distributions, the lossless rule's acceptance chance, and the
    target's log-probability of the token."""
    divs, accepts, lls = [], [], []
    vocab = pair.vocab_size
    dv = min(draft_vocab or vocab, vocab)
    for prompt, out in zip(prompts, answers):
        if not out:
            continue
        ids = torch.tensor([prompt + out], device=pair.device)
        at = slice(len(prompt) - 1, len(prompt) - 1 + len(out))
        lp = pair.target(input_ids=ids).logits[0, at, :vocab].float()
        lq = pair.draft(input_ids=ids).logits[0, at, :dv].float()
        lq = torch.nn.functional.pad(lq, (0, vocab - dv), value=float("-inf"))
        divs.append(divergence(torch.softmax(lp, -1), torch.softmax(lq, -1), kind))
        if sp.greedy:
            accepts.append((lp.argmax(-1) == lq.argmax(-1)).float())
        else:
            rows = sampling.Rows.of(sp, lp.device)
            accepts.append(torch.minimum(sampling.probs(lp, rows), sampling.probs(lq, rows)).sum(-1))
        lls.append(torch.log_softmax(lp, -1).gather(1, torch.tensor(out, device=pair.device)[:, None])[:, 0])
    return tuple(torch.cat(x).double().cpu().numpy() for x in (divs, accepts, lls))


def thresholds(divs: np.ndarray, accept_rate: float, steps: int = 4, step: float = 0.05) -> list[float]:
    """T0, under which Div <= T accepts the lossless rule's share of tokens, then `steps` thresholds each
    accepting `step` more of them (capped below all)."""
    shares = [min(accept_rate + i * step, 0.99) for i in range(steps + 1)]
    return sorted({float(np.quantile(divs, s)) for s in shares})


def calibrate(pair, prompts: list[list[int]], sp: SamplingParams, spec: SpecConfig, batch_size: int,
              steps: int = 4, step: float = 0.05, log=print) -> tuple[int, list[Point]]:
    """The protocol above; returns the length K and the lossless point followed by the fuzzy ones."""
    kind = (spec.fuzzy.divergence if spec.fuzzy else "js")
    def variant(**update) -> SpecConfig:  # the job's speculation settings, validated with these changed
        return SpecConfig(**{**spec.model_dump(), "method": "draft_model", "verification": "lossless", "fuzzy": None,
                             "conditional": None, **update})

    lossless = SpecEngine(pair, sp, SpecConfig(method="none"), batch_size=batch_size).generate(prompts)
    answers = [r.token_ids for r in lossless]
    divs, accepts, _ = teacher_forced(pair, prompts, answers, sp, kind, spec.draft_vocab)
    rate = float(accepts.mean())
    probe = SpecEngine(pair, sp, variant(draft_length="goodput"), batch_size=batch_size)
    probe.measure_costs()
    b, max_k = bucket(min(batch_size, len(prompts))), spec.max_draft_tokens
    seconds = probe.profile.rounds(b, max_k)
    k = max(1, best_length(expected_tokens(np.array([rate]), max_k)[0], seconds))
    log(f"lossless acceptance {rate:.3f} over {len(divs)} tokens; best length K={k} "
        f"(the cost model's; {best_length(expected_tokens(np.array([rate]), max_k)[0], seconds)} before the 1-token floor)")

    def point(threshold: float | None) -> Point:
        update = {"draft_length": "fixed", "num_draft_tokens": k}
        if threshold is not None:
            update.update(verification="fuzzy", fuzzy={"divergence": kind, "threshold": threshold})
        eng = SpecEngine(pair, sp, variant(**update), batch_size=batch_size)
        t = time.perf_counter()
        res = eng.generate(prompts)
        wall = time.perf_counter() - t
        gen = sum(r.generated_tokens for r in res)
        calls = sum(r.rounds for r in res)
        drafted = sum(r.drafted_tokens for r in res)
        acc = sum(r.accepted_tokens for r in res) / max(drafted, 1)
        ll = teacher_forced(pair, prompts, [r.token_ids for r in res], sp, kind, spec.draft_vocab)[2]
        predicted = (gen / calls) / seconds[k] * seconds[0]
        same = sum(r.token_ids == a for r, a in zip(res, answers)) / len(res)
        return Point(threshold, gen / calls, acc, float(predicted), gen / wall, same, float(ll.mean()))

    point(None)  # untimed: the first speculative engine pays the warm-up
    points = [point(None)] + [point(t) for t in thresholds(divs, rate, steps, step)]
    for p in points[1:]:
        p.tok_s /= points[0].tok_s
    points[0].tok_s = 1.0
    return k, points


def format_points(k: int, points: list[Point]) -> str:
    lines = [f"{'threshold':>10s} {'tok/call':>8s} {'accept':>6s} {'predicted':>9s} {'measured':>8s} {'=lossless':>9s} "
             f"{'loglik':>7s}   (K={k}; predicted: over plain decoding; measured: over lossless)"]
    for p in points:
        name = "lossless" if p.threshold is None else f"{p.threshold:.4g}"
        lines.append(f"{name:>10s} {p.per_call:8.2f} {p.accept:6.2f} {p.predicted:9.2f} {p.tok_s:8.2f} {p.same:9.2f} "
                     f"{p.loglik:7.3f}")
    return "\n".join(lines)
