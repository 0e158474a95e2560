"""Tiny random Llama models for engine tests (made in memory; nothing downloaded)."""

from __future__ import annotations

import copy
import itertools
import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec.config import SamplingParams, SpecConfig
from specdec.plan.costmodel import Profile
from specdec.engine import SpecEngine
from specdec.exec.models import ModelPair

MAX_NEW = 24  # new tokens per row in the engine tests (the `reference` fixture's length)
LOOKUP_NEW = 40  # and in prompt lookup's (the `greedy` fixture's, over the `repeating` prompts)

# SPECBATCH_TEST_DEVICE=cuda runs the engine tests on a GPU (CI has none: CPU by default)
DEVICE = os.environ.get("SPECBATCH_TEST_DEVICE", "cpu")


def tiny_llama(vocab: int = 96, layers: int = 2, seed: int = 0, init: float = 0.3) -> LlamaForCausalLM:
    # a large init range gives peaked next-token distributions, so greedy ties (which float noise
    # could flip between batched and unbatched runs) do not occur
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, initializer_range=init,
                      max_position_embeddings=512, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(cfg).to(DEVICE).eval().requires_grad_(False)


def smollm2_shape(seed: int = 0) -> LlamaForCausalLM:
    """Random weights at SmolLM2-135M-Instruct's shape (the demo's target: 30 layers, 576 wide, 9 heads over 3 KV
    heads, a 49k vocabulary, tied embeddings), float32, no stop token. Weights drawn 5x wider than transformers'
    default (0.02), where a row soon repeats one token for good (the tied head's self-product wins) and most of its
    tokens test little; here each token depends on the whole prompt, with clear top-2 gaps
    (bench/results/random_smollm2_shape_init_2026-11-28.txt)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True, rope_theta=100000.0,
                      max_position_embeddings=8192, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                      initializer_range=0.1)
    return LlamaForCausalLM(cfg).to(DEVICE).eval().requires_grad_(False)


def noisy_copy(model, scale: float, seed: int = 1):
    torch.manual_seed(seed)
    m = copy.deepcopy(model)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * scale * p.std())
    return m


def parting(model, prompt: list[int], want: list[int], got: list[int]) -> tuple[int, float | None, float] | None:
    """Where greedy tokens `got` part with transformers' `want` after `prompt` (None: equal): the first differing
    token and there, from `model`'s float32 logits after the prompt and `want`'s tokens before it, its token's logit
    minus ours (None where `got` ended first) and its top-2 gap: a near tie parts rows by rounding, a clear margin by
    a fault."""
    at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if at is None:
        if len(got) == len(want):
            return None
        at = min(len(got), len(want))
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + want[:at]], device=model.device)).logits[0, -1].float()
    top = logits.topk(2).values
    ours = (logits[want[at]] - logits[got[at]]).item() if at < min(len(want), len(got)) else None
    return at, ours, (top[0] - top[1]).item()


def pair(target, draft=None, stop=()) -> ModelPair:
    return ModelPair(target, draft, None, tuple(stop), target.config.vocab_size)


def flat_profile(max_width: int = 65) -> Profile:
    """Costs under which every draft length costs one plain round: drafting always pays."""
    return Profile(draft_one={1: 0.0}, draft_two={1: 0.0}, target={1: {w: 1.0 for w in range(1, max_width + 1)}})


def engine(target, draft, method="draft_model", bs=8, max_new=MAX_NEW, stop=(), prefix_caching=True,
           prefill_chunk: int | None = 2048, kv_cache: str = "dense", kv_block: int = 16, **spec) -> SpecEngine:
    """An engine with the job's default policy unless `spec` names another. goodput (the default) gets
    `flat_profile` and a clock that ticks once per round, so it drafts, the same way on any machine."""
    ticks = itertools.count()
    return SpecEngine(pair(target, draft, stop), SamplingParams(max_new_tokens=max_new),
                      SpecConfig(method=method, **spec), batch_size=bs, profile=flat_profile(),
                      clock=lambda: float(next(ticks)), prefix_caching=prefix_caching, prefill_chunk=prefill_chunk,
                      kv_cache=kv_cache, kv_block=kv_block)


def run(target, draft, prompts, method="draft_model", bs=8, k=None, max_new=MAX_NEW, stop=(), **spec):
    """generate() under the default policy (goodput: `engine`), or a fixed draft length k when k is given."""
    if k is not None:
        spec = {"num_draft_tokens": k, "draft_length": "fixed", **spec}
    return engine(target, draft, method, bs, max_new, stop, **spec).generate(prompts)


def check_stats(r):
    """A row's statistics agree with each other."""
    assert sum(r.accept_lengths) == r.accepted_tokens
    assert sum(r.draft_lengths) == r.drafted_tokens
    assert len(r.draft_lengths) == len(r.accept_lengths) == r.rounds
    assert all(0 <= a <= d for a, d in zip(r.accept_lengths, r.draft_lengths))
    assert r.generated_tokens <= r.accepted_tokens + r.rounds
    assert r.mean_accepted_length == pytest.approx(r.generated_tokens / r.rounds)
