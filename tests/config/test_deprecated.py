"""Each deprecated key still works, logs exactly one warning naming its replacement, and
conflicts with its replacement."""

from __future__ import annotations

from typing import Any

import pytest

from shardspeed.config import DeepSpeedConfig, DeepSpeedConfigError
from shardspeed.runtime.zero.config import DeepSpeedZeroConfig


def _cfg(**extra: Any) -> DeepSpeedConfig:
    return DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, **extra}, dp_world_size=1)


def _one_warning(ds_log: Any, *fragments: str) -> None:
    warnings = ds_log.warnings()
    assert len(warnings) == 1, warnings
    for fragment in fragments:
        assert fragment in warnings[0]


def test_cpu_offload(ds_log: Any) -> None:
    zero = _cfg(zero_optimization={"stage": 2, "cpu_offload": True}).zero_optimization
    assert zero.offload_optimizer is not None and zero.offload_optimizer.device == "cpu"
    _one_warning(ds_log, "cpu_offload", "offload_optimizer")


def test_cpu_offload_false_migrates_nothing(ds_log: Any) -> None:
    assert (
        _cfg(zero_optimization={"cpu_offload": False}).zero_optimization.offload_optimizer is None
    )
    _one_warning(ds_log, "cpu_offload")


def test_cpu_offload_param(ds_log: Any) -> None:
    zero = _cfg(zero_optimization={"stage": 3, "cpu_offload_param": True}).zero_optimization
    assert zero.offload_param is not None and zero.offload_param.device == "cpu"
    _one_warning(ds_log, "cpu_offload_param", "offload_param")


def test_cpu_offload_use_pin_memory(ds_log: Any) -> None:
    zero = _cfg(
        zero_optimization={
            "stage": 3,
            "offload_param": {"device": "cpu"},
            "offload_optimizer": {"device": "cpu"},
            "cpu_offload_use_pin_memory": True,
        }
    ).zero_optimization
    assert zero.offload_param is not None and zero.offload_param.pin_memory
    assert zero.offload_optimizer is not None and zero.offload_optimizer.pin_memory
    _one_warning(ds_log, "cpu_offload_use_pin_memory", "pin_memory")


def test_stage3_gather_fp16_weights_on_model_save(ds_log: Any) -> None:
    zero = _cfg(
        zero_optimization={"stage": 3, "stage3_gather_fp16_weights_on_model_save": True}
    ).zero_optimization
    assert zero.gather_16bit_weights_on_model_save is True
    _one_warning(
        ds_log, "stage3_gather_fp16_weights_on_model_save", "gather_16bit_weights_on_model_save"
    )


@pytest.mark.parametrize(("value", "stage"), [(True, 1), (False, 0)])
def test_bool_zero_optimization(ds_log: Any, value: bool, stage: int) -> None:
    assert _cfg(zero_optimization=value).zero_optimization.stage == stage
    _one_warning(ds_log, "zero_optimization", f'"stage": {stage}')


def test_allgather_size(ds_log: Any) -> None:
    cfg = _cfg(zero_optimization=True, allgather_size=1234)
    assert cfg.zero_optimization.allgather_bucket_size == 1234
    assert len(ds_log.warnings()) == 2  # one for the bool form, one for allgather_size
    assert any("allgather_bucket_size" in w for w in ds_log.warnings())


def test_bfloat16_legacy_name_is_an_alias(ds_log: Any) -> None:
    assert _cfg(bfloat16={"enabled": True}).bf16.enabled
    assert ds_log.warnings() == []


@pytest.mark.parametrize(
    "zero",
    [
        {"cpu_offload": True, "offload_optimizer": {"device": "cpu"}},
        {"stage": 3, "cpu_offload_param": True, "offload_param": {"device": "cpu"}},
        {
            "stage3_gather_fp16_weights_on_model_save": True,
            "gather_16bit_weights_on_model_save": False,
        },
        {
            "stage3_gather_fp16_weights_on_model_save": True,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": False},
            "cpu_offload_use_pin_memory": True,
        },
    ],
)
def test_deprecated_plus_replacement_is_an_error(zero: dict[str, Any]) -> None:
    with pytest.raises(DeepSpeedConfigError, match="deprecated"):
        _cfg(zero_optimization=zero)


def test_allgather_size_conflict() -> None:
    with pytest.raises(DeepSpeedConfigError, match="allgather_size"):
        _cfg(zero_optimization={"allgather_bucket_size": 5}, allgather_size=10)


def test_standalone_zero_config(ds_log: Any) -> None:
    assert DeepSpeedZeroConfig(cpu_offload=True).offload_optimizer.device == "cpu"  # type: ignore[union-attr]
    _one_warning(ds_log, "cpu_offload")
    assert DeepSpeedZeroConfig(stage=3, stage3_prefetch_bucket_size=10).prefetch_bucket_size == 10  # type: ignore[arg-type]


def test_assignment_does_not_re_warn(ds_log: Any) -> None:
    zero = DeepSpeedZeroConfig(stage=2, cpu_offload=True)  # type: ignore[arg-type]
    zero.stage = 3  # type: ignore[assignment]
    zero.reduce_bucket_size = 10
    assert len(ds_log.warnings()) == 1
    assert zero.offload_optimizer is not None and zero.offload_optimizer.device == "cpu"
