"""Shared fixtures: tiny in-memory models and prompts with transformers' own greedy answers (engine
tests), a tiny tokenizer + target/draft pair saved as HF folders (job tests), and one Ray session."""

from __future__ import annotations

import os

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker of `pytest -n N`: one core each (torch reads this at import)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

WORDS = ("the a of to and in is it you that he was for on are with as I his they be at one have this from "
         "or had by hot word but what some we can out other were all there when up use your how said an each "
         "she which do their time if will way about many then them write would like so these her long make "
         "thing see him two has look more day could go come did number sound no most people my over know "
         "water than call first who may down side been now find any new work part take get place made live "
         "where after back little only round man year came show every good me give our under name very").split()


def make_tokenizer(folder: str):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>"]
    vocab = {t: i for i, t in enumerate(specials + sorted(set(WORDS)) + list(".,?!:\n"))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    # a template that refuses an unknown role: how a real tokenizer fails on one row
    fast.chat_template = ("{% for m in messages %}{% if m['role'] == 'bad' %}{{ raise_exception('unknown role') }}"
                          "{% endif %}<|{{ m['role'] }}|> {{ m['content'] }} </s> {% endfor %}"
                          "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    fast.save_pretrained(folder)
    return fast


def make_model(folder: str, vocab: int, layers: int, seed: int, eos: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, initializer_range=0.3,
                      max_position_embeddings=512, bos_token_id=1, eos_token_id=eos, pad_token_id=None)
    LlamaForCausalLM(cfg).save_pretrained(folder)


@pytest.fixture(scope="session", autouse=True)
def short_captures():
    """On a GPU a test's engine runs a few short jobs: capturing every step each could meet before its rows join
    would cost more than the steps it meets, so captures get 2 s a job (test_capture.py gives its own budgets)."""
    if os.environ.get("SPECBATCH_TEST_DEVICE", "cpu") == "cuda":
        from specdec.engine import SpecEngine

        SpecEngine.CAPTURE_BUDGET = 2.0
    yield


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """{'target': dir, 'draft': dir}: HF folders with a shared word-level tokenizer."""
    root = tmp_path_factory.mktemp("models")
    out = {}
    for name, layers, seed in (("target", 2, 0), ("draft", 1, 1)):
        folder = str(root / name)
        tok = make_tokenizer(folder)
        make_model(folder, len(tok), layers, seed, tok.eos_token_id)
        out[name] = folder
    return out


@pytest.fixture(scope="session")
def ray_session():
    """One embedded Ray for the whole test session (it takes seconds to start)."""
    import ray

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def target():
    from engine_models import tiny_llama
    return tiny_llama(seed=0)


@pytest.fixture(scope="session")
def drafts(target):
    from engine_models import noisy_copy, tiny_llama
    return {
        "random": tiny_llama(layers=1, seed=7),  # unrelated: almost nothing accepted
        "noisy": noisy_copy(target, 0.02),  # partial acceptance
        "same": target,  # everything accepted
    }


@pytest.fixture(scope="session")
def prompts():
    import torch
    g = torch.Generator().manual_seed(3)
    lengths = [5, 17, 1, 9, 30, 3, 12, 8]
    return [torch.randint(0, 96, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="session")
def reference(target, prompts):
    """Plain greedy from transformers' own generate, one prompt at a time."""
    from engine_models import MAX_NEW
    return greedy_rows(target, prompts, MAX_NEW)


def greedy_rows(target, prompts: list[list[int]], new: int) -> list[list[int]]:
    """transformers' greedy `generate` of `new` tokens after each prompt, one at a time."""
    import torch

    out = []
    for p in prompts:
        ids = target.generate(torch.tensor([p], device=target.device), max_new_tokens=new, min_new_tokens=new,
                              do_sample=False)
        out.append(ids[0, len(p):].tolist())
    return out


@pytest.fixture(scope="session")
def repeating():
    """Prompts that repeat themselves, so that prompt lookups hit."""
    import torch
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 96, (n,), generator=g).tolist() * 3 for n in (5, 17, 1, 9, 30, 3, 12, 8)]


@pytest.fixture(scope="session")
def greedy(target, repeating):
    """transformers' own greedy decoding of the repeating prompts, one at a time."""
    from engine_models import LOOKUP_NEW
    return greedy_rows(target, repeating, LOOKUP_NEW)
