"""PrecisionPolicy.from_sections for every mode, and the config errors."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace as NS

import pytest
import torch

from shardspeed.runtime.precision.dtypes import parse_dtype
from shardspeed.runtime.precision.policy import PrecisionPolicy

OFF = NS(enabled=False)


def test_fp32_default() -> None:
    for policy in (PrecisionPolicy.from_sections(), PrecisionPolicy.from_sections(OFF, OFF, OFF)):
        assert policy.param_dtype == policy.master_dtype == policy.grad_dtype == torch.float32
        assert not policy.uses_master_weights and not policy.needs_loss_scaling
        assert not policy.mixed_precision and not policy.autocast_enabled
        assert policy.comm_dtype is None and policy.reduce_dtype == torch.float32


def test_native_fp16() -> None:
    policy = PrecisionPolicy.from_sections(fp16=NS(enabled=True, loss_scale=0, auto_cast=True))
    assert policy.param_dtype == policy.grad_dtype == torch.float16
    assert policy.master_dtype == torch.float32
    assert policy.uses_master_weights and policy.needs_loss_scaling
    assert policy.fp16_enabled and not policy.bf16_enabled and policy.fp16_auto_cast
    assert policy.mixed_precision and policy.compute_dtype == torch.float16


def test_native_bf16() -> None:
    policy = PrecisionPolicy.from_sections(
        fp16=OFF, bf16=NS(enabled=True, immediate_grad_update=True)
    )
    assert policy.param_dtype == policy.grad_dtype == torch.bfloat16
    assert policy.master_dtype == torch.float32
    assert policy.uses_master_weights and not policy.needs_loss_scaling
    assert policy.bf16_enabled and policy.immediate_grad_update


@pytest.mark.parametrize(
    ("dtype", "expected", "scaling"),
    [
        ("bfloat16", torch.bfloat16, False),
        ("float16", torch.float16, True),
        (torch.float16, torch.float16, True),
        (None, torch.bfloat16, False),
    ],
)
def test_torch_autocast(dtype: object, expected: torch.dtype, scaling: bool) -> None:
    section = NS(enabled=True, dtype=dtype, lower_precision_safe_modules=None)
    policy = PrecisionPolicy.from_sections(OFF, OFF, section)
    assert policy.param_dtype == policy.master_dtype == policy.grad_dtype == torch.float32
    assert not policy.uses_master_weights
    assert policy.needs_loss_scaling is scaling
    assert policy.autocast_dtype == expected and policy.compute_dtype == expected
    assert policy.mixed_precision
    assert policy.lower_precision_safe_modules == (
        "torch.nn.Linear",
        "torch.nn.Conv1d",
        "torch.nn.Conv2d",
        "torch.nn.Conv3d",
    )


def test_torch_autocast_custom_modules_and_bad_dtype() -> None:
    section = NS(enabled=True, dtype="bf16", lower_precision_safe_modules=["torch.nn.Linear"])
    assert PrecisionPolicy.from_sections(torch_autocast=section).lower_precision_safe_modules == (
        "torch.nn.Linear",
    )
    with pytest.raises(ValueError, match="torch_autocast.dtype"):
        PrecisionPolicy.from_sections(torch_autocast=NS(enabled=True, dtype="float32"))


def test_fp16_and_bf16_together_is_an_error() -> None:
    with pytest.raises(ValueError, match="fp16.enabled and bf16.enabled"):
        PrecisionPolicy.from_sections(NS(enabled=True), NS(enabled=True))


@pytest.mark.parametrize("native", ["fp16", "bf16"])
def test_autocast_with_native_is_an_error(native: str) -> None:
    sections = {native: NS(enabled=True), "torch_autocast": NS(enabled=True, dtype="bfloat16")}
    with pytest.raises(ValueError, match=f"{native}.enabled"):
        PrecisionPolicy.from_sections(**sections)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("fp16", torch.float16),
        ("bf16", torch.bfloat16),
        ("fp32", torch.float32),
        (torch.bfloat16, torch.bfloat16),
    ],
)
def test_communication_data_type(value: object, expected: torch.dtype) -> None:
    policy = PrecisionPolicy.from_sections(bf16=NS(enabled=True), communication_data_type=value)
    assert policy.comm_dtype == expected and policy.reduce_dtype == expected


def test_bad_communication_data_type() -> None:
    with pytest.raises(ValueError, match="communication_data_type='int8'"):
        PrecisionPolicy.from_sections(communication_data_type="int8")


def test_policy_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        PrecisionPolicy().param_dtype = torch.float16  # type: ignore[misc]


def test_parse_dtype_spellings() -> None:
    assert parse_dtype("torch.bfloat16") == torch.bfloat16
    assert parse_dtype("Half") == torch.float16
    with pytest.raises(ValueError, match="dtype"):
        parse_dtype(torch.int8)
