"""``init_compression`` and ``redundancy_clean`` (DeepSpeed's ``deepspeed.compression.compress``).

``init_compression(model, config, teacher_model)`` first initialises a layer-reduced student
from its teacher (``layer_reduction``), then swaps every ``Linear`` / ``Conv2d`` / ``Embedding``
for its compression-aware version and configures the techniques of the groups that name it. The
techniques stay off until the scheduler (:mod:`shardspeed.compression.scheduler`, stepped by the
engine) reaches their ``schedule_offset``.

``redundancy_clean(model, config)`` makes the compression permanent, technique by technique in
DeepSpeed's order: quantized weights are stored quantized, pruned weights zeroed, and where a
group names ``related_modules`` the pruned rows / heads / channels are removed, shrinking the
related layers' input dims (or a Q/K/V projection's rows) to match.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shardspeed.compression.config import TECHNIQUES, CompressionConfigError, get_compression_config
from shardspeed.compression.conv import shrink_batchnorm
from shardspeed.compression.replace import (
    compressed_copy,
    get_module_name,
    is_module_compressible,
    recursive_getattr,
    recursive_setattr,
)
from shardspeed.config.compression import CompressionTrainingConfig
from shardspeed.utils.logging import logger

__all__ = [
    "CompressionItem",
    "get_compress_methods",
    "init_compression",
    "redundancy_clean",
    "student_initialization",
]


@dataclass
class CompressionItem:
    """One group of one technique: the modules each pattern names, their related modules (per
    pattern, per related pattern), and the group's settings merged with the shared ones."""

    technique: str
    group: str
    modules: list[list[str]]
    related: list[list[list[str]]] = field(default_factory=list)
    params: dict[str, Any] = field(default_factory=dict)


def _unwrap(model: Any) -> nn.Module:
    # an engine (or DDP) holds the user's model as ``.module``
    inner = getattr(model, "module", model)
    if not isinstance(inner, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return inner


def get_compress_methods(
    model: nn.Module, config: CompressionTrainingConfig, mpu: Any = None
) -> list[CompressionItem]:
    """The groups of the enabled techniques with the modules they name (DeepSpeed order)."""
    items: list[CompressionItem] = []
    for technique in config.enabled_techniques():
        section = config.technique(technique)
        # unset shared keys (sparse pruning's snip-only dense_ratio) leave the group's value
        shared = section.shared_parameters.model_dump(exclude_none=True)
        taken: set[str] = set()
        for group_name, group in section.different_groups.items():
            modules: list[list[str]] = []
            related: list[list[list[str]]] = []
            for i, pattern in enumerate(group.modules):
                names, taken = get_module_name(group_name, model, pattern, taken, mpu)
                modules.append(names)
                if group.related_modules is not None:
                    related.append(
                        [
                            get_module_name(group_name, model, r, set(), mpu)[0]
                            for r in group.related_modules[i]
                        ]
                    )
            if any(modules):
                params = {**group.params, **shared}
                items.append(CompressionItem(technique, group_name, modules, related, params))
    return items


def _enable_args(technique: str, p: dict[str, Any]) -> tuple[str, tuple[Any, ...]]:
    # the layer method each technique configures, with the group's merged settings
    if technique == "weight_quantization":
        return "enable_weight_quantization", (
            p["start_bits"],
            p["target_bits"],
            p["quantization_period"],
            p["quantization_type"],
            p["quantize_groups"],
            p["rounding"],
        )
    if technique == "activation_quantization":
        return "enable_activation_quantization", (
            p["bits"],
            p["quantization_type"],
            p["range_calibration"],
        )
    if technique == "head_pruning":
        return "enable_head_pruning", (p["dense_ratio"], p["method"], p["num_heads"])
    return f"enable_{technique}", (p["dense_ratio"], p["method"])


def _enable(module: nn.Module, name: str, item: CompressionItem) -> None:
    method, args = _enable_args(item.technique, item.params)
    if item.technique not in getattr(module, "TECHNIQUES", ()):
        raise CompressionConfigError(
            f"compression_training.{item.technique}.different_groups.{item.group}.modules "
            f"names {name!r} ({type(module).__name__}), which has no {item.technique}: "
            "narrow the pattern"
        )
    getattr(module, method)(*args)


def compression_preparation(
    model: nn.Module, items: list[CompressionItem], mpu: Any = None
) -> nn.Module:
    """Swap every compressible module for its compression-aware version, then configure the
    techniques the items name."""
    for name, module in list(model.named_modules()):
        if name and is_module_compressible(module, mpu):
            replacement = compressed_copy(module)
            if replacement is not None and replacement is not module:
                recursive_setattr(model, name, replacement)
    for item in items:
        for names in item.modules:
            for name in names:
                _enable(recursive_getattr(model, name), name, item)
    return model


def init_compression(
    model: nn.Module,
    deepspeed_config: Any,
    teacher_model: nn.Module | None = None,
    mpu: Any = None,
) -> nn.Module:
    """Make ``model`` compression-aware as ``deepspeed_config``'s ``compression_training`` says
    (a dict or a JSON path); call it before ``shardspeed.initialize``. Returns ``model``."""
    config = get_compression_config(deepspeed_config)
    inner = _unwrap(model)
    if config.layer_reduction.enabled:
        if teacher_model is None:
            raise CompressionConfigError(
                "compression_training.layer_reduction is enabled but no teacher_model was "
                "given: pass init_compression(model, config, teacher_model=teacher)"
            )
        student_initialization(inner, _unwrap(teacher_model), config)
    compression_preparation(inner, get_compress_methods(inner, config, mpu), mpu)
    return model


def _fix(
    model: nn.Module,
    name: str,
    item: CompressionItem,
    mask: torch.Tensor | None = None,
    dim_reduction: bool = False,
) -> torch.Tensor | None:
    module = recursive_getattr(model, name)
    technique = item.technique
    if technique == "weight_quantization":
        module.fix_weight_quantization()
    elif technique == "sparse_pruning":
        module.fix_sparse_pruning_helper()
    elif technique == "row_pruning":
        return module.fix_row_col_pruning_helper(mask, dim_reduction=dim_reduction)  # type: ignore[no-any-return]
    elif technique == "head_pruning":
        return module.fix_head_pruning_helper(  # type: ignore[no-any-return]
            mask, item.params["num_heads"], dim_reduction=dim_reduction
        )
    elif technique == "channel_pruning":
        if isinstance(module, nn.BatchNorm2d):
            if mask is not None:
                shrink_batchnorm(module, mask)
            return None
        return module.fix_channel_pruning_helper(mask, dim_reduction=dim_reduction)  # type: ignore[no-any-return]
    return None  # activation quantization stays in the forward


def redundancy_clean(model: nn.Module, deepspeed_config: Any, mpu: Any = None) -> nn.Module:
    """Make the configured compression permanent (see the module docs); returns ``model``."""
    config = get_compression_config(deepspeed_config)
    inner = _unwrap(model)
    items = sorted(
        get_compress_methods(inner, config, mpu), key=lambda i: TECHNIQUES.index(i.technique)
    )
    for item in items:
        shrink = bool(item.related)
        for i, names in enumerate(item.modules):
            masks = [_fix(inner, name, item, dim_reduction=shrink) for name in names]
            if not shrink:
                continue
            for related_names in item.related[i]:
                if len(related_names) != len(masks):
                    raise CompressionConfigError(
                        f"compression_training.{item.technique}.different_groups.{item.group}: "
                        f"a related_modules pattern matches {len(related_names)} modules but the "
                        f"modules pattern matches {len(masks)}; they pair one to one"
                    )
                for name, mask in zip(related_names, masks, strict=True):
                    if mask is not None:
                        _fix(inner, name, item, mask=mask, dim_reduction=True)
    return model


def student_initialization(
    student_model: nn.Module, teacher_model: nn.Module, deepspeed_config: Any
) -> None:
    """Copy the teacher's ``teacher_layer`` layers into the student's layers 0, 1, ... and the
    ``other_module_name`` modules (embeddings, final norm, head) into the student's."""
    reduction = get_compression_config(deepspeed_config).layer_reduction
    prefix = reduction.module_name_prefix
    pairs = [(f"{prefix}.{s}", f"{prefix}.{t}") for s, t in enumerate(reduction.teacher_layer)]
    pairs += [(name, name) for name in reduction.other_module_name]
    for student_name, teacher_name in pairs:
        try:
            student_part = student_model.get_submodule(student_name)
            teacher_part = teacher_model.get_submodule(teacher_name)
        except AttributeError as exc:
            raise CompressionConfigError(
                f"compression_training.layer_reduction: {exc}; check module_name_prefix, "
                "teacher_layer and other_module_name against the models' module names"
            ) from None
        try:
            student_part.load_state_dict(teacher_part.state_dict())
        except RuntimeError as exc:
            raise CompressionConfigError(
                f"compression_training.layer_reduction: student {student_name!r} and teacher "
                f"{teacher_name!r} differ in shape: {exc}"
            ) from None
    logger.info(
        f"layer_reduction: student layers 0..{len(reduction.teacher_layer) - 1} from teacher "
        f"layers {reduction.teacher_layer}, and {reduction.other_module_name}"
    )
