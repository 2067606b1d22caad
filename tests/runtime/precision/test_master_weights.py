"""MasterWeights: fp32 copies for low-precision models, identity for fp32 ones."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from shardspeed.runtime.precision.master_weights import MasterWeights
from shardspeed.runtime.precision.policy import PrecisionPolicy


def _model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return model.to(dtype)


def _backward(model: torch.nn.Module, scale: float = 1.0) -> None:
    dtype = next(model.parameters()).dtype
    x = torch.randn(3, 4, dtype=dtype)
    (model(x).float().pow(2).sum() * scale).backward()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_masters_are_fp32_leaf_copies(dtype: torch.dtype) -> None:
    model = _model(dtype)
    masters = MasterWeights(model.parameters())
    assert len(masters) == 4 and not masters.is_identity
    for param, master in zip(model.parameters(), masters.master_params, strict=True):
        assert master.dtype == torch.float32
        assert master.is_leaf and not master.requires_grad
        assert master.data_ptr() != param.data_ptr()
        assert torch.equal(master, param.float())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_grads_are_cast_and_unscaled(dtype: torch.dtype) -> None:
    model = _model(dtype)
    model[2].bias.requires_grad_(False)  # a frozen parameter keeps master.grad None
    masters = MasterWeights(model.parameters())
    _backward(model, scale=64.0)
    masters.copy_grads_to_master(inv_scale=1 / 64)
    for param, master in zip(model.parameters(), masters.master_params, strict=True):
        if param.grad is None:
            assert master.grad is None
            continue
        assert master.grad.dtype == torch.float32
        torch.testing.assert_close(master.grad, param.grad.float() / 64)
    assert len(masters.master_grads()) == 3


def test_grad_buffers_are_reused_and_cleared() -> None:
    model = _model(torch.bfloat16)
    masters = MasterWeights(model.parameters())
    _backward(model)
    masters.copy_grads_to_master()
    buffer = masters.master_params[0].grad
    _backward(model)
    masters.copy_grads_to_master()
    assert masters.master_params[0].grad is buffer
    model.zero_grad(set_to_none=True)
    masters.copy_grads_to_master()
    assert all(m.grad is None for m in masters.master_params)


def test_master_to_model_copy_casts_in_place() -> None:
    model = _model(torch.float16)
    masters = MasterWeights(model.parameters())
    pointers = [p.data_ptr() for p in model.parameters()]
    for master in masters.master_params:
        master.fill_(0.5)
    masters.copy_master_to_model()
    for param, ptr in zip(model.parameters(), pointers, strict=True):
        assert param.dtype == torch.float16 and param.data_ptr() == ptr
        assert torch.all(param == 0.5)


def test_rebind_keeps_hyperparameters_and_adamw_updates_the_model() -> None:
    model = _model(torch.bfloat16)
    optimizer = torch.optim.AdamW(
        [
            {"params": list(model[0].parameters()), "lr": 0.1, "weight_decay": 0.0},
            {"params": list(model[2].parameters()), "lr": 0.01},
        ],
        betas=(0.8, 0.9),
    )
    masters = MasterWeights(model.parameters())
    masters.rebind_optimizer(optimizer)
    groups = optimizer.param_groups
    assert [g["lr"] for g in groups] == [0.1, 0.01]
    assert groups[0]["weight_decay"] == 0.0 and groups[1]["betas"] == (0.8, 0.9)
    assert groups[0]["params"][0] is masters.master_params[0]
    assert groups[1]["params"][1] is masters.master_params[3]

    before = [p.detach().clone() for p in model.parameters()]
    _backward(model)
    masters.copy_grads_to_master()
    optimizer.step()
    masters.copy_master_to_model()
    for old, param, master in zip(before, model.parameters(), masters.master_params, strict=True):
        assert not torch.equal(old, param)
        assert torch.equal(param, master.to(torch.bfloat16))
    # The optimizer state is keyed by the masters, never by the bf16 model parameters.
    assert set(map(id, optimizer.state)) == set(map(id, masters.master_params))


def test_rebind_refuses_an_optimizer_with_state() -> None:
    model = _model(torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _backward(model)
    optimizer.step()
    bf16_model = model.to(torch.bfloat16)
    masters = MasterWeights(bf16_model.parameters())
    with pytest.raises(ValueError, match="before the first optimizer step"):
        masters.rebind_optimizer(optimizer)


def test_rebind_refuses_foreign_parameters() -> None:
    model = _model(torch.float16)
    stranger = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.SGD([*model.parameters(), stranger], lr=0.1)
    with pytest.raises(ValueError, match="not one of the model parameters"):
        MasterWeights(model.parameters()).rebind_optimizer(optimizer)


def test_identity_for_fp32_policy() -> None:
    model = _model(torch.float32)
    policy = PrecisionPolicy.from_sections()
    masters = MasterWeights.from_policy(model.parameters(), policy)
    assert masters.is_identity
    assert all(m is p for m, p in zip(masters.master_params, model.parameters(), strict=True))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    masters.rebind_optimizer(optimizer)
    assert optimizer.param_groups[0]["params"][0] is model[0].weight
    _backward(model, scale=4.0)
    expected = [p.grad.clone() / 4 for p in model.parameters()]
    masters.copy_grads_to_master(0.25)
    for param, grad in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(param.grad, grad)
    masters.copy_master_to_model()  # no-op, must not fail


def test_from_policy_bf16_and_state_dict_round_trip() -> None:
    model = _model(torch.bfloat16)
    policy = PrecisionPolicy.from_sections(bf16=SimpleNamespace(enabled=True))
    masters = MasterWeights.from_policy(model.parameters(), policy)
    assert not masters.is_identity
    for master in masters.master_params:
        master.add_(1.0)
    state = masters.state_dict()
    fresh = MasterWeights(_model(torch.bfloat16).parameters())
    fresh.load_state_dict(state)
    for a, b in zip(fresh.master_params, masters.master_params, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="master parameters"):
        fresh.load_state_dict({"master_params": state["master_params"][:1]})


def test_a_parameter_listed_twice_gets_one_master() -> None:
    model = _model(torch.float16)
    params = list(model.parameters())
    masters = MasterWeights([*params, params[0]])
    assert len(masters) == len(params)
