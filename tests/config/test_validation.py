"""Unknown keys get the closest valid key; bad values name the path, the value and what is allowed."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardspeed.config import DeepSpeedConfig, DeepSpeedConfigError, DeepSpeedFP16Config
from shardspeed.runtime.zero.config import DeepSpeedZeroConfig


def _cfg(**extra: Any) -> DeepSpeedConfig:
    return DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, **extra}, dp_world_size=1)


def test_error_is_a_value_error() -> None:
    assert issubclass(DeepSpeedConfigError, ValueError)


@pytest.mark.parametrize(
    ("config", "path", "suggestion"),
    [
        ({"train_batch_sizes": 8}, "train_batch_sizes", "train_batch_size"),
        ({"zero_optimisation": {}}, "zero_optimisation", "zero_optimization"),
        (
            {"zero_optimization": {"overlap_com": True}},
            "zero_optimization.overlap_com",
            "overlap_comm",
        ),
        (
            {"zero_optimization": {"stage3_prefetch_bucket": 1}},
            "zero_optimization.stage3_prefetch_bucket",
            "stage3_prefetch_bucket_size",
        ),
        (
            {"zero_optimization": {"offload_param": {"devise": "cpu"}}},
            "zero_optimization.offload_param.devise",
            "device",
        ),
        ({"fp16": {"enabeld": True}}, "fp16.enabeld", "enabled"),
        ({"fp16": {"initial_scale_pow": 8}}, "fp16.initial_scale_pow", "initial_scale_power"),
        ({"bf16": {"Enabled": True}}, "bf16.Enabled", "enabled"),
        ({"optimizer": {"type": "Adam", "param": {}}}, "optimizer.param", "params"),
        ({"tensorboard": {"output_dir": "x"}}, "tensorboard.output_dir", "output_path"),
    ],
)
def test_typo_gets_suggestion(config: dict[str, Any], path: str, suggestion: str) -> None:
    with pytest.raises(DeepSpeedConfigError) as info:
        _cfg(**config)
    assert f"Unknown key '{path}'; did you mean '{suggestion}'?" in str(info.value)


def test_unknown_key_without_close_match_lists_valid_keys() -> None:
    with pytest.raises(DeepSpeedConfigError, match=r"valid keys here are: .*enabled"):
        _cfg(comms_logger={"zzzzzz": 1})


def test_standalone_section_reports_its_path() -> None:
    with pytest.raises(
        DeepSpeedConfigError, match=r"'zero_optimization.overlap_com'.*'overlap_comm'"
    ):
        DeepSpeedZeroConfig(overlap_com=True)  # type: ignore[call-arg]
    with pytest.raises(DeepSpeedConfigError, match=r"'fp16.hysteresys'"):
        DeepSpeedFP16Config(hysteresys=2)  # type: ignore[call-arg]


def test_several_problems_reported_together() -> None:
    with pytest.raises(DeepSpeedConfigError) as info:
        _cfg(zero_optimization={"stage": 5, "overlap_com": True}, fp16={"enabld": True})
    msg = str(info.value)
    assert "3 problems" in msg and "zero_optimization.stage" in msg and "fp16.enabld" in msg


@pytest.mark.parametrize(
    ("config", "fragments"),
    [
        (
            {"zero_optimization": {"reduce_bucket_size": -1}},
            ["zero_optimization.reduce_bucket_size", "-1", "greater than or equal to 0"],
        ),
        ({"zero_optimization": {"stage": 5}}, ["zero_optimization.stage", "5", "0 (disabled)"]),
        (
            {"communication_data_type": "int3"},
            ["communication_data_type", "'int3'", "fp32", "bf16"],
        ),
        ({"fp16": {"loss_scale": -1}}, ["fp16.loss_scale", "-1", "greater than or equal to 0"]),
        ({"steps_per_print": 0}, ["steps_per_print", "0", "greater than 0"]),
        (
            {"zero_optimization": {"offload_optimizer": {"device": "gpu"}}},
            ["zero_optimization.offload_optimizer.device", "'gpu'", "'cpu'"],
        ),
        ({"pipeline": {"stages": "many"}}, ["pipeline.stages", "'many'", "auto"]),
        (
            {"checkpoint": {"tag_validation": "maybe"}},
            ["checkpoint.tag_validation", "'MAYBE'", "'WARN'"],
        ),
        ({"fp16": True}, ["'fp16'", "True", "dictionary"]),
    ],
)
def test_bad_values_name_path_value_and_allowed(
    config: dict[str, Any], fragments: list[str]
) -> None:
    with pytest.raises(DeepSpeedConfigError) as info:
        _cfg(**config)
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("fp32", torch.float32),
        ("float32", torch.float32),
        ("fp16", torch.float16),
        ("half", torch.float16),
        ("bf16", torch.bfloat16),
        ("bfloat16", torch.bfloat16),
        ("BF16", torch.bfloat16),
    ],
)
def test_communication_data_type_names(name: str, dtype: torch.dtype) -> None:
    assert _cfg(communication_data_type=name).communication_data_type == dtype


def test_assignment_is_validated() -> None:
    cfg = _cfg()
    cfg.zero_optimization.stage = 3  # type: ignore[assignment]
    assert cfg.zero_optimization.stage == 3
    with pytest.raises(DeepSpeedConfigError) as info:
        DeepSpeedZeroConfig().reduce_bucket_size = -5  # pydantic error, converted below
    assert "reduce_bucket_size" in str(info.value)


@pytest.mark.parametrize(
    ("config", "fragment"),
    [
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "cannot be enabled together"),
        (
            {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
            "needs ZeRO stage 3",
        ),
        (
            {"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
            "stage 1, 2 or 3",
        ),
        (
            {
                "zero_optimization": {
                    "stage": 2,
                    "offload_optimizer": {"device": "cpu", "ratio": 0.5},
                }
            },
            "needs ZeRO stage 3",
        ),
        (
            {"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}},
            "ZeRO stage 1, 2 or 3",
        ),
        (
            {"bf16": {"enabled": True, "bf16_optimizer_states": True}},
            "requires bf16_master_weights_and_grads",
        ),
        ({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}}, "'bfloat16'"),
    ],
)
def test_cross_section_checks(config: dict[str, Any], fragment: str) -> None:
    with pytest.raises(DeepSpeedConfigError, match=fragment):
        _cfg(**config)


def test_offload_none_device_is_fine_below_stage3() -> None:
    cfg = _cfg(zero_optimization={"stage": 1, "offload_param": {"device": "none"}})
    assert cfg.zero_optimization.offload_param is not None
    assert not cfg.zero_optimization.offload_param.enabled
