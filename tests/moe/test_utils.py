"""moe.utils on a small model with one MoE layer: detection, marks, optimizer groups."""

from __future__ import annotations

import torch
from torch import nn

from shardspeed.moe import (
    MoE,
    configure_moe_param_groups,
    has_moe_layers,
    is_moe_param,
    split_params_into_different_moe_groups_for_optimizer,
)
from shardspeed.moe.utils import (
    split_params_grads_into_shared_and_expert_params,
    split_params_into_shared_and_expert_params,
)

HIDDEN, EXPERTS = 8, 4


class TinyMoEModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(HIDDEN, HIDDEN)
        self.moe = MoE(HIDDEN, nn.Linear(HIDDEN, HIDDEN), num_experts=EXPERTS, k=2, min_capacity=0)
        self.head = nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, l_aux, _ = self.moe(self.embed(x))
        return self.head(hidden).mean() + 0.01 * l_aux


def _expert_params(model: nn.Module) -> list[nn.Parameter]:
    return [p for n, p in model.named_parameters() if ".deepspeed_experts." in n]


def test_has_moe_layers_and_is_moe_param() -> None:
    model = TinyMoEModel()
    assert has_moe_layers(model) == (True, EXPERTS)
    assert has_moe_layers(nn.Linear(2, 2)) == (False, 0)
    experts = {id(p) for p in _expert_params(model)}
    assert len(experts) == 2 * EXPERTS
    for param in model.parameters():
        assert is_moe_param(param) == (id(param) in experts)


def test_configure_moe_param_groups_from_parameters() -> None:
    model = TinyMoEModel()
    groups = configure_moe_param_groups(list(model.parameters()))
    assert [g["name"] for g in groups] == ["dense-params", "ep_size_1"]
    assert not groups[0].get("moe", False) and groups[1]["moe"] is True
    assert {id(p) for p in groups[1]["params"]} == {id(p) for p in _expert_params(model)}
    assert len(groups[0]["params"]) + len(groups[1]["params"]) == len(list(model.parameters()))
    assert not any(is_moe_param(p) for p in groups[0]["params"])
    optimizer = torch.optim.AdamW(groups, lr=1e-2)
    model(torch.randn(16, HIDDEN)).backward()
    optimizer.step()


def test_split_keeps_group_options_and_chunks_by_size() -> None:
    model = TinyMoEModel()
    group = {"name": "base", "params": list(model.parameters()), "weight_decay": 0.1}
    groups = split_params_into_different_moe_groups_for_optimizer(
        group, max_group_size=HIDDEN * HIDDEN + HIDDEN
    )
    moe_groups = [g for g in groups if g.get("moe")]
    # one expert's weight and bias fill a chunk exactly, so the next expert opens a new one
    assert len(moe_groups) == EXPERTS
    assert all(g["name"] == "ep_size_1" and g["weight_decay"] == 0.1 for g in moe_groups)
    assert sum(len(g["params"]) for g in moe_groups) == 2 * EXPERTS


def test_configure_leaves_existing_moe_groups_alone() -> None:
    model = TinyMoEModel()
    groups = configure_moe_param_groups([{"name": "all", "params": list(model.parameters())}])
    assert configure_moe_param_groups(groups) is groups


def test_split_params_and_grads_into_shared_and_expert() -> None:
    model = TinyMoEModel()
    params = list(model.parameters())
    shared, expert = split_params_into_shared_and_expert_params(params)
    assert {id(p) for p in expert} == {id(p) for p in _expert_params(model)}
    assert len(shared) + len(expert) == len(params)
    model(torch.randn(16, HIDDEN)).backward()
    shared_grads, expert_grads = split_params_grads_into_shared_and_expert_params(params)
    with_grad = [p for p in params if p.grad is not None]
    assert len(shared_grads) + len(expert_grads) == len(with_grad)
    assert len(expert_grads) == len([p for p in with_grad if is_moe_param(p)]) > 0
