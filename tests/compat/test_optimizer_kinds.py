"""DeepSpeed's optimizer-wrapper names answer isinstance as DeepSpeed's engine would choose."""

from __future__ import annotations

import pytest
import torch

import shardspeed
from shardspeed.runtime.bf16_optimizer import BF16_Optimizer
from shardspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
from shardspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
from shardspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from shardspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from tests.runtime.parity import MLP

KINDS = (
    BF16_Optimizer,
    FP16_Optimizer,
    FP16_UnfusedOptimizer,
    DeepSpeedZeroOptimizer,
    DeepSpeedZeroOptimizer_Stage3,
)


def _kinds_of(precision: str, stage: int, optimizer: str) -> list[str]:
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": optimizer, "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage},
        precision: {"enabled": True},
    }
    engine, optimizer_wrapper, *_ = shardspeed.initialize(model=MLP(width=8), config=config)
    assert optimizer_wrapper is engine.optimizer
    return [kind.__name__ for kind in KINDS if isinstance(engine.optimizer, kind)]


def _all_cases() -> list[list[str]]:
    return [
        _kinds_of("bf16", 0, "Adam"),
        _kinds_of("fp16", 0, "Adam"),
        _kinds_of("fp16", 0, "Lamb"),
        _kinds_of("bf16", 1, "Adam"),
        _kinds_of("fp16", 2, "Adam"),
        _kinds_of("bf16", 3, "Adam"),
    ]


def test_isinstance_follows_deepspeeds_choice(dist_pool) -> None:
    expected = [
        ["BF16_Optimizer"],
        ["FP16_Optimizer"],
        ["FP16_UnfusedOptimizer"],
        ["DeepSpeedZeroOptimizer"],  # ZeRO stages 1-2, whatever the precision
        ["DeepSpeedZeroOptimizer"],
        ["DeepSpeedZeroOptimizer_Stage3"],
    ]
    assert dist_pool(2).run(_all_cases) == [expected, expected]


def test_names_are_not_built_directly() -> None:
    with pytest.raises(TypeError, match="shardspeed.initialize builds the wrapper"):
        BF16_Optimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1))
    assert not isinstance(
        torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1), BF16_Optimizer
    )
    assert issubclass(BF16_Optimizer, BF16_Optimizer) and not issubclass(
        FP16_Optimizer, BF16_Optimizer
    )
    with pytest.raises(TypeError, match="shardspeed.initialize builds the wrapper"):
        DeepSpeedZeroOptimizer_Stage3()
