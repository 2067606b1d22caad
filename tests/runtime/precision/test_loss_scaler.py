"""Loss scalers: the static scale and DeepSpeed's dynamic update rule, pinned step by step."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from shardspeed.runtime.fp16 import loss_scaler as ds_path
from shardspeed.runtime.precision.loss_scaler import (
    CreateLossScaler,
    DynamicLossScaler,
    StaticLossScaler,
    grad_scaler_like,
    loss_scaler_for_policy,
    loss_scaler_from_config,
)
from shardspeed.runtime.precision.policy import PrecisionPolicy


def _run(scaler: DynamicLossScaler, overflows: str) -> list[float]:
    """Feed a pattern ('.' clean, 'X' overflow) and return the scale after each update."""
    scales = []
    for ch in overflows:
        scaler.update_scale(ch == "X")
        scales.append(scaler.loss_scale)
    return scales


def test_static_scaler_scales_and_never_moves() -> None:
    scaler = StaticLossScaler(128.0)
    loss = torch.tensor(2.0)
    assert scaler.scale_loss(loss).item() == 256.0
    assert scaler.inv_scale == 1 / 128
    scaler.update_scale(True)
    scaler.update_scale(False)
    assert scaler.loss_scale == 128.0
    assert not scaler.dynamic


def test_static_scale_one_returns_the_loss_itself() -> None:
    loss = torch.tensor(3.0, requires_grad=True)
    assert StaticLossScaler(1.0).scale_loss(loss) is loss


def test_static_scaler_rejects_non_positive_scale() -> None:
    with pytest.raises(ValueError, match="loss_scale"):
        StaticLossScaler(0.0)


def test_backward_scales_gradients() -> None:
    w = torch.tensor(1.0, requires_grad=True)
    StaticLossScaler(8.0).backward(w * 3.0)
    assert w.grad.item() == 24.0


def test_doubling_pinned_to_the_window_formula() -> None:
    # stable_interval = (cur_iter - last_overflow_iter) - 1, with last_overflow_iter = -1 at start:
    # update #k (0-based) has stable_interval k, so with window 3 the scale doubles on updates
    # 3 and 6, i.e. after the 4th and 7th clean step.
    scaler = DynamicLossScaler(init_scale=16, scale_window=3)
    assert _run(scaler, ".......") == [16, 16, 16, 32, 32, 32, 64]


def test_doubling_after_overflow_takes_window_plus_one_clean_steps() -> None:
    scaler = DynamicLossScaler(init_scale=16, scale_window=3)
    # Overflow at iteration 0 halves; last_overflow_iter=0, so iterations 1, 2, 3 have stable
    # intervals 0, 1, 2 and iteration 4 (interval 3) doubles; the next doubling is at 7.
    assert _run(scaler, "X......") == [8, 8, 8, 8, 16, 16, 16]
    assert scaler.cur_iter == 7
    assert scaler.last_overflow_iter == 0


def test_hysteresis_delays_halving_and_refills_only_on_growth() -> None:
    scaler = DynamicLossScaler(init_scale=64, scale_window=2, delayed_shift=2)
    scaler.update_scale(True)  # hysteresis 2 -> 1, scale kept
    assert (scaler.loss_scale, scaler.cur_hysteresis) == (64, 1)
    scaler.update_scale(False)  # a clean step does not refill without consecutive_hysteresis
    assert scaler.cur_hysteresis == 1
    scaler.update_scale(True)  # hysteresis exhausted: halve
    assert (scaler.loss_scale, scaler.cur_hysteresis) == (32, 1)
    scaler.update_scale(True)  # stays at 1, so every further overflow halves
    assert scaler.loss_scale == 16
    # Overflow at iter 3; iters 4, 5 are intervals 0, 1; iter 6 (interval 2) doubles and refills.
    assert _run(scaler, "...") == [16, 16, 32]
    assert scaler.cur_hysteresis == 2
    scaler.update_scale(True)
    assert (scaler.loss_scale, scaler.cur_hysteresis) == (32, 1)


def test_consecutive_hysteresis_refills_on_every_clean_step() -> None:
    scaler = DynamicLossScaler(
        init_scale=64, scale_window=100, delayed_shift=2, consecutive_hysteresis=True
    )
    assert _run(scaler, "X.X.X") == [64, 64, 64, 64, 64]
    assert scaler.cur_hysteresis == 1
    assert _run(scaler, "X") == [32]


def test_halving_is_floored_at_min_scale() -> None:
    scaler = DynamicLossScaler(init_scale=6, min_scale=4)
    scaler.update_scale(True)
    assert scaler.loss_scale == 4


def test_overflow_at_min_scale_raises() -> None:
    scaler = DynamicLossScaler(init_scale=8, min_scale=4)
    scaler.update_scale(True)
    assert scaler.loss_scale == 4
    with pytest.raises(Exception, match="already at minimum"):
        scaler.update_scale(True)


def test_overflow_at_min_scale_without_raising_stays_put() -> None:
    scaler = DynamicLossScaler(init_scale=4, min_scale=4, raise_error_at_min_scale=False)
    scaler.update_scale(True)
    assert scaler.loss_scale == 4


def test_overflow_log_line(log_records) -> None:
    scaler = DynamicLossScaler(init_scale=2**16, delayed_shift=2)
    scaler.update_scale(True)
    scaler.update_scale(True)
    messages = log_records.messages(logging.INFO)
    assert messages[0] == (
        "[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, "
        "but hysteresis is 2. Reducing hysteresis to 1"
    )
    assert messages[1] == (
        "[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, reducing to 32768"
    )


def test_overflow_is_logged_on_rank_zero_only(log_records, monkeypatch) -> None:
    monkeypatch.setenv("RANK", "1")
    DynamicLossScaler().update_scale(True)
    assert log_records.messages() == []


def test_dynamic_state_dict_round_trip() -> None:
    scaler = DynamicLossScaler(init_scale=64, scale_window=2, delayed_shift=3)
    _run(scaler, "X.X..")
    state = scaler.state_dict()
    restored = DynamicLossScaler()
    restored.load_state_dict(state)
    assert restored.state_dict() == state
    # The restored scaler continues exactly like the original.
    assert _run(restored, "..X...") == _run(scaler, "..X...")


def test_static_state_dict_round_trip() -> None:
    restored = StaticLossScaler(1.0)
    restored.load_state_dict(StaticLossScaler(512.0).state_dict())
    assert restored.loss_scale == 512.0


def test_dynamic_scaler_validates_arguments() -> None:
    with pytest.raises(ValueError, match="hysteresis"):
        DynamicLossScaler(delayed_shift=0)
    with pytest.raises(ValueError, match="loss_scale_window"):
        DynamicLossScaler(scale_window=0)


def test_factory_dynamic_from_fp16_section() -> None:
    section = SimpleNamespace(
        enabled=True,
        loss_scale=0,
        initial_scale_power=12,
        loss_scale_window=500,
        hysteresis=2,
        consecutive_hysteresis=True,
        min_loss_scale=0.5,
    )
    scaler = loss_scaler_from_config(section)
    assert isinstance(scaler, DynamicLossScaler)
    assert scaler.loss_scale == 2**12
    assert (scaler.scale_window, scaler.delayed_shift, scaler.min_scale) == (500, 2, 0.5)
    assert scaler.consecutive_hysteresis


def test_factory_static_from_fp16_section() -> None:
    scaler = loss_scaler_from_config(SimpleNamespace(enabled=True, loss_scale=1024))
    assert type(scaler) is StaticLossScaler
    assert scaler.loss_scale == 1024


def test_factory_rejects_negative_loss_scale() -> None:
    with pytest.raises(ValueError, match="fp16.loss_scale"):
        loss_scaler_from_config(SimpleNamespace(loss_scale=-1))


def test_scaler_for_policy() -> None:
    bf16 = PrecisionPolicy.from_sections(bf16=SimpleNamespace(enabled=True))
    assert loss_scaler_for_policy(bf16).loss_scale == 1.0
    fp16 = PrecisionPolicy.from_sections(fp16=SimpleNamespace(enabled=True, loss_scale=0))
    assert loss_scaler_for_policy(fp16, SimpleNamespace(loss_scale=0)).dynamic
    autocast16 = PrecisionPolicy.from_sections(
        torch_autocast=SimpleNamespace(enabled=True, dtype="float16")
    )
    scaler = loss_scaler_for_policy(autocast16)
    assert scaler.dynamic and scaler.loss_scale == 2**16
    assert grad_scaler_like().raise_error_at_min_scale is False


def test_deepspeed_import_path_and_create_loss_scaler() -> None:
    assert ds_path.LossScaler is StaticLossScaler
    assert ds_path.DynamicLossScaler is DynamicLossScaler
    dyn = CreateLossScaler(torch.half, 1.0, True, {"init_scale": 2**8, "delayed_shift": 2})
    assert isinstance(dyn, DynamicLossScaler) and dyn.loss_scale == 256 and dyn.delayed_shift == 2
    assert CreateLossScaler(torch.bfloat16, 128.0, True, None).loss_scale == 1.0
    assert CreateLossScaler(torch.half, 128.0, False, None).loss_scale == 128.0
