"""Helpers DeepSpeed code calls to find MoE layers and give expert parameters their own
optimizer groups (``deepspeed.moe.utils``)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn

from shardspeed.moe.layer import MoE

ParamGroup = dict[str, Any]
DEFAULT_MAX_GROUP_SIZE = 178956971


def has_moe_layers(m: nn.Module) -> tuple[bool, int]:
    """``(True, num_experts of the first MoE layer)`` if ``m`` holds an ``MoE``, else ``(False, 0)``."""
    for module in m.modules():
        if isinstance(module, MoE):
            return True, module.num_experts
    return False, 0


def is_moe_param(param: torch.Tensor) -> bool:
    """An expert parameter: one ``Experts`` marked ``allreduce = False``."""
    return hasattr(param, "allreduce") and not param.allreduce


def split_params_into_shared_and_expert_params(
    params: list[nn.Parameter],
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(shared, expert)`` parameters, order kept."""
    shared = [p for p in params if not is_moe_param(p)]
    expert = [p for p in params if is_moe_param(p)]
    return shared, expert


def split_params_grads_into_shared_and_expert_params(
    group: list[nn.Parameter],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``(shared grads, expert grads)`` of the parameters that have a gradient, each in its
    parameter's dtype (for norms where expert gradients are counted once)."""
    shared: list[torch.Tensor] = []
    expert: list[torch.Tensor] = []
    for p in group:
        if p.grad is not None:
            (expert if is_moe_param(p) else shared).append(p.grad.to(p.dtype))
    return shared, expert


def is_moe_param_group(param_group: ParamGroup) -> bool:
    return bool(param_group.get("moe", False))


def _chunk_by_size(
    params: list[nn.Parameter], max_group_size: int | float
) -> list[list[nn.Parameter]]:
    chunks: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    size = 0
    for param in params:
        if size + param.numel() <= max_group_size:
            current.append(param)
            size += param.numel()
        else:
            chunks.append(current)
            current, size = [param], param.numel()
    if current:
        chunks.append(current)
    return chunks


def split_params_into_different_moe_groups_for_optimizer(
    param_groups: ParamGroup | tuple[ParamGroup, ...] | list[ParamGroup],
    max_group_size: int | float | None = DEFAULT_MAX_GROUP_SIZE,
) -> list[ParamGroup]:
    """Move expert parameters out of each named group into new groups, one per (group, expert
    group name), marked ``moe: True`` and named after the expert group; each new group keeps the
    original group's options and is cut into pieces of at most ``max_group_size`` elements.

    Every input group needs a ``name``. Lists are edited in place, as DeepSpeed does.
    """
    if isinstance(param_groups, tuple):
        groups = list(param_groups)
    elif isinstance(param_groups, dict):
        groups = [param_groups]
    elif isinstance(param_groups, list):
        groups = param_groups
    else:
        raise ValueError(f"Unknown param group type of {type(param_groups)}")

    expert_group_names = {p.group_name for g in groups for p in g["params"] if is_moe_param(p)}
    moe_groups: dict[str, dict[str, ParamGroup]] = defaultdict(dict)
    for group in groups:
        if expert_group_names and "name" not in group:
            raise ValueError("every parameter group needs a 'name' to split out its MoE parameters")
        for key in sorted(expert_group_names):
            moe_groups[group["name"]][key] = {**group, "name": key, "moe": True, "params": []}

    for group in groups:
        shared: list[nn.Parameter] = []
        for param in group["params"]:
            if is_moe_param(param):
                moe_groups[group["name"]][param.group_name]["params"].append(param)
            else:
                shared.append(param)
        group["params"] = shared

    for by_name in moe_groups.values():
        for moe_group in by_name.values():
            if max_group_size is None:
                groups.append(moe_group)
                continue
            for chunk in _chunk_by_size(moe_group["params"], max_group_size):
                groups.append({**moe_group, "params": chunk})
    return groups


def configure_moe_param_groups(model_parameters: list[Any]) -> list[ParamGroup]:
    """Optimizer-ready groups for a model with MoE layers, from a list of parameters (grouped as
    ``dense-params``) or of parameter groups (returned as they are if MoE groups exist)."""
    if not isinstance(model_parameters, list):
        raise TypeError("model_parameters must be a list")
    for p in model_parameters:
        if not isinstance(p, (torch.Tensor, dict)):
            raise TypeError(
                "param argument that would be given to the optimizer should be "
                f"an iterable of Tensors or dicts, but got {type(p)}"
            )
    if not model_parameters:
        return []
    first = model_parameters[0]
    if isinstance(first, torch.Tensor):
        return split_params_into_different_moe_groups_for_optimizer(
            {"params": model_parameters, "name": "dense-params"}
        )
    if not any("moe" in group for group in model_parameters):
        return split_params_into_different_moe_groups_for_optimizer(model_parameters)
    return model_parameters
