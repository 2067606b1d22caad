"""DeepSpeed's LR schedules against their closed-form formulas, written out here step by step."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from shardspeed.runtime.base_optimizer import DeepSpeedOptimizer
from shardspeed.runtime.lr_schedules import (
    VALID_LR_SCHEDULES,
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    add_tuning_arguments,
    get_config_from_args,
    scheduler_from_config,
)


def sgd(groups: int = 1, lr: float = 0.1, momentum: float = 0.9) -> torch.optim.SGD:
    params = [{"params": [torch.nn.Parameter(torch.zeros(2))]} for _ in range(groups)]
    return torch.optim.SGD(params, lr=lr, momentum=momentum)


def adam(groups: int = 1, lr: float = 0.1) -> torch.optim.Adam:
    params = [{"params": [torch.nn.Parameter(torch.zeros(2))]} for _ in range(groups)]
    return torch.optim.Adam(params, lr=lr, betas=(0.9, 0.999))


def lr_at(scheduler, optimizer, iteration: int) -> list[float]:  # noqa: ANN001
    scheduler.step(iteration)
    return [g["lr"] for g in optimizer.param_groups]


# --- WarmupLR / WarmupDecayLR ----------------------------------------------------------------


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_warmup_lr(warmup_type: str) -> None:
    opt = sgd()
    lo, hi, n = 0.01, 0.5, 100
    sched = WarmupLR(
        opt, warmup_min_lr=lo, warmup_max_lr=hi, warmup_num_steps=n, warmup_type=warmup_type
    )
    assert opt.param_groups[0]["lr"] == lo  # applied at construction
    for i in [0, 1, 37, 99, 100, 1000]:
        if i >= n:
            gamma = 1.0
        elif warmup_type == "log":
            gamma = math.log(i + 1) / math.log(n)
        else:
            gamma = i / n
        assert lr_at(sched, opt, i) == pytest.approx([lo + (hi - lo) * gamma])
        assert sched.get_last_lr() == pytest.approx([lo + (hi - lo) * gamma])


def test_warmup_lr_steps_by_one_and_defaults_max_to_group_lr() -> None:
    opt = sgd(groups=2)
    opt.param_groups[1]["lr"] = 0.2
    sched = WarmupLR(opt, warmup_num_steps=10, warmup_type="linear")
    assert sched.max_lrs == [0.1, 0.2]
    for _ in range(6):
        sched.step()
    assert sched.last_batch_iteration == 5
    assert sched.get_last_lr() == pytest.approx([0.05, 0.1])


def test_warmup_per_group_lists() -> None:
    opt = sgd(groups=2)
    sched = WarmupLR(opt, [0.0, 0.1], [1.0, 0.2], warmup_num_steps=4, warmup_type="linear")
    assert lr_at(sched, opt, 2) == pytest.approx([0.5, 0.15])
    with pytest.raises(ValueError, match="expected 2 values for warmup_min_lr"):
        WarmupLR(opt, [0.0, 0.1, 0.2])


def test_warmup_validation() -> None:
    with pytest.raises(ValueError, match="warmup_type"):
        WarmupLR(sgd(), warmup_type="cosine")
    with pytest.raises(ValueError, match="warmup_num_steps"):
        WarmupLR(sgd(), warmup_num_steps=0)


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_warmup_decay_lr(warmup_type: str) -> None:
    opt = sgd()
    lo, hi, n, total = 0.0, 0.4, 10, 50
    sched = WarmupDecayLR(opt, total, lo, hi, n, warmup_type)
    for i in [0, 1, 5, 9]:
        gamma = math.log(i + 1) / math.log(n) if warmup_type == "log" else i / n
        assert lr_at(sched, opt, i) == pytest.approx([lo + hi * gamma])
    for i in [10, 11, 30, 49, 50, 80]:
        gamma = max(0.0, (total - i) / (total - n))
        assert lr_at(sched, opt, i) == pytest.approx([hi * gamma])
    assert lr_at(sched, opt, 10) == pytest.approx([hi])  # end of warmup = peak
    assert lr_at(sched, opt, 50) == pytest.approx([0.0])  # end = min


# --- WarmupCosineLR --------------------------------------------------------------------------


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_warmup_cosine_lr(warmup_type: str) -> None:
    opt = sgd(groups=2)
    opt.param_groups[1]["lr"] = 0.2
    base = [0.1, 0.2]
    n, total, r0, rmin = 10, 60, 0.1, 0.01
    sched = WarmupCosineLR(
        opt,
        total,
        warmup_min_ratio=r0,
        warmup_num_steps=n,
        cos_min_ratio=rmin,
        warmup_type=warmup_type,
    )
    assert [g["lr"] for g in opt.param_groups] == [0.0, 0.0]  # DeepSpeed starts at 0
    for i in [0, 1, 5, 9]:
        f = math.log(i + 1) / math.log(n) if warmup_type == "log" else i / n
        ratio = r0 + (1 - r0) * f
        assert lr_at(sched, opt, i) == pytest.approx([b * ratio for b in base])
    for i in [10, 20, 35, 59, 60, 100]:
        progress = min(1.0, (i - n + 1) / (total - n))
        ratio = rmin + (1 - rmin) * (1 + math.cos(math.pi * progress)) / 2
        assert lr_at(sched, opt, i) == pytest.approx([b * ratio for b in base])
    assert lr_at(sched, opt, 59) == pytest.approx([b * rmin for b in base])  # end = floor


# --- LRRangeTest -----------------------------------------------------------------------------


@pytest.mark.parametrize("staircase", [False, True])
def test_lr_range_test(staircase: bool) -> None:
    opt = sgd(groups=2)
    sched = LRRangeTest(
        opt,
        [0.01, 0.02],
        lr_range_test_step_size=10,
        lr_range_test_step_rate=2.0,
        lr_range_test_staircase=staircase,
    )
    assert [g["lr"] for g in opt.param_groups] == [0.01, 0.02]
    for i in [0, 4, 9, 10, 25]:
        interval = (i + 1) / 10
        if staircase:
            interval = math.floor(interval)
        assert lr_at(sched, opt, i) == pytest.approx(
            [m * (1 + 2.0 * interval) for m in (0.01, 0.02)]
        )


# --- OneCycle --------------------------------------------------------------------------------


def one_cycle_scale(i: int, first: int, second: int) -> float:
    total = first + second
    x = (i + 1) / total - math.floor((i + 1) / total)
    ratio = first / total
    return x / ratio if x <= ratio else (x - 1) / (ratio - 1)


def test_one_cycle_lr_and_momentum_with_sgd() -> None:
    opt = sgd(momentum=0.5)
    lo, hi, first, second = 0.01, 0.1, 10, 20
    sched = OneCycle(
        opt,
        lo,
        hi,
        cycle_first_step_size=first,
        cycle_second_step_size=second,
        cycle_min_mom=0.8,
        cycle_max_mom=0.9,
    )
    assert opt.param_groups[0]["lr"] == lo and opt.param_groups[0]["momentum"] == 0.8
    for i in [0, 4, 8, 9, 15, 28]:
        s = one_cycle_scale(i, first, second)
        assert lr_at(sched, opt, i) == pytest.approx([lo + (hi - lo) * s])
        assert opt.param_groups[0]["momentum"] == pytest.approx(0.9 - 0.1 * s)
    assert lr_at(sched, opt, 9) == pytest.approx([hi])  # peak at the end of the first half
    assert opt.param_groups[0]["momentum"] == pytest.approx(0.8)
    assert lr_at(sched, opt, 29) == pytest.approx([lo])  # back to min at the end


def test_one_cycle_cycles_adam_beta1_and_keeps_beta2() -> None:
    opt = adam()
    sched = OneCycle(
        opt, 0.01, 0.1, cycle_first_step_size=4, cycle_min_mom=0.85, cycle_max_mom=0.95
    )
    assert opt.param_groups[0]["betas"] == (0.85, 0.999)
    sched.step(1)  # scale (1+1)/8 / 0.5 = 0.5
    beta1, beta2 = opt.param_groups[0]["betas"]
    assert beta1 == pytest.approx(0.95 - 0.1 * 0.5) and beta2 == 0.999


def test_one_cycle_decay_phase() -> None:
    opt = adam()
    lo, total, decay_step, rate, mom_rate = 0.01, 20, 5, 0.5, 0.1
    sched = OneCycle(
        opt,
        lo,
        0.1,
        decay_lr_rate=rate,
        cycle_first_step_size=10,
        decay_step_size=decay_step,
        cycle_max_mom=0.9,
        decay_mom_rate=mom_rate,
    )
    for i in [20, 24, 40]:
        d = (i - total + 1) / decay_step
        assert lr_at(sched, opt, i) == pytest.approx([lo / (1 + rate * d)])
        assert opt.param_groups[0]["betas"][0] == pytest.approx(0.9 * (1 + mom_rate * d))
    no_decay = OneCycle(adam(), lo, 0.1, decay_lr_rate=rate, cycle_first_step_size=10)
    no_decay.step(100)
    assert no_decay.get_last_lr() == [lo]


def test_one_cycle_staircase() -> None:
    opt = sgd()
    lo, hi, first, stairs = 0.0, 1.0, 8, 4
    sched = OneCycle(
        opt,
        lo,
        hi,
        cycle_first_step_size=first,
        cycle_first_stair_count=stairs,
        cycle_momentum=False,
    )
    seen = []
    for i in range(2 * first):
        k = (i + 1) % (2 * first)
        offset = k if k <= first else 2 * first - k
        expected = math.floor(offset * stairs / first) / stairs
        seen.append(lr_at(sched, opt, i)[0])
        assert seen[-1] == pytest.approx(expected)
    assert set(seen) == {0.0, 0.25, 0.5, 0.75, 1.0}  # flat stairs, peak reached


def test_one_cycle_per_group_lists_and_no_momentum_optimizer() -> None:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))]} for _ in range(2)]
    opt = torch.optim.Adagrad(groups, lr=0.1)
    sched = OneCycle(opt, [0.01, 0.02], [0.1, 0.2], cycle_first_step_size=2)
    assert sched.cycle_momentum is False
    assert lr_at(sched, opt, 1) == pytest.approx([0.1, 0.2])


# --- state, wrappers and factory -------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("WarmupLR", {"warmup_num_steps": 20}),
        ("WarmupDecayLR", {"total_num_steps": 40, "warmup_num_steps": 10}),
        ("WarmupCosineLR", {"total_num_steps": 40, "warmup_num_steps": 10}),
        ("LRRangeTest", {"lr_range_test_step_size": 5}),
        ("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 8}),
    ],
)
def test_state_dict_round_trip(name: str, params: dict) -> None:
    opt_a = adam()
    a = scheduler_from_config(name, opt_a, params)
    for _ in range(13):
        a.step()
    saved = a.state_dict()
    assert saved == {"last_batch_iteration": 12}
    opt_b = adam()
    b = scheduler_from_config(name, opt_b, params)
    b.load_state_dict(saved)
    for _ in range(7):
        a.step()
        b.step()
        assert b.get_last_lr() == a.get_last_lr()
        assert opt_b.param_groups[0]["betas"] == opt_a.param_groups[0]["betas"]


def test_resume_with_last_batch_iteration_does_not_touch_lr() -> None:
    opt = sgd(lr=0.123)
    sched = WarmupLR(opt, 0.0, 1.0, 10, "linear", last_batch_iteration=4)
    assert opt.param_groups[0]["lr"] == 0.123
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5)


def test_schedules_drive_a_wrapper_and_tensor_lr() -> None:
    inner = adam()
    wrapper = DeepSpeedOptimizer(inner)
    sched = WarmupLR(wrapper, 0.0, 1.0, 10, "linear")
    sched.step(5)
    assert inner.param_groups[0]["lr"] == pytest.approx(0.5)
    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=torch.tensor(0.1))
    lr_tensor = opt.param_groups[0]["lr"]
    WarmupLR(opt, 0.0, 1.0, 10, "linear").step(3)
    assert opt.param_groups[0]["lr"] is lr_tensor and float(lr_tensor) == pytest.approx(0.3)


def test_scheduler_from_config_names_and_errors() -> None:
    assert VALID_LR_SCHEDULES == [
        "LRRangeTest",
        "OneCycle",
        "WarmupLR",
        "WarmupDecayLR",
        "WarmupCosineLR",
    ]
    assert isinstance(scheduler_from_config("warmuplr", sgd(), {}), WarmupLR)
    step_lr = scheduler_from_config("StepLR", DeepSpeedOptimizer(sgd()), {"step_size": 2})
    assert isinstance(step_lr, torch.optim.lr_scheduler.StepLR)
    assert isinstance(
        scheduler_from_config("cosineannealinglr", sgd(), {"T_max": 3}),
        torch.optim.lr_scheduler.CosineAnnealingLR,
    )
    with pytest.raises(ValueError, match="Did you mean 'WarmupLR'"):
        scheduler_from_config("WarmUpLRR", sgd(), {})
    with pytest.raises(ValueError, match=r"'warmup_max_lrr'.*Did you mean 'warmup_max_lr'"):
        scheduler_from_config("WarmupLR", sgd(), {"warmup_max_lrr": 0.1})
    with pytest.raises(ValueError, match="'step_sz'"):
        scheduler_from_config("StepLR", sgd(), {"step_sz": 2})


def test_add_tuning_arguments() -> None:
    parser = add_tuning_arguments(argparse.ArgumentParser())
    args = parser.parse_args(
        [
            "--lr_schedule",
            "WarmupLR",
            "--warmup_num_steps",
            "7",
            "--lr_range_test_staircase",
            "false",
        ]
    )
    assert args.lr_range_test_staircase is False and args.cycle_momentum is False
    config, error = get_config_from_args(args)
    assert error is None
    assert config == {
        "type": "WarmupLR",
        "params": {
            "warmup_min_lr": 0,
            "warmup_max_lr": 0.001,
            "warmup_num_steps": 7,
            "warmup_type": "log",
        },
    }
    sched = scheduler_from_config(config["type"], sgd(), config["params"])
    assert sched.warmup_num_steps == 7
