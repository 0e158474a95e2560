"""`specbatch train-head`: train a SpecDec++ acceptance head for a job's draft/target pair.

The target answers the job's prompts; along each answer the draft samples a token per position
(teacher-forced on the target's tokens) and the label is min(1, p/q); the head learns P(accept) from
the draft's hidden state (by default the state that drew the token, plus q(token); `--reads fed`: the
state after the token was fed back, with token mixing, as in the paper) and the weighted BCE of
SpecDec++ (specdec/plan/head.py). The draft stays frozen. Writes head.safetensors + head.json (settings and the held-out report).
"""

from __future__ import annotations

import sys

import torch
from tqdm import tqdm

from specdec.config import SpecConfig
from specdec.engine import SpecEngine
from specdec.plan.head import HeadConfig, build_examples, train_head
from specdec.exec.models import load_pair
from workers.fetch import localize
from workers.inputs import iter_rows, render_prompt
from workers.storage import list_input_files

from .spec import ConfigError, JobSpec


def collect_prompts(spec: JobSpec, tokenizer, limit: int) -> list[list[int]]:
    prompts = []
    for f in list_input_files(spec.input.path):
        for row in iter_rows(f):
            try:
                prompts.append(render_prompt(row, tokenizer, spec.input))
            except ValueError:
                continue
            if len(prompts) >= limit:
                return prompts
    return prompts


def run_train_head(spec: JobSpec, out: str, max_prompts: int = 64, response_tokens: int = 128, epochs: int = 3,
                   layers: int = 3, threshold: float = 0.3, w_rej: float = 6.0, reads: str = "proposing",
                   seed: int = 0, progress: bool = True) -> dict:
    if spec.models.draft is None:
        raise ConfigError("train-head needs models.draft in the job config")
    t, d = spec.models.target, spec.models.draft
    pair = load_pair(localize(t), localize(d))
    prompts = collect_prompts(spec, pair.tokenizer, max_prompts)
    if not prompts:
        raise ConfigError(f"no usable prompts in {spec.input.path}")
    sp = spec.generation.model_copy(update={"max_new_tokens": min(spec.generation.max_new_tokens, response_tokens),
                                            "stop_token_ids": ()})
    print(f"specbatch train-head: the target answers {len(prompts)} prompts (up to {sp.max_new_tokens} tokens)...",
          file=sys.stderr)
    engine = SpecEngine(pair, sp, SpecConfig(method="none"), batch_size=spec.resources.batch_size)
    answers = engine.generate(prompts, keys=list(range(len(prompts))))
    gen = torch.Generator().manual_seed(seed)
    cfg = HeadConfig(hidden_size=pair.draft.config.hidden_size, num_layers=layers, threshold=threshold,
                     w_rej=w_rej, reads=reads)
    draft_vocab = spec.speculation.draft_vocab
    hs, ys = [], []
    for p, a in tqdm(list(zip(prompts, answers)), desc="labels", disable=not progress, file=sys.stderr):
        if a.token_ids:
            h, y = build_examples(pair.target, pair.draft, p, a.token_ids, sp, cfg, gen, pair.vocab_size,
                                  draft_vocab)
            hs.append(h)
            ys.append(y)
    h, y = torch.cat(hs), torch.cat(ys)
    bar = tqdm(total=epochs * ((len(y) * 9 // 10 + 255) // 256), desc="train", disable=not progress, file=sys.stderr)

    def tick(n, loss):
        bar.update(n)
        bar.set_postfix(loss=f"{loss:.3f}", refresh=False)

    head, report = train_head(h, y, cfg, epochs=epochs, seed=seed, progress=tick)
    bar.close()
    report["prompts"] = len(prompts)
    head.save(out, extra={"target": t.path, "draft": d.path, "draft_vocab": draft_vocab, "report": report})
    return report


def format_report(report: dict) -> str:
    lines = [f"examples: {report['train_examples']} train, {report['heldout_examples']} held out "
             f"(from {report['prompts']} prompts); held-out loss {report['heldout_loss']:.4f}; "
             f"mean label {report['heldout_mean_label']:.3f}, mean predicted {report['heldout_mean_predicted']:.3f}",
             f"ranking (held out): AUC {report['heldout_auc']:.3f}"
             + (f" (the draft's q(token) alone: {report['heldout_auc_q']:.3f})" if "heldout_auc_q" in report else ""),
             "calibration (held out):  bin       n   predicted  observed"]
    for c in report["calibration"]:
        lines.append(f"                         {c['bin']}  {c['n']:5d}   {c['predicted']:.3f}      {c['observed']:.3f}")
    return "\n".join(lines)
