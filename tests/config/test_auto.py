"""``"auto"`` values, as the HuggingFace Trainer writes them."""

from __future__ import annotations

from typing import Any

import pytest

from shardspeed.config import DeepSpeedConfig, DeepSpeedConfigError

_HF_STYLE: dict[str, Any] = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "fp16": {"enabled": "auto", "loss_scale": 0},
    "bf16": {"enabled": "auto"},
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": "auto",
        "reduce_bucket_size": "auto",
        "allgather_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": "auto",
        "stage3_max_reuse_distance": "auto",
        "sub_group_size": "auto",
    },
}


def test_auto_means_default_or_not_given() -> None:
    cfg = DeepSpeedConfig(_HF_STYLE, dp_world_size=2)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu) == (4, 2)
    assert cfg.gradient_accumulation_steps == 1
    assert cfg.gradient_clipping == 0.0
    assert cfg.fp16.enabled is False and cfg.bf16.enabled is False
    zero = cfg.zero_optimization
    assert zero.overlap_comm is True  # None -> stage == 3
    assert zero.reduce_bucket_size == 500_000_000
    assert zero.allgather_bucket_size == 500_000_000
    assert zero.prefetch_bucket_size == 50_000_000
    assert zero.param_persistence_threshold == 100_000
    assert zero.max_live_parameters == 1_000_000_000
    assert zero.sub_group_size == 1_000_000_000


def test_hidden_size_hint_gives_trainer_values() -> None:
    zero = DeepSpeedConfig(_HF_STYLE, dp_world_size=1, hidden_size=100).zero_optimization
    assert zero.reduce_bucket_size == 10_000
    assert zero.prefetch_bucket_size == 9_000
    assert zero.param_persistence_threshold == 1_000
    assert zero.max_live_parameters == 1_000_000_000  # no Trainer rule: the default


def test_batch_auto_everywhere_is_the_missing_batch_error() -> None:
    config = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"}
    with pytest.raises(DeepSpeedConfigError, match="Either train_batch_size"):
        DeepSpeedConfig(config, dp_world_size=1)


@pytest.mark.parametrize(
    ("section", "key"),
    [("optimizer", "lr"), ("optimizer", "weight_decay"), ("scheduler", "warmup_max_lr")],
)
def test_auto_in_optimizer_or_scheduler_params_is_an_error(section: str, key: str) -> None:
    config = {
        "train_micro_batch_size_per_gpu": 1,
        section: {"type": "X", "params": {"eps": 1e-8, key: "auto"}},
    }
    with pytest.raises(DeepSpeedConfigError) as info:
        DeepSpeedConfig(config, dp_world_size=1)
    assert f"{section}.params" in str(info.value) and f"'{key}'" in str(info.value)


def test_auto_where_it_is_not_a_placeholder_is_invalid() -> None:
    with pytest.raises(DeepSpeedConfigError, match="zero_optimization.stage"):
        DeepSpeedConfig(
            {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": "auto"}},
            dp_world_size=1,
        )


def test_auto_where_it_is_a_real_value_is_kept() -> None:
    cfg = DeepSpeedConfig(
        {"train_micro_batch_size_per_gpu": 1, "pipeline": {"stages": "auto"}}, dp_world_size=1
    )
    assert cfg.pipeline.stages == "auto"
