"""The torch_autocast module functions and the nested-autocast forward context."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from shardspeed.runtime import torch_autocast as ta


@pytest.fixture(autouse=True)
def fresh_state() -> Iterator[None]:
    ta.reset_autocast_state()
    yield
    ta.reset_autocast_state()


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.conv = torch.nn.Conv1d(2, 2, 3)
        self.norm = torch.nn.LayerNorm(4)


def test_default_modules() -> None:
    assert ta.get_default_autocast_lower_precision_modules() == [
        "torch.nn.Linear",
        "torch.nn.Conv1d",
        "torch.nn.Conv2d",
        "torch.nn.Conv3d",
    ]


def test_init_marks_safe_module_params() -> None:
    net = Net()
    assert not ta.is_autocast_initialized()
    ta.init_autocast_params(SimpleNamespace(module=net), torch.bfloat16, None)
    assert ta.is_autocast_initialized() and ta.get_autocast_dtype() == torch.bfloat16
    for p in [*net.fc.parameters(), *net.conv.parameters()]:
        assert ta.has_comm_dtype(p) and ta.get_comm_dtype(p) == torch.bfloat16
    for p in net.norm.parameters():
        assert not ta.has_comm_dtype(p) and ta.get_comm_dtype(p) == torch.float32
    assert ta.sort_dtypes(ta.get_all_comm_dtypes(net.parameters())) == [
        torch.bfloat16,
        torch.float32,
    ]
    assert not any(hasattr(p, "autocast_dtype") for p in net.parameters())


def test_init_with_custom_module_list() -> None:
    net = Net()
    ta.init_autocast_params(net, torch.float16, ["torch.nn.LayerNorm"])
    assert ta.get_comm_dtype(net.norm.weight) == torch.float16
    assert ta.get_comm_dtype(net.fc.weight) == torch.float32


def test_init_rejects_unknown_module_names() -> None:
    with pytest.raises(ValueError, match="torch.nn.Nope"):
        ta.init_autocast_params(Net(), torch.bfloat16, ["torch.nn.Nope"])
    with pytest.raises(ValueError, match="not an nn.Module"):
        ta.init_autocast_params(Net(), torch.bfloat16, ["torch.float32"])


def test_init_rejects_native_precision_and_low_precision_params() -> None:
    engine = SimpleNamespace(
        module=Net(), fp16_enabled=lambda: True, bfloat16_enabled=lambda: False
    )
    with pytest.raises(ValueError, match="fp16"):
        ta.init_autocast_params(engine, torch.bfloat16, None)
    with pytest.raises(ValueError, match="fp32 parameters"):
        ta.init_autocast_params(Net().to(torch.bfloat16), torch.bfloat16, None)
    assert not ta.is_autocast_initialized()


def _matmul_dtype() -> torch.dtype:
    return (torch.ones(2, 2) @ torch.ones(2, 2)).dtype


def test_enabled_runs_forward_under_autocast() -> None:
    with ta.autocast_if_enabled(True, torch.bfloat16, "cpu"):
        assert _matmul_dtype() == torch.bfloat16
    assert _matmul_dtype() == torch.float32


def test_enabled_overrides_outer_dtype_and_logs_once(log_records) -> None:
    with torch.autocast("cpu", dtype=torch.float16):
        for _ in range(2):
            with ta.autocast_if_enabled(True, torch.bfloat16, "cpu"):
                assert _matmul_dtype() == torch.bfloat16
        assert _matmul_dtype() == torch.float16
    infos = log_records.messages(logging.INFO)
    assert len(infos) == 1 and "overrides" in infos[0]


def test_same_dtype_nesting_is_silent(log_records) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with ta.autocast_if_enabled(True, torch.bfloat16, "cpu"):
            assert _matmul_dtype() == torch.bfloat16
    assert log_records.messages() == []


def test_disabled_with_native_precision_turns_outer_autocast_off(log_records) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for _ in range(2):
            with ta.autocast_if_enabled(False, None, "cpu"):
                assert _matmul_dtype() == torch.float32
        assert _matmul_dtype() == torch.bfloat16
    warnings = log_records.messages(logging.WARNING)
    assert len(warnings) == 1 and "disabled inside forward" in warnings[0]


def test_disabled_fp32_leaves_outer_context_alone(log_records) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with ta.autocast_if_enabled(False, None, "cpu", native_low_precision=False):
            assert _matmul_dtype() == torch.bfloat16
    with ta.autocast_if_enabled(False, None, "cpu"):
        assert _matmul_dtype() == torch.float32
    assert log_records.messages() == []
