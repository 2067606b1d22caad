"""The pieces of DeepSpeed's surface that Transformers and Accelerate read, one by one (no
launch): ``engine.config`` read as a dict, ``steps_per_print: inf``, and the names Transformers'
``prevent_arange_dtype_change`` swaps around ``zero.Init``."""

from __future__ import annotations

import torch

from shardspeed.config import DeepSpeedConfig
from shardspeed.runtime.zero import partition_parameters as pp


def _config(**extra: object) -> DeepSpeedConfig:
    raw = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}, **extra}
    return DeepSpeedConfig(raw, dp_world_size=1)


def test_config_reads_like_the_dict_it_was_given() -> None:
    config = _config()
    # the HF Trainer: self.deepspeed.config.get("zero_optimization", {}).get("stage", None)
    assert config.get("zero_optimization", {}).get("stage", None) == 3
    assert config.get("tensor_parallel", {}).get("autotp_size", 0) == 0
    assert config["zero_optimization"] == {"stage": 3}
    assert "zero_optimization" in config and "optimizer" not in config
    config.get("zero_optimization")["stage"] = 1  # a copy: the config does not change
    assert config.zero_optimization.stage == 3 and config["zero_optimization"]["stage"] == 3


def test_infinite_steps_per_print_means_never() -> None:
    # Accelerate sets steps_per_print to float("inf") to silence DeepSpeed's progress lines
    assert _config(steps_per_print=float("inf")).steps_per_print is None
    assert _config(steps_per_print=10).steps_per_print == 10


def test_tensor_constructor_wrapper_names() -> None:
    assert pp._orig_torch_arange is torch.arange
    ones = pp.zero_wrapper_for_fp_tensor_constructor(torch.ones, torch.bfloat16, "cpu")
    assert ones(3).dtype == torch.bfloat16
    arange = pp.zero_wrapper_for_fp_tensor_constructor(torch.arange, torch.float16)
    assert arange(4).dtype == torch.int64  # integer results keep their dtype
    assert arange(4, dtype=torch.float32).dtype == torch.float16


def test_gathered_parameters_skips_none() -> None:
    # Transformers' resize_token_embeddings passes [weight, bias] of a Linear without bias
    head = torch.nn.Linear(4, 8, bias=False)
    with pp.GatheredParameters([head.weight, head.bias], modifier_rank=0) as gathered:
        assert gathered is None
    assert pp.GatheredParameters([head.bias, None]).params == []
