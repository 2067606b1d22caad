"""MoE layer: forward/backward equals the dense einsum formulation, names, residual, refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardspeed
from shardspeed.moe.layer import MoE
from shardspeed.moe.routing import Routing

HIDDEN, EXPERTS = 8, 4


def _expert() -> nn.Module:
    return nn.Sequential(nn.Linear(HIDDEN, 16), nn.GELU(), nn.Linear(16, HIDDEN))


def _moe(k: int, **kwargs: object) -> MoE:
    torch.manual_seed(0)
    options: dict[str, object] = {
        "use_rts": False,
        "top2_2nd_expert_sampling": False,
        "min_capacity": 0,
    }
    options.update(kwargs)
    return MoE(HIDDEN, _expert(), num_experts=EXPERTS, k=k, **options)  # type: ignore[arg-type]


def _dense_forward(moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSpeed's formulation: dense dispatch mask and combine weights, einsum in and out."""
    layer = moe.deepspeed_moe
    tokens = x.reshape(-1, HIDDEN)
    l_aux, combine, dispatch_mask, _ = layer.gate(tokens)
    buffers = torch.einsum("sec,sm->ecm", dispatch_mask.type_as(tokens), tokens)
    outputs = torch.stack(
        [expert(buffers[e]) for e, expert in enumerate(layer.experts.deepspeed_experts)]
    )
    return torch.einsum("sec,ecm->sm", combine.type_as(tokens), outputs).reshape(x.shape), l_aux


@pytest.mark.parametrize("drop_tokens", [True, False])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_forward_backward_equals_dense_formulation(k: int, drop_tokens: bool) -> None:
    moe = _moe(k, drop_tokens=drop_tokens, capacity_factor=0.75)
    x = torch.randn(2, 6, HIDDEN, generator=torch.Generator().manual_seed(1))
    x_dense = x.clone().requires_grad_(True)
    x.requires_grad_(True)

    output, l_aux, exp_counts = moe(x)
    assert output.shape == x.shape and l_aux.dim() == 0
    assert int(exp_counts.sum()) == 12 * k
    (output.square().sum() + l_aux).backward()
    grads = {name: p.grad.clone() for name, p in moe.named_parameters() if p.grad is not None}
    moe.zero_grad()

    expected, expected_l_aux = _dense_forward(moe, x_dense)
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(l_aux, expected_l_aux)
    (expected.square().sum() + expected_l_aux).backward()
    torch.testing.assert_close(x.grad, x_dense.grad, rtol=1e-5, atol=1e-6)
    for name, param in moe.named_parameters():
        if param.grad is not None:
            torch.testing.assert_close(grads[name], param.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert "deepspeed_moe.gate.wg.weight" in grads


def test_layer_never_builds_dense_capacity_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: Routing) -> torch.Tensor:
        raise AssertionError("MOELayer built the dense tokens x experts x capacity tensor")

    monkeypatch.setattr(Routing, "combine_weights", refuse)
    moe = _moe(2)
    output, _, _ = moe(torch.randn(12, HIDDEN))
    output.sum().backward()


def test_state_dict_names_match_deepspeed() -> None:
    model = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), _moe(1))
    keys = set(model.state_dict())
    assert "1.deepspeed_moe.gate.wg.weight" in keys
    for i in range(EXPERTS):
        assert f"1.deepspeed_moe.experts.deepspeed_experts.{i}.0.weight" in keys
        assert f"1.deepspeed_moe.experts.deepspeed_experts.{i}.2.bias" in keys
    assert model[1].deepspeed_moe.gate.wg.weight.shape == (EXPERTS, HIDDEN)


def test_expert_params_are_marked_for_expert_data_parallel_reduction() -> None:
    moe = _moe(1)
    for name, param in moe.named_parameters():
        if ".deepspeed_experts." in name:
            assert param.allreduce is False and param.group_name == "ep_size_1"
        else:
            assert not hasattr(param, "allreduce")


def test_residual_moe_mixes_dense_branch() -> None:
    moe = _moe(1, use_residual=True)
    assert {"mlp.0.weight", "coefficient.weight", "coefficient.bias"} <= set(moe.state_dict())
    x = torch.randn(10, HIDDEN)
    output, _, _ = moe(x)
    sparse = moe.deepspeed_moe(x)
    coef = torch.softmax(moe.coefficient(x), dim=-1)
    torch.testing.assert_close(output, sparse * coef[:, :1] + moe.mlp(x) * coef[:, 1:])
    output.sum().backward()
    assert moe.coefficient.weight.grad is not None and moe.mlp[0].weight.grad is not None


def test_used_token_leaves_unused_tokens_unrouted() -> None:
    moe = _moe(1, drop_tokens=False)
    x = torch.randn(12, HIDDEN)
    used = torch.ones(12)
    used[:4] = 0
    output, _, exp_counts = moe(x, used)
    assert int(exp_counts.sum()) == 8
    assert torch.equal(output[:4], torch.zeros(4, HIDDEN))


@pytest.mark.parametrize("policy", ["Jitter", "RSample", "None"])
def test_noisy_gate_policies_train_and_eval(policy: str) -> None:
    moe = _moe(1, noisy_gate_policy=policy, use_rts=True)
    x = torch.randn(16, HIDDEN)
    output, l_aux, _ = moe(x)
    (output.sum() + l_aux).backward()
    moe.eval()
    moe.deepspeed_moe.gate.use_rts = False
    with torch.no_grad():
        torch.testing.assert_close(moe(x)[0], moe(x)[0])


def test_refusals() -> None:
    unplaced = MoE(HIDDEN, _expert(), num_experts=EXPERTS, ep_size=2)
    assert len(unplaced.deepspeed_moe.experts.deepspeed_experts) == EXPERTS // 2
    with pytest.raises(RuntimeError, match="no expert-parallel group yet"):
        unplaced(torch.randn(4, HIDDEN))
    with pytest.raises(NotImplementedError, match="enable_expert_tensor_parallelism"):
        MoE(HIDDEN, _expert(), num_experts=EXPERTS, enable_expert_tensor_parallelism=True)
    with pytest.raises(NotImplementedError, match="use_tutel"):
        MoE(HIDDEN, _expert(), num_experts=EXPERTS, use_tutel=True)
    with pytest.raises(ValueError, match="divisible"):
        MoE(HIDDEN, _expert(), num_experts=3, ep_size=2)
    with pytest.raises(ValueError, match="noisy_gate_policy"):
        MoE(HIDDEN, _expert(), num_experts=EXPERTS, noisy_gate_policy="Gaussian")
    with pytest.raises(ValueError, match="k=5"):
        MoE(HIDDEN, _expert(), num_experts=EXPERTS, k=5)


def test_lazy_top_level_name() -> None:
    assert shardspeed.moe.layer.MoE is MoE
