"""Finding a model's MoE blocks: the preset's (or the config's) names, checked against the
weights' shapes.

A block is a module whose qualified name fully matches ``moe_layer_pattern`` and that has an
experts child holding fused 3-D ``expert_w1``/``expert_w2`` weights and a router child. Blocks
without such experts (DeepSeek's first dense layers) are skipped; a block with experts but an
unexpected layout is an error that says what was expected.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from shardspeed.config.expert_parallel import ExpertParallelConfig
from shardspeed.moe.autoep.presets import PRESETS, MoEPreset, preset_for_model_type

__all__ = ["MoEBlockSpec", "resolve_preset", "detect_moe_blocks"]


@dataclass(frozen=True)
class MoEBlockSpec:
    """One detected MoE block and the names of its parts."""

    name: str
    block: nn.Module
    router_name: str
    experts_name: str
    num_experts: int
    top_k: int
    hidden_size: int
    ffn_size: int
    hf_router: bool
    """The router routes itself (returns logits, weights, indices); else a plain linear."""
    shared_experts_name: str | None
    shared_experts_gate_name: str | None


def _model_type(model: nn.Module) -> str | None:
    return getattr(getattr(model, "config", None), "model_type", None)


def resolve_preset(model: nn.Module, section: ExpertParallelConfig) -> MoEPreset:
    """The preset named by ``preset_model`` (else the model's ``model_type``, else a custom
    one from ``moe_layer_pattern``), with the section's override keys applied."""
    if section.preset_model is not None:
        if section.preset_model not in PRESETS:
            raise ValueError(
                f"expert_parallel.preset_model={section.preset_model!r} is not an AutoEP preset; "
                f"use one of {sorted(PRESETS)}, or leave it null and set moe_layer_pattern "
                "(with router_pattern, expert_pattern, ...) for a custom model"
            )
        preset = PRESETS[section.preset_model]
    else:
        found = preset_for_model_type(_model_type(model))
        if found is None and section.moe_layer_pattern is None:
            raise ValueError(
                f"AutoEP has no preset for model_type {_model_type(model)!r}; set "
                f"expert_parallel.preset_model to one of {sorted(PRESETS)}, or set "
                "moe_layer_pattern (and router_pattern, expert_pattern, expert_w1, expert_w2 as "
                "needed) for a custom model"
            )
        preset = found or MoEPreset("custom", ())
    overrides: dict[str, Any] = {
        "moe_layer_pattern": section.moe_layer_pattern,
        "router_name": section.router_pattern,
        "experts_name": section.expert_pattern,
        "expert_w1": section.expert_w1,
        "expert_w2": section.expert_w2,
        "num_experts_attr": section.num_experts_attr,
        "top_k_attr": section.top_k_attr,
        "shared_experts_name": section.shared_experts_pattern,
        "shared_experts_gate_name": section.shared_experts_gate_pattern,
    }
    preset = replace(preset, **{k: v for k, v in overrides.items() if v is not None})
    if section.has_shared_experts is False:
        preset = replace(preset, shared_experts_name=None, shared_experts_gate_name=None)
    return preset


def _child(module: nn.Module, pattern: str | None) -> tuple[str, nn.Module] | tuple[None, None]:
    """The first direct child whose name fully matches ``pattern``."""
    if pattern is None:
        return None, None
    for name, child in module.named_children():
        if re.fullmatch(pattern, name):
            return name, child
    return None, None


def _fused_sizes(name: str, experts: nn.Module, preset: MoEPreset) -> tuple[int, int, int] | None:
    """(experts, hidden, ffn) of a fused experts module; None if it has no 3-D ``expert_w1``."""
    w1 = getattr(experts, preset.expert_w1, None)
    w2 = getattr(experts, preset.expert_w2, None)
    if not isinstance(w1, nn.Parameter) or w1.ndim != 3:
        return None
    num, two_ffn, hidden = w1.shape
    if not isinstance(w2, nn.Parameter) or tuple(w2.shape) != (num, hidden, two_ffn // 2):
        got = None if w2 is None else tuple(w2.shape)
        raise ValueError(
            f"AutoEP: {name}.{preset.expert_w2} has shape {got}; expected "
            f"{(num, hidden, two_ffn // 2)} (fused [E, hidden, ffn] beside {preset.expert_w1} "
            f"[E, 2*ffn, hidden]); set expert_parallel.expert_w1/expert_w2 to the right names"
        )
    extra = sorted(
        {n for n, _ in experts.named_parameters()} - {preset.expert_w1, preset.expert_w2}
    )
    if extra:
        raise ValueError(
            f"AutoEP: {name} has expert parameters {extra} besides {preset.expert_w1} and "
            f"{preset.expert_w2} (biases or another layout), which AutoEP does not split; "
            "leave expert_parallel disabled for this model"
        )
    return num, hidden, two_ffn // 2


def _top_k(name: str, router: nn.Module, model: nn.Module, preset: MoEPreset, section: Any) -> int:
    if isinstance(section.top_k, int):
        return int(section.top_k)
    for value in (
        getattr(router, "top_k", None),
        getattr(getattr(model, "config", None), preset.top_k_attr, None),
    ):
        if isinstance(value, int):
            return value
    raise ValueError(
        f"AutoEP: cannot tell top-k for {name}: its router has no top_k and model.config has no "
        f"{preset.top_k_attr!r}; set expert_parallel.top_k or top_k_attr"
    )


def _check_expert_count(name: str, num: int, model: nn.Module, preset: MoEPreset) -> None:
    configured = getattr(getattr(model, "config", None), preset.num_experts_attr, None)
    if isinstance(configured, int) and configured != num:
        raise ValueError(
            f"AutoEP: {name} holds {num} experts but model.config.{preset.num_experts_attr} is "
            f"{configured}; set expert_parallel.num_experts_attr to the right attribute"
        )


def detect_moe_blocks(
    model: nn.Module, preset: MoEPreset, section: ExpertParallelConfig
) -> list[MoEBlockSpec]:
    """Every MoE block of ``model`` under ``preset``, in module order."""
    specs = []
    for name, module in model.named_modules():
        if not re.fullmatch(preset.moe_layer_pattern, name):
            continue
        experts_name, experts = _child(module, preset.experts_name)
        if experts is None or experts_name is None:
            continue
        sizes = _fused_sizes(f"{name}.{experts_name}", experts, preset)
        if sizes is None:
            continue
        num, hidden, ffn = sizes
        router_name, router = _child(module, preset.router_name)
        if router is None or router_name is None:
            raise ValueError(
                f"AutoEP: {name} has experts but no router child matching "
                f"{preset.router_name!r}; set expert_parallel.router_pattern"
            )
        _check_expert_count(name, num, model, preset)
        shared_name, _ = _child(module, preset.shared_experts_name)
        gate_name, _ = _child(module, preset.shared_experts_gate_name)
        specs.append(
            MoEBlockSpec(
                name=name,
                block=module,
                router_name=router_name,
                experts_name=experts_name,
                num_experts=num,
                top_k=_top_k(name, router, model, preset, section),
                hidden_size=hidden,
                ffn_size=ffn,
                hf_router=not isinstance(router, nn.Linear),
                shared_experts_name=shared_name,
                shared_experts_gate_name=gate_name if shared_name is not None else None,
            )
        )
    if not specs:
        raise ValueError(
            f"AutoEP ({preset.name}) found no MoE block: no module matching "
            f"{preset.moe_layer_pattern!r} has a {preset.experts_name!r} child with 3-D "
            f"{preset.expert_w1!r} weights; check expert_parallel.preset_model, or set "
            "moe_layer_pattern / expert_pattern / expert_w1 for this model"
        )
    return specs
