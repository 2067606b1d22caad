"""The inference config: DeepSpeed's fields, aliases and defaults; unknown keys suggest a fix;
``init_inference`` merges a config with keyword arguments and refuses conflicts."""

from __future__ import annotations

import json

import pytest
import torch

import shardspeed
from shardspeed.config.errors import DeepSpeedConfigError
from shardspeed.inference.config import (
    DeepSpeedInferenceConfig,
    DeepSpeedMoEConfig,
    DeepSpeedTPConfig,
    InferenceCheckpointConfig,
    MoETypeEnum,
    QuantizationConfig,
)
from shardspeed.inference.engine import InferenceEngine
from tests.inference import models


def test_defaults_match_deepspeed():
    config = DeepSpeedInferenceConfig()
    assert config.dtype == torch.float16
    assert config.replace_with_kernel_inject is False
    assert config.max_out_tokens == 1024 and config.min_out_tokens == 1
    assert config.return_tuple and config.triangular_masking
    assert config.replace_method == "auto" and config.moe_experts == [1]
    assert config.moe_type == MoETypeEnum.standard
    assert DeepSpeedTPConfig().tp_grain_size == 64 and DeepSpeedTPConfig().tp_size == 1
    assert DeepSpeedMoEConfig(num_experts=[4]).moe_experts == [4]
    quant = QuantizationConfig()
    assert quant.weight.num_bits == 8 and quant.weight.q_groups == 1 and quant.qkv.enabled
    assert InferenceCheckpointConfig().checkpoint_dir is None
    defaults = shardspeed.default_inference_config()
    assert defaults["dtype"] == torch.float16 and defaults["tensor_parallel"]["tp_size"] == 1


def test_aliases_and_deprecated_mp_size():
    config = DeepSpeedInferenceConfig(
        **{
            "kernel_inject": True,
            "tp": {"tp_size": 4},
            "dtype": "fp16",
            "max_tokens": 64,
            "tm": False,
        }
    )
    assert config.replace_with_kernel_inject and config.tensor_parallel.tp_size == 4
    assert config.max_out_tokens == 64 and not config.triangular_masking
    assert DeepSpeedInferenceConfig(mp_size=2).tensor_parallel.tp_size == 2
    with pytest.raises(DeepSpeedConfigError, match="conflicts"):
        DeepSpeedInferenceConfig(mp_size=2, tensor_parallel={"tp_size": 4})


@pytest.mark.parametrize(
    ("data", "hint"),
    [
        ({"tensor_paralel": {}}, "did you mean 'tensor_parallel'"),
        ({"tp": {"tp_siz": 2}}, "did you mean 'tp_size'"),
        ({"dtype": "fp64"}, "unsupported dtype"),
    ],
)
def test_bad_keys_and_values_are_errors(data, hint):
    with pytest.raises(DeepSpeedConfigError, match=hint):
        DeepSpeedInferenceConfig(**data)


def test_config_file_kwargs_merge_and_conflict(tmp_path):
    path = tmp_path / "inference.json"
    path.write_text(json.dumps({"dtype": "fp32", "max_tokens": 64}))
    engine = shardspeed.init_inference(models.build("gpt2"), str(path), replace_method="auto")
    assert isinstance(engine, InferenceEngine)
    assert engine.config.dtype == torch.float32 and engine.config.max_out_tokens == 64
    with pytest.raises(ValueError, match="Conflicting argument 'dtype'"):
        shardspeed.init_inference(models.build("gpt2"), {"dtype": "fp32"}, dtype="fp16")
    same = shardspeed.init_inference(models.build("gpt2"), {"dtype": "fp32"}, dtype="fp32")
    assert same.config.dtype == torch.float32
    model_config = DeepSpeedInferenceConfig(dtype="fp32", max_tokens=64)
    from_model = shardspeed.init_inference(models.build("gpt2"), model_config, kernel_inject=True)
    assert from_model.config.max_out_tokens == 64 and from_model.fused is not None


def test_engine_runs_like_the_model_and_profiles():
    model = models.build("llama")
    ids = models.prompt()
    want = model(ids).logits
    engine = shardspeed.init_inference(models.build("llama"), dtype=torch.float32)
    engine.profile_model_time()
    assert torch.equal(engine(ids).logits, want)
    assert torch.equal(engine.forward(input_ids=ids).logits, want)
    assert engine.mp_world_size == 1 and engine.dtype == torch.float32
    times = engine.model_times()
    assert len(times) == 2 and all(t > 0 for t in times) and engine.model_times() == []
    assert torch.equal(models.greedy(engine, ids, 8), models.greedy(model, ids, 8))


def test_bf16_conversion_and_unsupported_dtype(monkeypatch):
    engine = shardspeed.init_inference(models.build("qwen2"), dtype="bf16")
    assert {p.dtype for p in engine.module.parameters()} == {torch.bfloat16}
    from shardspeed.accelerator import get_accelerator

    monkeypatch.setattr(type(get_accelerator()), "supported_dtypes", lambda self: [torch.float32])
    with pytest.raises(ValueError, match="dtype=bfloat16 is not supported on cpu"):
        shardspeed.init_inference(models.build("qwen2"), dtype="bf16")


def test_meta_model_without_checkpoint_is_an_error():
    from accelerate import init_empty_weights

    with init_empty_weights():
        empty = models.build("llama")
    with pytest.raises(ValueError, match="pass checkpoint="):
        shardspeed.init_inference(empty, dtype=torch.float32)
