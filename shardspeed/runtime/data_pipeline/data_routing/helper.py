"""Random-LTD helpers: wrap a model's layers, and strip the wrappers from a state dict."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardspeed.runtime.data_pipeline.data_routing.basic_layer import RandomLayerTokenDrop

__all__ = ["convert_to_random_ltd", "remove_random_ltd_state_dict", "save_without_random_ltd"]

_WRAPPED = ".random_ltd_layer"


def convert_to_random_ltd(model: Any, convert_type: type[nn.Module]) -> Any:
    """Wrap every ``convert_type`` module of ``model`` (an engine or a plain module) in a
    :class:`RandomLayerTokenDrop`, outermost ones only, in module order; then, for an engine,
    let it configure the layers ``random_ltd_layer_id`` names (``engine.random_ltd_initialize``).
    Returns ``model``."""
    root: nn.Module = model.module if hasattr(model, "module") else model
    chosen: list[str] = []
    for name, module in root.named_modules():
        if (
            isinstance(module, convert_type)
            and name
            and not any(name.startswith(outer + ".") for outer in chosen)
        ):
            chosen.append(name)
    for name in chosen:
        parent_name, _, child = name.rpartition(".")
        parent = root.get_submodule(parent_name) if parent_name else root
        setattr(parent, child, RandomLayerTokenDrop(getattr(parent, child)))
    if hasattr(model, "random_ltd_initialize"):
        model.random_ltd_initialize()
    return model


def remove_random_ltd_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state_dict`` with the wrappers' ``.random_ltd_layer`` removed from every key, so it
    loads into the unwrapped model."""
    return {key.replace(_WRAPPED, ""): value for key, value in state_dict.items()}


def save_without_random_ltd(model: Any) -> dict[str, torch.Tensor]:
    """The model's state dict as the unwrapped model names it."""
    root: nn.Module = model.module if hasattr(model, "module") else model
    return remove_random_ltd_state_dict(root.state_dict())
