"""One rank's slice of a Llama-family target, read from safetensors a slice at a time (no rank ever holds
the whole model, in memory or on the way there).

The split is Megatron-LM's: q/k/v and gate/up by output rows (a rank holds attention heads
[r h/N, (r+1) h/N) with their KV heads, and a slice of the MLP's units), o and down by input columns
(their outputs are partial sums, added over the ranks: `Layer.reduce`), the embedding and the output
head by vocabulary rows (a rank embeds the ids it holds, the logits' slices are gathered). Norms and
RoPE tables are replicated. Each rank's KV cache holds its own KV heads.
"""

from __future__ import annotations

import copy
import json
import math
import os
from collections.abc import Callable

import torch

from . import llama
from ..config import ModelSource
from .models import _check_weights, _local, resolve_dtype


def bounds(total: int, world: int, rank: int) -> tuple[int, int]:
    """Rank `rank`'s range of `total` units split in `world` slices of ceil(total / world) (the last may be
    short)."""
    per = math.ceil(total / world)
    return min(total, rank * per), min(total, (rank + 1) * per)


class SafetensorsReader:
    """Tensors of a safetensors folder by name, whole or a range of rows or columns, read from disk."""

    def __init__(self, folder: str):
        from safetensors import safe_open

        index = os.path.join(folder, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                files = json.load(f)["weight_map"]
        else:
            files = {}
            for name in sorted(os.listdir(folder)):
                if name.endswith(".safetensors"):
                    with safe_open(os.path.join(folder, name), framework="pt") as st:
                        files.update(dict.fromkeys(st.keys(), name))
        self.folder, self.files, self._open = folder, files, {}

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def read(self, name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self.files:
            raise ValueError(f"{self.folder}: no tensor {name!r} in its safetensors files")
        file = self.files[name]
        if file not in self._open:
            self._open[file] = safe_open(os.path.join(self.folder, file), framework="pt")
        part = self._open[file].get_slice(name)
        if rows is not None:
            return part[rows[0]:rows[1]]
        if cols is not None:
            return part[:, cols[0]:cols[1]]
        return part[:]


class ShardedModel(torch.nn.Module):
    """Rank `rank` of `world`'s slice of a target: what the engine and the KV cache ask of a model (a config
    with this rank's heads, parameters, a generation config) and the lean weights it runs."""

    def __init__(self, config, weights: llama.LlamaWeights, head: torch.Tensor, vocab_rows: int, rank: int,
                 world: int, generation_config=None):
        super().__init__()
        self.config = config
        self.generation_config = generation_config
        self.weights = weights
        self.head = head  # [ceil(vocab / world), d]: this rank's rows of the output head, zero-padded
        self.vocab_rows = vocab_rows  # the whole vocabulary's
        self.rank, self.world = rank, world
        seen, params = set(), []
        for t in [weights.embed, weights.norm, head] + [getattr(layer, f) for layer in weights.layers
                                                         for f in ("ln1", "qkv", "qkv_bias", "o", "ln2", "gate_up", "down")]:
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                params.append(torch.nn.Parameter(t, requires_grad=False))
        self.shards = torch.nn.ParameterList(params)

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.shards)


def _skeleton(src: ModelSource, path: str):
    """The target's config and its transformers model built on the meta device (no weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(path, trust_remote_code=src.trust_remote_code)
    with torch.device("meta"):
        return cfg, AutoModelForCausalLM.from_config(cfg, trust_remote_code=src.trust_remote_code)


def check_shardable(src: ModelSource, world: int):
    """Refuse, before any rank starts, a target that cannot be split `world` ways. Returns its local path,
    config and meta-device model (`_skeleton`)."""
    key = "models.target.tensor_parallel"
    if src.gguf_file:
        raise ValueError(f"{key} {world}: a GGUF target (gguf_file) cannot be read a slice at a time; "
                         "point models.target.path at its safetensors folder")
    path = _local(src)
    _check_weights(src, path)
    cfg, skeleton = _skeleton(src, path)
    reason = llama.unsupported(skeleton)
    if reason:
        raise ValueError(f"{key} {world} needs a Llama-family target ({', '.join(llama.FAMILIES)}): {reason}")
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    if heads % world or kv % world:
        raise ValueError(f"{key} {world} must divide the target's {heads} attention heads and {kv} KV heads")
    return path, cfg, skeleton


def load_shard(src: ModelSource, rank: int, world: int, device: str | torch.device = "cpu",
               reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> ShardedModel:
    """Rank `rank`'s slice of the target at `src` (a local safetensors folder), on `device`. `reduce` sums a
    tensor over the ranks (the group's all-reduce); None leaves the partial sums as they are."""
    path, cfg, skeleton = check_shardable(src, world)
    dtype = resolve_dtype(src.dtype, device)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    reader = SafetensorsReader(path)

    def get(name: str, **part) -> torch.Tensor:
        return reader.read(name, **part).to(device=device, dtype=dtype)

    hl, kl = heads // world, kv_heads // world
    q = (rank * hl * hd, (rank + 1) * hl * hd)
    kv = (rank * kl * hd, (rank + 1) * kl * hd)
    units = bounds(cfg.intermediate_size, world, rank)
    layers = []
    for i in range(cfg.num_hidden_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        bias = None
        if f"{a}q_proj.bias" in reader:
            bias = torch.cat([get(f"{a}q_proj.bias", rows=q), get(f"{a}k_proj.bias", rows=kv),
                              get(f"{a}v_proj.bias", rows=kv)])
        layers.append(llama.Layer(
            ln1=get(f"model.layers.{i}.input_layernorm.weight"),
            qkv=torch.cat([get(f"{a}q_proj.weight", rows=q), get(f"{a}k_proj.weight", rows=kv),
                           get(f"{a}v_proj.weight", rows=kv)]),
            qkv_bias=bias,
            o=get(f"{a}o_proj.weight", cols=q),
            ln2=get(f"model.layers.{i}.post_attention_layernorm.weight"),
            gate_up=torch.cat([get(f"{m}gate_proj.weight", rows=units), get(f"{m}up_proj.weight", rows=units)]),
            down=get(f"{m}down_proj.weight", cols=units),
            reduce=reduce,
        ))
    vocab = cfg.vocab_size
    rows = bounds(vocab, world, rank)
    per = math.ceil(vocab / world)

    def padded(name: str) -> torch.Tensor:  # every rank holds `per` rows: the gathered logits line up
        t = get(name, rows=rows)
        return torch.cat([t, t.new_zeros(per - t.shape[0], t.shape[1])]) if t.shape[0] < per else t

    emb = padded("model.embed_tokens.weight")
    head = padded("lm_head.weight") if "lm_head.weight" in reader else emb  # tied embeddings
    cos, sin = llama.rope_tables(type(skeleton.get_decoder().rotary_emb)(config=cfg), cfg, dtype, device)
    weights = llama.LlamaWeights(embed=emb, layers=layers, norm=get("model.norm.weight"), cos=cos, sin=sin,
                                 heads=hl, kv_heads=kl, head_dim=hd, eps=cfg.rms_norm_eps, vocab_start=rows[0],
                                 reduce=reduce)
    local = copy.deepcopy(cfg)  # what this rank's KV cache and memory plan see
    local.num_attention_heads, local.num_key_value_heads, local.head_dim = hl, kl, hd
    local.intermediate_size = units[1] - units[0]
    return ShardedModel(local, weights, head, vocab, rank, world, _generation_config(path))


def _generation_config(path: str):
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(path)
    except OSError:  # no generation_config.json: the model config's ids serve
        return None
