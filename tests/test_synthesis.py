"""Dataset synthesis in the engine: output formats (llguidance grammars) lossless under speculation, n samples
per prompt sharing one prefill, and logprobs equal to the target's own (tiny byte-level models, float32)."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from engine_models import flat_profile, noisy_copy, tiny_llama
from specdec.spec import sampling
from specdec.config import SamplingParams, SpecConfig
from specdec.engine import SpecEngine
from specdec.spec.grammar import Grammars
from specdec.exec.models import ModelPair
from test_sampling import noise_bound, tv

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0,
                                                                             "maximum": 99},
                         "ok": {"type": "boolean"}}}
FORMATS = {
    "person": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
    "object": {"type": "json_object"},
    "date": {"type": "regex", "regex": r"20[0-9]{2}-(0[1-9]|1[0-2])"},
    "color": {"type": "choice", "choice": ["red", "green", "blue"]},
}
NEW = 48


def bpe_tokenizer():
    """A byte-level BPE tokenizer (what real models use: any text, JSON included, has a tokenization)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ['{"name": "Ada", "age": 36, "ok": true}', '{"a": [1, 2], "b": null}', "red green blue 2024-05",
            "the quick brown fox jumps over the lazy dog"] * 20
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def bpe_models(root) -> dict[str, str]:
    """{'target', 'draft'}: HF folders under `root` of tiny Llamas over `bpe_tokenizer` with a chat template."""
    from conftest import make_model

    out = {}
    for name, layers, seed in (("target", 2, 3), ("draft", 1, 4)):
        folder = str(root / name)
        tok = bpe_tokenizer()
        tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} </s> {% endfor %}"
                             "{% if add_generation_prompt %}<|assistant|>{% endif %}")
        tok.save_pretrained(folder)
        make_model(folder, len(tok), layers, seed, tok.eos_token_id)
        out[name] = folder
    return out


@pytest.fixture(scope="module")
def bpe():
    tok = bpe_tokenizer()
    target = tiny_llama(vocab=len(tok), seed=4)
    return tok, target, noisy_copy(target, 0.05)


@pytest.fixture(scope="module")
def prompts(bpe):
    tok = bpe[0]
    return [tok.encode(t) for t in ("Describe a person:", "A color", "The date", "red", "{")]


def engine(bpe, method="draft_model", k=None, bs=4, graphs=None, **spec) -> SpecEngine:
    tok, target, draft = bpe
    pair = ModelPair(target, draft if method == "draft_model" else None, tok, (tok.eos_token_id,), len(tok))
    if k is not None:
        spec = {"draft_length": "fixed", "num_draft_tokens": k, **spec}
    # goodput on a clock that ticks per round: it drafts
    return SpecEngine(pair, SamplingParams(max_new_tokens=NEW), SpecConfig(method=method, **spec), batch_size=bs,
                      profile=flat_profile(), clock=iter(range(1 << 30)).__next__, step_graphs=graphs)


class GrammarMask(LogitsProcessor):
    """transformers' side of constrained decoding: the grammar's mask on the scores, advanced by each new token."""

    def __init__(self, matcher, start: int, vocab: int):
        self.m, self.seen, self.vocab = matcher, start, vocab

    def allowed(self) -> torch.Tensor:
        bits = np.unpackbits(np.frombuffer(self.m.compute_bitmask(), dtype=np.uint8), bitorder="little")
        return torch.from_numpy(bits[: self.vocab].astype(bool))

    def __call__(self, input_ids, scores):
        new = input_ids[0, self.seen:].tolist()
        self.seen = input_ids.shape[1]
        assert self.m.consume_tokens(new)
        return scores.masked_fill(~self.allowed(), float("-inf"))


def constrained_greedy(bpe, prompt: list[int], fmt: dict | None) -> list[int]:
    """Constrained autoregressive decoding by transformers' own generate (no speculation, no specbatch code but
    llguidance's matcher)."""
    tok, target, _ = bpe
    procs = []
    if fmt is not None:
        m = Grammars(tok, len(tok), (tok.eos_token_id,)).matcher(SamplingParams(response_format=fmt).grammar)
        procs = [GrammarMask(m, len(prompt), len(tok))]
    out = target.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.eos_token_id, logits_processor=LogitsProcessorList(procs))
    return out[0, len(prompt):].tolist()


def check_format(text: str, fmt: dict) -> None:
    if fmt["type"] == "json_schema":
        jsonschema.validate(json.loads(text), fmt["json_schema"]["schema"])
    elif fmt["type"] == "json_object":
        assert isinstance(json.loads(text), dict)
    elif fmt["type"] == "regex":
        import re
        assert re.fullmatch(fmt["regex"], text)
    else:
        assert text in fmt["choice"]


@pytest.mark.parametrize("method,k,spec", [
    ("none", None, {}), ("draft_model", None, {}), ("draft_model", 3, {}), ("prompt_lookup", None, {}),
    ("prompt_lookup", 4, {"prompt_lookup": {"alignment_sampling": 2}}),
    ("prompt_lookup", 4, {"prompt_lookup": {"alignment_sampling": 2}, "graphs": True}),  # trees' static steps
], ids=["plain", "draft-default", "draft-k3", "lookup", "lookup-trees", "lookup-trees-static"])
def test_constrained_speculation_equals_constrained_autoregressive(bpe, prompts, method, k, spec):
    """Every format, with unconstrained rows in the same batch: token for token what transformers' constrained
    greedy decoding gives, every finished output follows its format, and forced tokens cost no target call under
    every method (plain decoding's tokens per call are 1 + its forced share)."""
    tok = bpe[0]
    rows = [(p, name) for p in prompts for name in (*FORMATS, None)]
    params = [SamplingParams(max_new_tokens=NEW, response_format=FORMATS[name] if name else None) for _, name in rows]
    eng = engine(bpe, method, k, **spec)
    results = eng.generate([p for p, _ in rows], params=params)
    if spec.get("graphs"):  # the trees went through the static steps
        assert any(key[3] == "tree" for key in eng.runner("target").graphs.graphs)
    for (p, name), r in zip(rows, results):
        assert r.error is None
        assert r.token_ids == constrained_greedy(bpe, p, FORMATS.get(name)), (name, tok.decode(p))
        if name is not None and r.finish_reason == "stop":
            check_format(tok.decode(r.token_ids, skip_special_tokens=True), FORMATS[name])
        if name is None:
            assert r.forced_tokens == 0
        if method == "none" and r.generated_tokens:  # one token per target call, and the forced ones free
            assert r.rounds == r.generated_tokens - r.forced_tokens
    stopped = [r for (_, name), r in zip(rows, results) if name and r.finish_reason == "stop"]
    assert len(stopped) >= len(prompts) * 3  # the formats were completed, not just cut at max_new_tokens
    # keys, punctuation, closing brackets: emitted without a model call
    assert sum(r.forced_tokens for (_, name), r in zip(rows, results) if name == "person") >= 8 * len(prompts)


def exact_constrained(bpe, prompt: list[int], fmt: dict, sp: SamplingParams) -> dict[tuple, float]:
    """P(output) of every output the format allows, from the target's processed, masked conditionals."""
    tok, target, _ = bpe
    grammars = Grammars(tok, len(tok), (tok.eos_token_id,))
    out = {}

    def walk(prefix: list[int], p: float, m) -> None:
        with torch.no_grad():
            logits = target(torch.tensor([prompt + prefix])).logits[0, -1]
        allowed = GrammarMask(m, 0, len(tok)).allowed()
        probs = sampling.probs(logits.masked_fill(~allowed, float("-inf")), sampling.Rows.of(sp)).double()
        for t in torch.nonzero(probs > 0).flatten().tolist():
            if t == tok.eos_token_id:
                out[tuple(prefix + [t])] = p * float(probs[t])
                continue
            m.consume_token(t)
            walk(prefix + [t], p * float(probs[t]), m)
            m.rollback(1)

    walk([], 1.0, grammars.matcher(SamplingParams(response_format=fmt).grammar))
    return out


@pytest.mark.parametrize("method", ["draft_model", "prompt_lookup"])
def test_sampled_constrained_rows_keep_the_constrained_target_distribution(bpe, method):
    tok = bpe[0]
    n, fmt, prompt = 3000, FORMATS["color"], tok.encode("red green")
    sp = SamplingParams(max_new_tokens=NEW, temperature=1.0, seed=9, response_format=fmt)
    exact = exact_constrained(bpe, prompt, fmt, sp)
    results = engine(bpe, method, 2, bs=256).generate([prompt] * n, keys=[f"r{i}" for i in range(n)],
                                                      params=[sp] * n)
    outputs = sorted(exact)
    counts = np.array([sum(tuple(r.token_ids) == o for r in results) for o in outputs], dtype=float)
    assert counts.sum() == n  # every output is one the format allows
    p = np.array([exact[o] for o in outputs])
    assert len(outputs) >= 3 and tv(counts / n, p) <= noise_bound(p, n)


def test_an_output_format_the_engine_cannot_compile_is_that_rows_error(bpe, prompts):
    bad = {"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}}
    params = [SamplingParams(max_new_tokens=8, response_format=bad), SamplingParams(max_new_tokens=8),
              SamplingParams(max_new_tokens=8, response_format={"type": "regex", "regex": "[0-9"})]
    results = engine(bpe).generate(prompts[:3], params=params)
    assert results[0].finish_reason == "error" and results[0].error.startswith("bad_response_format:")
    assert "nope" in results[0].error
    assert results[1].error is None and results[1].generated_tokens == 8
    assert results[2].error.startswith("bad_response_format:")


def test_a_vocabulary_of_whole_mask_words_is_constrained(bpe, prompts):
    """Real models' vocabularies are often a multiple of 32 (SmolLM2: 49152), where llguidance's bitmask has one
    word more than the vocabulary needs: the masks still fit and the output follows the format."""
    tok = bpe[0]
    vocab = 32 * (len(tok) // 32 + 1)
    target = tiny_llama(vocab=vocab, seed=4)
    pair = ModelPair(target, noisy_copy(target, 0.05), tok, (tok.eos_token_id,), vocab)
    for method in ("draft_model", "prompt_lookup"):
        eng = SpecEngine(pair, SamplingParams(max_new_tokens=NEW), SpecConfig(method=method), batch_size=4,
                         profile=flat_profile(), clock=iter(range(1 << 30)).__next__)
        fmts = [FORMATS["person"], FORMATS["date"], FORMATS["color"]]
        results = eng.generate(prompts[:3], params=[SamplingParams(max_new_tokens=NEW, response_format=f)
                                                    for f in fmts])
        for r, fmt in zip(results, fmts):
            assert r.error is None and r.finish_reason == "stop", (method, r.error)
            check_format(tok.decode(r.token_ids, skip_special_tokens=True), fmt)


def test_n_samples_share_a_prefill_and_are_distinct_reproducible_draws(bpe, prompts, monkeypatch):
    from specdec.exec.runner import ModelRunner
    prefilled = []
    prefill = ModelRunner.prefill

    def spy(self, tokens, start, end, *args, **kwargs):
        prefilled.append(end - start)
        return prefill(self, tokens, start, end, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "prefill", spy)
    sp = SamplingParams(max_new_tokens=12, temperature=1.0, seed=5, n=4)
    eng = engine(bpe, "draft_model", 2, bs=8)
    first = eng.generate(prompts[:2], keys=["a", "b"], params=[sp, sp])
    assert [(r.key, r.sample_index) for r in first] == [(k, s) for k in "ab" for s in range(4)]
    assert sum(prefilled) == 2 * 2  # each prompt prefilled once, in the target and in the draft: not 4 times
    for key in "ab":
        samples = [tuple(r.token_ids) for r in first if r.key == key]
        assert len(set(samples)) > 1  # independent draws
    again = eng.generate(prompts[:2], keys=["a", "b"], params=[sp, sp])
    assert [r.token_ids for r in again] == [r.token_ids for r in first]  # a rerun gives the same samples
    single = eng.generate(prompts[:2], keys=["a", "b"], params=[sp.model_copy(update={"n": 1})] * 2)
    assert [r.token_ids for r in single] == [first[0].token_ids, first[4].token_ids]  # sample 0 is the n=1 row


@pytest.mark.parametrize("temperature,fmt", [(0.0, None), (0.7, None), (0.0, "person")])
def test_logprobs_are_the_targets_own(bpe, prompts, temperature, fmt):
    """Each token's logprob (and the top 5) is the target's log-softmax at its position, after temperature and
    the format's mask: what transformers' forward gives for the same tokens."""
    tok, target, _ = bpe
    sp = SamplingParams(max_new_tokens=20, temperature=temperature, seed=1, logprobs=True, top_logprobs=5,
                        response_format=FORMATS[fmt] if fmt else None)
    results = engine(bpe, "draft_model").generate(prompts, params=[sp] * len(prompts))
    grammars = Grammars(tok, len(tok), (tok.eos_token_id,))
    for p, r in zip(prompts, results):
        assert len(r.logprobs) == len(r.top_logprobs) == r.generated_tokens
        with torch.no_grad():
            logits = target(torch.tensor([p + r.token_ids])).logits[0, len(p) - 1: -1]
        if fmt:
            m = grammars.matcher(sp.grammar)
            masks = []
            for t in r.token_ids:
                masks.append(GrammarMask(m, 0, len(tok)).allowed())
                m.consume_token(t)
            logits = logits.masked_fill(~torch.stack(masks), float("-inf"))
        want = torch.log_softmax(logits / (temperature or 1.0), -1)
        chosen = want.gather(1, torch.tensor(r.token_ids)[:, None]).squeeze(1)
        assert np.allclose(r.logprobs, chosen.numpy(), atol=1e-4)
        for j, top in enumerate(r.top_logprobs):
            ids = [t for t, _ in top]
            assert np.allclose([lp for _, lp in top], want[j, ids].numpy(), atol=1e-4)
            assert ids[0] == int(want[j].argmax()) and len(ids) == min(5, int(torch.isfinite(want[j]).sum()))
        if fmt:
            assert r.forced_tokens > 0
