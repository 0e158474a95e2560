"""Model loading: the dtype a config's `dtype` resolves to, and that a loaded model really has it."""

from __future__ import annotations

import pytest
import torch

from jobs.spec import ConfigError, parse_spec
from specdec.exec import models
from specdec.config import ModelSource
from specdec.exec.models import load_model, resolve_dtype


def test_named_dtypes_and_unknown_refused():
    assert resolve_dtype("float32") is torch.float32
    assert resolve_dtype("bfloat16") is torch.bfloat16
    assert resolve_dtype("float16", "cpu") is torch.float16
    with pytest.raises(ValueError, match="dtype 'float8'.*'auto'"):
        resolve_dtype("float8")


@pytest.mark.parametrize("native, expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_on_cpu_follows_native_bfloat16(monkeypatch, tiny_pair, native, expected):
    monkeypatch.setattr(models, "native_bf16_cpu", lambda: native)
    assert resolve_dtype("auto", "cpu") is expected
    model = load_model(ModelSource(path=tiny_pair["target"], dtype="auto"), "cpu")
    assert {p.dtype for p in model.parameters()} == {expected}


def test_job_dtype_defaults_to_auto_and_refuses_unknown(tiny_pair, tmp_path):
    cfg = {"name": "t", "input": {"path": str(tmp_path / "in.jsonl")}, "output": {"path": str(tmp_path / "out")},
           "models": {"target": {"path": tiny_pair["target"]}, "draft": {"path": tiny_pair["draft"]}}}
    spec = parse_spec(cfg)
    assert spec.models.target.dtype == "auto" and spec.models.draft.dtype == "auto"
    bad = {**cfg, "models": {"target": {"path": tiny_pair["target"], "dtype": "float8"}}}
    with pytest.raises(ConfigError, match=r"models\.target\.dtype"):
        parse_spec(bad)


def test_pickle_checkpoints_are_refused(tiny_pair, tmp_path):
    """Only safetensors or GGUF weights load: a pickle can run code when it is unpickled."""
    from transformers import AutoModelForCausalLM
    folder = tmp_path / "pickled"
    model = AutoModelForCausalLM.from_pretrained(tiny_pair["target"])
    model.save_pretrained(folder)
    for f in folder.glob("*.safetensors"):  # the same weights as a pickle checkpoint
        f.unlink()
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"no safetensors weights \(found pytorch_model.bin: pickle"):
        load_model(ModelSource(path=str(folder)), "cpu")


def test_remote_code_does_not_run_unless_the_config_allows_it(tmp_path):
    """A model folder that ships its own Python: with trust_remote_code off (the default) none of it runs."""
    import json
    folder = tmp_path / "custom"
    folder.mkdir()
    marker = tmp_path / "ran"
    code = f"open({str(marker)!r}, 'w').close()\nfrom transformers import PretrainedConfig\n" \
           "class EvilConfig(PretrainedConfig):\n    model_type = 'evil'\n"
    (folder / "configuration_evil.py").write_text(code)
    (folder / "modeling_evil.py").write_text(code)
    (folder / "config.json").write_text(json.dumps({
        "model_type": "evil", "auto_map": {"AutoConfig": "configuration_evil.EvilConfig",
                                           "AutoModelForCausalLM": "modeling_evil.EvilModel"}}))
    (folder / "model.safetensors").write_bytes(b"")
    assert ModelSource(path=str(folder)).trust_remote_code is False
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_model(ModelSource(path=str(folder)), "cpu")
    assert not marker.exists()
