"""DeepSpeed's module-level names of ``runtime.lr_schedules`` and two behaviours its tests rely on:
``WarmupCosineLR.get_lr_ratio()`` is a float, and ``OneCycle`` takes ``cycle_second_step_size=0``.
"""

from __future__ import annotations

import math

import pytest
import torch

from shardspeed.runtime import lr_schedules
from shardspeed.runtime.lr_schedules import OneCycle, WarmupCosineLR

# every string constant deepspeed/runtime/lr_schedules.py defines at module level, with its value
DEEPSPEED_CONSTANTS = {
    "LR_SCHEDULE": "lr_schedule",
    "LR_RANGE_TEST": "LRRangeTest",
    "ONE_CYCLE": "OneCycle",
    "WARMUP_LR": "WarmupLR",
    "WARMUP_DECAY_LR": "WarmupDecayLR",
    "WARMUP_COSINE_LR": "WarmupCosineLR",
    "LR_RANGE_TEST_MIN_LR": "lr_range_test_min_lr",
    "LR_RANGE_TEST_STEP_RATE": "lr_range_test_step_rate",
    "LR_RANGE_TEST_STEP_SIZE": "lr_range_test_step_size",
    "LR_RANGE_TEST_STAIRCASE": "lr_range_test_staircase",
    "EDGE_VALUE": "edge_value",
    "MID_VALUE": "mid_value",
    "CYCLE_FIRST_STEP_SIZE": "cycle_first_step_size",
    "CYCLE_FIRST_STAIR_COUNT": "cycle_first_stair_count",
    "CYCLE_SECOND_STEP_SIZE": "cycle_second_step_size",
    "CYCLE_SECOND_STAIR_COUNT": "cycle_second_stair_count",
    "DECAY_STEP_SIZE": "decay_step_size",
    "CYCLE_MIN_LR": "cycle_min_lr",
    "CYCLE_MAX_LR": "cycle_max_lr",
    "DECAY_LR_RATE": "decay_lr_rate",
    "CYCLE_MIN_MOM": "cycle_min_mom",
    "CYCLE_MAX_MOM": "cycle_max_mom",
    "DECAY_MOM_RATE": "decay_mom_rate",
    "WARMUP_MIN_LR": "warmup_min_lr",
    "WARMUP_MAX_LR": "warmup_max_lr",
    "WARMUP_NUM_STEPS": "warmup_num_steps",
    "WARMUP_TYPE": "warmup_type",
    "WARMUP_LOG_RATE": "log",
    "WARMUP_LINEAR_RATE": "linear",
    "WARMUP_MIN_RATIO": "warmup_min_ratio",
    "COS_MIN_RATIO": "cos_min_ratio",
    "TOTAL_NUM_STEPS": "total_num_steps",
}


@pytest.mark.parametrize(("name", "value"), sorted(DEEPSPEED_CONSTANTS.items()))
def test_deepspeed_constant(name: str, value: str) -> None:
    assert getattr(lr_schedules, name) == value
    assert name in lr_schedules.__all__  # star-imports get it too


def test_valid_lr_schedules() -> None:
    assert lr_schedules.VALID_LR_SCHEDULES == [
        "LRRangeTest",
        "OneCycle",
        "WarmupLR",
        "WarmupDecayLR",
        "WarmupCosineLR",
    ]


def _sgd(lr: float = 0.1, groups: int = 1) -> torch.optim.SGD:
    params = [{"params": [torch.nn.Parameter(torch.zeros(1))]} for _ in range(groups)]
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def test_warmup_cosine_lr_ratio_is_a_float() -> None:
    sched = WarmupCosineLR(
        _sgd(), total_num_steps=10, warmup_num_steps=4, warmup_type="linear", cos_min_ratio=0.1
    )
    assert sched.get_lr_ratio() == 0.0 and isinstance(sched.get_lr_ratio(), float)
    sched.step(2)  # linear warmup from 0: 2 / 4
    assert isinstance(sched.get_lr_ratio(), float)
    assert sched.get_lr_ratio() == pytest.approx(0.5)
    assert sched.get_lr() == pytest.approx([0.05])
    sched.step(20)  # past the end: the floor ratio
    assert sched.get_lr_ratio() == pytest.approx(0.1)


def test_warmup_cosine_per_group_min_ratio_keeps_per_group_lrs() -> None:
    sched = WarmupCosineLR(
        _sgd(groups=2),
        total_num_steps=10,
        warmup_num_steps=4,
        warmup_type="linear",
        warmup_min_ratio=[0.0, 0.5],
    )
    sched.step(2)
    assert sched.get_lr() == pytest.approx([0.1 * 0.5, 0.1 * 0.75])
    assert sched.get_lr_ratio() == pytest.approx(0.5)  # the first group's


def test_one_cycle_without_a_falling_half() -> None:
    """``cycle_second_step_size=0``: the LR rises for ``first`` batches, then the post-cycle
    phase starts at ``cycle_min_lr`` (DeepSpeed's arithmetic; no division by zero)."""
    opt = _sgd()
    lo, hi, first = 0.01, 0.11, 4
    sched = OneCycle(opt, lo, hi, cycle_first_step_size=first, cycle_second_step_size=0)
    lrs = []
    for i in range(6):
        sched.step(i)
        lrs.append(opt.param_groups[0]["lr"])
    rising = [lo + (hi - lo) * (i + 1) / first for i in range(first - 1)]
    assert lrs[: first - 1] == pytest.approx(rising)
    assert lrs[first - 1 :] == pytest.approx([lo] * 3)  # the cycle is over: min LR, no decay
    assert all(math.isfinite(lr) for lr in lrs)


def test_one_cycle_negative_second_step_size_is_refused() -> None:
    with pytest.raises(ValueError, match="cycle_second_step_size >= 0"):
        OneCycle(_sgd(), 0.01, 0.1, cycle_first_step_size=4, cycle_second_step_size=-1)
