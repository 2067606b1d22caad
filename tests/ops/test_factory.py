"""build_optimizer: DeepSpeed's config names, torch.optim fallback, and errors that help."""

from __future__ import annotations

import pytest
import torch

from shardspeed.ops.adagrad import DeepSpeedCPUAdagrad
from shardspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from shardspeed.ops.factory import build_optimizer, valid_optimizer_names
from shardspeed.ops.lamb import FusedLamb
from shardspeed.ops.lion import DeepSpeedCPULion, FusedLion


def params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(3))]


@pytest.mark.parametrize("name", ["Adam", "adam", "ADAM"])
def test_adam_type_is_adamw_by_default(name: str) -> None:
    opt = build_optimizer(name, params(), {"lr": 0.1})
    assert type(opt) is FusedAdam and opt.adam_w_mode is True
    assert opt.defaults["lr"] == 0.1


def test_adam_w_mode_false_gives_adam_and_config_is_untouched() -> None:
    config = {"lr": 0.1, "adam_w_mode": False}
    opt = build_optimizer("Adam", params(), config)
    assert type(opt) is FusedAdam and opt.adam_w_mode is False
    assert config == {"lr": 0.1, "adam_w_mode": False}


def test_adamw_type_is_always_adamw() -> None:
    opt = build_optimizer("AdamW", params(), {"adam_w_mode": False})
    assert type(opt) is FusedAdam and opt.adam_w_mode is True


@pytest.mark.parametrize(
    ("name", "extra", "cls"),
    [
        ("adam", {}, torch.optim.AdamW),
        ("adam", {"adam_w_mode": False}, torch.optim.Adam),
        ("adamw", {"adam_w_mode": False}, torch.optim.AdamW),
    ],
)
def test_torch_adam(name: str, extra: dict, cls: type) -> None:
    opt = build_optimizer(name, params(), {"torch_adam": True, "lr": 0.1, **extra})
    assert type(opt) is cls


@pytest.mark.parametrize(
    ("name", "offload", "cls"),
    [
        ("adam", True, DeepSpeedCPUAdam),
        ("lamb", False, FusedLamb),
        ("Lion", False, FusedLion),
        ("lion", True, DeepSpeedCPULion),
        ("adagrad", False, torch.optim.Adagrad),
        ("Adagrad", True, DeepSpeedCPUAdagrad),
        ("SGD", False, torch.optim.SGD),
        ("sgd", False, torch.optim.SGD),
        ("RMSprop", False, torch.optim.RMSprop),
        ("rmsprop", True, torch.optim.RMSprop),
    ],
)
def test_names_map_to_classes(name: str, offload: bool, cls: type) -> None:
    assert type(build_optimizer(name, params(), {"lr": 0.1}, cpu_offload=offload)) is cls


def test_cpu_adam_keeps_adam_mode() -> None:
    opt = build_optimizer("adam", params(), {"adam_w_mode": False}, cpu_offload=True)
    assert type(opt) is DeepSpeedCPUAdam and opt.adamw_mode is False


@pytest.mark.parametrize("name", ["MuAdam", "MuAdamW", "musgd"])
def test_not_yet_supported(name: str) -> None:
    with pytest.raises(ValueError, match="not yet supported in shardspeed"):
        build_optimizer(name, params(), {})


@pytest.mark.parametrize(
    ("name", "cls"),
    [("OneBitAdam", "OnebitAdam"), ("zerooneadam", "ZeroOneAdam"), ("onebitlamb", "OnebitLamb")],
)
def test_onebit_names_build(name: str, cls: str) -> None:
    assert type(build_optimizer(name, params(), {"lr": 1e-3})).__name__ == cls


def test_unknown_name_suggests_closest() -> None:
    with pytest.raises(ValueError, match=r"unknown optimizer type 'Adamm'.*Did you mean 'adam'"):
        build_optimizer("Adamm", params(), {})
    with pytest.raises(ValueError, match="Valid types"):
        build_optimizer("zzzz", params(), {})


@pytest.mark.parametrize(
    ("name", "owner"),
    [("adam", "FusedAdam"), ("lamb", "FusedLamb"), ("sgd", "SGD"), ("lion", "FusedLion")],
)
def test_bad_param_names_optimizer_and_suggestion(name: str, owner: str) -> None:
    with pytest.raises(ValueError, match=rf"{owner}.*'lrr'.*Did you mean 'lr'.*Valid parameters"):
        build_optimizer(name, params(), {"lrr": 0.1})


def test_max_grad_norm_points_to_gradient_clipping() -> None:
    with pytest.raises(ValueError, match="gradient_clipping"):
        build_optimizer("adam", params(), {"max_grad_norm": 1.0})


def test_valid_names_lists_deepspeed_then_torch() -> None:
    names = valid_optimizer_names()
    assert names[:2] == ["adagrad", "adam"] and "SGD" in names
    # DeepSpeed's Muon (with its auxiliary AdamW) shadows torch.optim.Muon
    assert [n.lower() for n in names].count("muon") == 1 and "Muon" not in names
