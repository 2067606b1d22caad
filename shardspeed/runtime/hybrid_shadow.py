"""The generation view of a training model: a hook-free copy of its module tree that shares the
(gathered) weights, with PEFT LoRA adapters fused into plain linears.

The hybrid engine generates through this view instead of the training model itself, so:

* nothing the ZeRO-3 strategy installed runs per token (its gather/release hooks, the guard,
  the whole-forward hooks): the weights are gathered once around the call;
* building the fused decoder, which concatenates the QKV and gate/up projections and makes the
  originals views into the result (:func:`~shardspeed.inference.fused.fuse_linear.fuse_linears`),
  rewires the view's linears, never the trained ones;
* LoRA is fused by computing ``W + scale * B @ A`` into a new tensor of the view (DeepSpeed-Chat's
  ``fuse_lora_weight``); the trained base weight is never written, so there is nothing to unfuse
  and no rounding drift from merging and unmerging in place.

The view costs no copy of any weight other than the fused ones; it lives for one ``generate``.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["fused_lora_linear", "generation_view", "is_lora_layer"]

#: per-module hook registries of ``nn.Module`` that the view starts empty
_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def is_lora_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a PEFT LoRA linear (a base layer plus ``lora_A``/``lora_B``)."""
    return (
        hasattr(module, "get_delta_weight")
        and isinstance(getattr(module, "base_layer", None), nn.Linear)
        and isinstance(getattr(module, "lora_A", None), nn.ModuleDict)
    )


@torch.no_grad()
def fused_lora_linear(module: nn.Module) -> nn.Linear:
    """A plain linear computing what the LoRA layer ``module`` computes in eval mode: its base
    weight plus every active adapter's ``scale * B @ A`` (none when the adapters are disabled
    or already merged into the base)."""
    base: nn.Linear = module.base_layer  # type: ignore[assignment]
    weight = base.weight.detach()
    merged = bool(getattr(module, "merged", False))
    if not merged and not getattr(module, "disable_adapters", False):
        weight = weight.clone()
        for name in getattr(module, "active_adapters", []):
            if name in module.lora_A:  # type: ignore[operator]
                delta: torch.Tensor = module.get_delta_weight(name)  # type: ignore[operator]
                weight += delta.to(weight.dtype)
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=base.bias is not None, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if base.bias is not None:
        fused.bias = nn.Parameter(base.bias.detach(), requires_grad=False)
    return fused


def generation_view(
    root: nn.Module, replace: Callable[[nn.Module], nn.Module | None] | None = None
) -> nn.Module:
    """A copy of ``root``'s module tree without hooks, in eval mode, whose parameters are
    detached aliases of ``root``'s (tied parameters stay tied) and whose buffers are ``root``'s.
    ``replace(module)`` may give a module to stand for ``module`` (and its subtree) in the view.
    Call it while the parameters are gathered: the view keeps the storage they have now."""
    modules: dict[int, nn.Module] = {}
    params: dict[int, nn.Parameter] = {}

    def alias(param: nn.Parameter | None) -> nn.Parameter | None:
        if param is None:
            return None
        if id(param) not in params:
            params[id(param)] = nn.Parameter(param.detach(), requires_grad=False)
        return params[id(param)]

    def visit(module: nn.Module) -> nn.Module:
        if id(module) in modules:  # a module reached twice stays one module
            return modules[id(module)]
        stand_in = replace(module) if replace is not None else None
        if stand_in is not None:
            modules[id(module)] = stand_in
            return stand_in
        view = copy.copy(module)  # a new object whose __dict__ is a shallow copy of module's
        modules[id(module)] = view
        state: dict[str, Any] = view.__dict__
        for name in _HOOK_DICTS:
            if name in state:
                state[name] = OrderedDict()
        state["_parameters"] = {k: alias(p) for k, p in module._parameters.items()}
        state["_buffers"] = dict(module._buffers)
        state["_non_persistent_buffers_set"] = set(module._non_persistent_buffers_set)
        state["_modules"] = {
            k: None if child is None else visit(child) for k, child in module._modules.items()
        }
        state["training"] = False
        return view

    return visit(root)


def lora_replacement(module: nn.Module) -> nn.Module | None:
    """``replace`` for :func:`generation_view` that fuses PEFT LoRA layers."""
    return fused_lora_linear(module) if is_lora_layer(module) else None


def count_lora_layers(root: nn.Module) -> int:
    """How many PEFT LoRA linears ``root`` holds."""
    return sum(1 for module in root.modules() if is_lora_layer(module))


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside a PEFT wrapper (``model`` itself otherwise)."""
    getter = getattr(model, "get_base_model", None)
    inner = getter() if callable(getter) else model
    return inner if isinstance(inner, nn.Module) else model
