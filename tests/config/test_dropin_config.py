"""DeepSpeed config names its own unit tests use: ``gradient_allreduce_op``,
``DeepSpeedConfig._configure_train_batch_size()``, and the top-level ``__version_*__`` /
``get_accelerator`` names."""

from __future__ import annotations

import pytest

import shardspeed
from shardspeed.accelerator import get_accelerator
from shardspeed.compat import deepspeed_shim
from shardspeed.config.batch import BatchSizeError
from shardspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError

# --- gradient_allreduce_op ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"), [("mean", "mean"), ("SUM", "sum"), ("Mean", "mean")]
)
def test_gradient_allreduce_op(value: str, expected: str) -> None:
    config = DeepSpeedConfig({"train_batch_size": 1, "gradient_allreduce_op": value})
    assert config.gradient_allreduce_op == expected


def test_gradient_allreduce_op_default() -> None:
    assert DeepSpeedConfig({"train_batch_size": 1}).gradient_allreduce_op == "mean"


@pytest.mark.parametrize("value", ["max", "avg", 1, None])
def test_invalid_gradient_allreduce_op(value: object) -> None:
    with pytest.raises(ValueError, match="Invalid gradient_allreduce_op") as info:
        DeepSpeedConfig({"train_batch_size": 1, "gradient_allreduce_op": value})
    assert isinstance(info.value, DeepSpeedConfigError)
    assert "supported operations: ['mean', 'sum']" in str(info.value)


@pytest.mark.parametrize(
    ("extra", "feature", "fix"),
    [
        ({"zero_optimization": {"stage": 3}}, "ZeRO stage 3", "zero_optimization.stage to 0, 1"),
        (
            {"zero_optimization": {"stage": 2, "zenflow": {}}},
            "ZenFlow",
            "remove zero_optimization.zenflow",
        ),
        (
            {"zero_optimization": {"stage": 1}, "compile": {"deepcompile": True}},
            "DeepCompile",
            "compile.deepcompile to false",
        ),
    ],
)
def test_sum_is_refused_where_deepspeed_refuses_it(extra: dict, feature: str, fix: str) -> None:
    with pytest.raises(ValueError, match=f"not supported with {feature}") as info:
        DeepSpeedConfig({"train_batch_size": 1, "gradient_allreduce_op": "sum", **extra})
    assert "gradient_allreduce_op='sum'" in str(info.value) and fix in str(info.value)
    # "mean" is fine with each of them
    DeepSpeedConfig({"train_batch_size": 1, "gradient_allreduce_op": "mean", **extra})


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_sum_is_accepted_with_stages_0_to_2(stage: int) -> None:
    config = DeepSpeedConfig(
        {
            "train_batch_size": 1,
            "gradient_allreduce_op": "sum",
            "zero_optimization": {"stage": stage},
        }
    )
    assert config.gradient_allreduce_op == "sum"


# --- _configure_train_batch_size -----------------------------------------------------------------


def _run_batch_config(config: DeepSpeedConfig, train=None, micro=None, gas=None) -> bool:
    """DeepSpeed's test helper, line for line in behaviour: set, solve, catch AssertionError."""
    config.train_batch_size = train
    config.train_micro_batch_size_per_gpu = micro
    config.gradient_accumulation_steps = gas
    try:
        config._configure_train_batch_size()
    except AssertionError:
        return False
    return True


@pytest.mark.parametrize(
    ("batch", "micro", "gas", "success"),
    [(32, 16, 1, True), (32, 8, 2, True), (33, 17, 2, False), (32, 18, 1, False)],
)
def test_configure_train_batch_size(batch: int, micro: int, gas: int, success: bool) -> None:
    """DeepSpeed's TestBatchConfig cases on two data-parallel ranks."""
    config = DeepSpeedConfig({"train_batch_size": 2}, dp_world_size=2)
    if not success:
        assert not _run_batch_config(config, train=batch, micro=micro, gas=gas)
        assert not _run_batch_config(config, train=batch, micro=micro)
        assert not _run_batch_config(config, gas=gas)  # gas alone cannot be solved
        if gas != 1:
            assert not _run_batch_config(config, train=batch, gas=gas)
        return
    given = [
        {"train": batch, "micro": micro, "gas": gas},
        {"train": batch, "micro": micro},
        {"train": batch, "gas": gas},
        {"micro": micro, "gas": gas},
    ]
    if gas == 1:
        given += [{"micro": micro}, {"train": batch}]
    for kwargs in given:
        assert _run_batch_config(config, **kwargs), kwargs
        triangle = (
            config.train_batch_size,
            config.train_micro_batch_size_per_gpu,
            config.gradient_accumulation_steps,
        )
        assert triangle == (batch, micro, gas), kwargs


def test_batch_errors_are_config_and_assertion_errors() -> None:
    with pytest.raises(BatchSizeError) as info:
        DeepSpeedConfig({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 3})
    assert isinstance(info.value, AssertionError) and isinstance(info.value, DeepSpeedConfigError)
    assert "train_batch_size (10)" in str(info.value)


# --- top-level names ---------------------------------------------------------------------------


def test_version_parts_are_the_deepspeed_api_level() -> None:
    parts = (
        shardspeed.__version_major__,
        shardspeed.__version_minor__,
        shardspeed.__version_patch__,
    )
    assert all(type(p) is int for p in parts)
    api = deepspeed_shim.compat_version().split("+")[0]
    assert ".".join(str(p) for p in parts) == api
    assert {"__version_major__", "__version_minor__", "__version_patch__"} <= set(
        shardspeed.__all__
    )


def test_top_level_get_accelerator() -> None:
    assert shardspeed.get_accelerator is get_accelerator
    assert shardspeed.get_accelerator() is get_accelerator()
    assert "get_accelerator" in dir(shardspeed)
