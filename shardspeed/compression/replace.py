"""Finding and swapping modules: which modules a group's patterns name, the compression-aware
replacement of each ``Linear`` / ``Conv2d`` / ``Embedding``, and ``convert_conv1d_to_linear``
(GPT-2's ``Conv1D`` projections as ``nn.Linear``)."""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from shardspeed.compression.conv import Conv2dLayer_Compress
from shardspeed.compression.layers import Embedding_Compress, LinearLayer_Compress

__all__ = [
    "compressed_copy",
    "convert_conv1d_to_linear",
    "get_module_name",
    "is_module_compressible",
    "recursive_getattr",
    "recursive_setattr",
]


def recursive_getattr(model: nn.Module, module_name: str) -> Any:
    """The submodule (or attribute) at dotted ``module_name``."""
    out: Any = model
    for part in module_name.split("."):
        out = getattr(out, part)
    return out


def recursive_setattr(model: nn.Module, module_name: str, module: Any) -> None:
    """Put ``module`` at dotted ``module_name``."""
    parent, _, leaf = module_name.rpartition(".")
    setattr(recursive_getattr(model, parent) if parent else model, leaf, module)


def is_module_compressible(module: nn.Module, mpu: Any = None) -> bool:
    """Whether compression patterns may name ``module`` (DeepSpeed's four layer kinds)."""
    del mpu  # tensor-parallel layers (mpu.RowParallelLinear, ...) are not replaced here
    return isinstance(module, nn.Linear | nn.Conv2d | nn.Embedding | nn.BatchNorm2d)


def _matches(pattern: str, name: str) -> bool:
    # DeepSpeed's default scope "*" is not a valid regular expression: it means every module
    return pattern == "*" or re.search(pattern, name) is not None


def get_module_name(
    group_name: str,
    model: nn.Module,
    key_word: str,
    exist_module_name: set[str],
    mpu: Any = None,
    verbose: bool = True,
) -> tuple[list[str], set[str]]:
    """The compressible modules whose names ``key_word`` matches, not yet in
    ``exist_module_name`` (which grows). With ``verbose``, a module a previous group of the same
    technique took is an error, as in DeepSpeed."""
    found: list[str] = []
    for name, module in model.named_modules():
        if not name or not is_module_compressible(module, mpu) or not _matches(key_word, name):
            continue
        if name in exist_module_name:
            if verbose:
                raise ValueError(
                    f"module {name!r} is already compressed by another group of this technique; "
                    f"group {group_name!r} matches it again: make the modules patterns disjoint"
                )
            continue
        exist_module_name.add(name)
        found.append(name)
    return found, exist_module_name


def compressed_copy(module: nn.Module) -> nn.Module | None:
    """The compression-aware version of ``module`` sharing its parameters (itself when it
    already is one; None for kinds that are only matched, e.g. ``BatchNorm2d``)."""
    if isinstance(module, LinearLayer_Compress | Conv2dLayer_Compress | Embedding_Compress):
        return module
    if isinstance(module, nn.Linear):
        return LinearLayer_Compress.from_linear(module)
    if isinstance(module, nn.Conv2d):
        return Conv2dLayer_Compress.from_conv(module)
    if isinstance(module, nn.Embedding):
        return Embedding_Compress.from_embedding(module)
    return None


def convert_conv1d_to_linear(model: nn.Module, convert_type: type[nn.Module]) -> nn.Module:
    """Replace every ``convert_type`` module (Hugging Face's ``Conv1D``: ``y = x @ W + b`` with
    ``W`` of shape (in, out)) by the equivalent ``nn.Linear``; returns ``model``."""
    root: nn.Module = getattr(model, "module", model)
    for name, module in list(root.named_modules()):
        if not name or not isinstance(module, convert_type):
            continue
        weight, bias = module.weight, getattr(module, "bias", None)
        assert isinstance(weight, torch.Tensor)
        linear = nn.Linear(
            weight.shape[0],
            weight.shape[1],
            bias=bias is not None,
            device=weight.device,
            dtype=weight.dtype,
        )
        with torch.no_grad():
            linear.weight.copy_(weight.t())
            if bias is not None:
                linear.bias.copy_(bias.reshape(-1))
        linear.weight.requires_grad_(weight.requires_grad)
        recursive_setattr(root, name, linear)
    return model
