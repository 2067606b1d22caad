"""Before their freeze point the 1-bit optimizers are Adam / LAMB step for step; bad arguments
are refused naming the key."""

from __future__ import annotations

import copy

import pytest
import torch

from shardspeed.ops.factory import build_optimizer
from shardspeed.ops.lamb import FusedLamb
from shardspeed.runtime.fp16.onebit import OnebitAdam, OnebitLamb, ZeroOneAdam


def _params() -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(*s, generator=gen)) for s in ((7, 5), (5,), (3, 3))]


def _run(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], steps: int) -> list:
    gen = torch.Generator().manual_seed(1)
    history = []
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        optimizer.step()
        history.append([p.detach().clone() for p in params])
    return history


def _assert_same(a: list, b: list) -> None:
    for step_a, step_b in zip(a, b, strict=True):
        for x, y in zip(step_a, step_b, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


ARGS = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-6, "weight_decay": 0.01}


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: OnebitAdam(ps, freeze_step=1000, **ARGS),
        lambda ps: ZeroOneAdam(ps, var_freeze_step=1000, var_update_scaler=1000, **ARGS),
    ],
    ids=["OnebitAdam", "ZeroOneAdam"],
)
def test_adam_warmup_equals_torch_adamw(make):
    ours, theirs = _params(), _params()
    reference = torch.optim.AdamW(theirs, foreach=False, **ARGS)
    _assert_same(_run(make(ours), ours, 20), _run(reference, theirs, 20))


def test_lamb_warmup_equals_fused_lamb():
    ours, theirs = _params(), _params()
    onebit = OnebitLamb(ours, freeze_step=1000, **ARGS)
    reference = FusedLamb(theirs, **ARGS)
    _assert_same(_run(onebit, ours, 20), _run(reference, theirs, 20))
    assert onebit.get_lamb_coeffs() == pytest.approx(reference.get_lamb_coeffs(), rel=1e-6)


def test_freeze_flags_and_engine_hook_on_one_rank():
    params = _params()
    adam = OnebitAdam(params, freeze_step=3, **ARGS)
    flags = []
    for _ in range(5):
        flags.append(adam.needs_gradient_allreduce)
        _run(adam, params, 1)
    assert flags == [True, True, True, False, False]
    zo = ZeroOneAdam(_params(), var_freeze_step=100, var_update_scaler=2, **ARGS)
    zo_flags = []
    for _ in range(8):
        zo_flags.append(zo.needs_gradient_allreduce)
        _run(zo, [p for g in zo.param_groups for p in g["params"]], 1)
    # the variance interval doubles after every 2 updates: steps 1, 2, 4, 6, 8 ... update it
    assert zo_flags == [True, True, False, True, False, True, False, True]


@pytest.mark.parametrize(
    ("kind", "params", "key"),
    [
        ("OneBitAdam", {"freeze_step": 0}, "freeze_step"),
        ("OneBitAdam", {"freeze_step": 1.5}, "freeze_step"),
        ("OneBitAdam", {"amsgrad": True}, "amsgrad"),
        ("OneBitAdam", {"comm_backend_name": "gloo2"}, "comm_backend_name"),
        ("OneBitAdam", {"lr": -1.0}, "lr"),
        ("OneBitAdam", {"betas": (0.9, 1.5)}, "betas"),
        ("ZeroOneAdam", {"var_update_scaler": 0}, "var_update_scaler"),
        ("ZeroOneAdam", {"local_step_clipper": -2}, "local_step_clipper"),
        ("ZeroOneAdam", {"local_step_scaler": "x"}, "local_step_scaler"),
        ("OneBitLamb", {"coeff_beta": 1.5}, "coeff_beta"),
        ("OneBitLamb", {"factor_min": 2.0, "factor_max": 1.0}, "factor_max"),
        ("OneBitLamb", {"factor_threshold": -0.1}, "factor_threshold"),
        ("onebitlamb", {"max_coeff": 0.001}, "max_coeff"),
        ("OneBitAdam", {"frezee_step": 3}, "freeze_step"),  # typo: the hint names the key
    ],
)
def test_bad_values_name_the_key(kind, params, key):
    with pytest.raises(ValueError, match=key) as caught:
        build_optimizer(kind, _params(), params)
    if key != "freeze_step" or "frezee" not in str(params):
        assert isinstance(caught.value, AssertionError)  # as DeepSpeed's asserts


def test_state_dict_round_trip_on_one_rank():
    params = _params()
    adam = OnebitAdam(params, freeze_step=2, **ARGS)
    _run(adam, params, 4)  # frozen: error buffers exist
    saved = copy.deepcopy(adam.state_dict())
    assert "worker_error" not in saved["state"][0]
    assert saved["param_groups"][0]["onebit"]["extra"] == {"adam_freeze_key": True}
    restored_params = [p.detach().clone().requires_grad_() for p in params]
    restored = OnebitAdam(restored_params, freeze_step=2, **ARGS)
    restored.load_state_dict(saved)
    assert restored.adam_freeze_key and "onebit" not in restored.param_groups[0]
    _assert_same(_run(adam, params, 3), _run(restored, restored_params, 3))
