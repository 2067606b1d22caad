"""The AutoEP step of ``initialize``: refuse what it cannot do, find the MoE blocks, make the
expert-parallel groups and swap each block for an :class:`AutoEPMoELayer`.

Runs before the ZeRO strategy is built: the strategy then sees the local expert slices, marked
``allreduce = False`` with ``group_name = "ep_size_<n>"``, and reduces them over their
expert-data-parallel group while the router and shared experts reduce over data parallel.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from shardspeed import comm
from shardspeed.config.expert_parallel import ExpertParallelConfig
from shardspeed.moe.autoep.detection import MoEBlockSpec, detect_moe_blocks, resolve_preset
from shardspeed.moe.autoep.layer import AutoEPMoELayer
from shardspeed.moe.autoep.presets import MoEPreset
from shardspeed.moe.autoep.routing import RoutingRule
from shardspeed.utils import groups
from shardspeed.utils.logging import log_dist

__all__ = ["apply_autoep"]

_ROUTING_KEYS = ("score_func", "route_norm", "route_scale", "score_apply", "top_k",
                 "routed_scaling_factor", "num_expert_groups", "num_limited_groups")  # fmt: skip
_ROUTING_DEFAULTS: dict[str, Any] = {
    "score_func": "auto",
    "route_norm": None,
    "route_scale": 1.0,
    "score_apply": "auto",
    "top_k": "auto",
    "routed_scaling_factor": "auto",
    "num_expert_groups": None,
    "num_limited_groups": None,
}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tensor_parallel_size(mpu: Any) -> int:
    for getter in ("get_tensor_model_parallel_world_size", "get_model_parallel_world_size"):
        if mpu is not None and hasattr(mpu, getter):
            return int(getattr(mpu, getter)())
    return 1


def _refuse_unsupported(
    section: ExpertParallelConfig, zero_stage: int, autotp_size: int, mpu: Any
) -> None:
    del zero_stage  # every stage: ZeRO-3 shards the experts over their expert-data group
    if autotp_size > 1:
        raise ValueError(
            f"expert_parallel (AutoEP) cannot be combined with AutoTP "
            f"(tensor_parallel.autotp_size={autotp_size}); set autotp_size to 0/1 or disable "
            "expert_parallel"
        )
    tp = _tensor_parallel_size(mpu)
    if tp > 1:
        raise ValueError(
            f"expert_parallel (AutoEP) cannot be combined with tensor model parallelism (the "
            f"mpu reports {tp} ranks); pass an mpu without tensor parallelism or disable "
            "expert_parallel"
        )
    if section.score_func not in ("auto", "softmax", "sigmoid"):
        raise ValueError(
            f"expert_parallel.score_func={section.score_func!r}: use auto, softmax or sigmoid"
        )
    if section.score_apply not in ("auto", "pre", "post"):
        raise ValueError(
            f"expert_parallel.score_apply={section.score_apply!r}: use auto, pre or post"
        )
    if section.combine_impl != "auto":
        raise ValueError(
            f"expert_parallel.combine_impl={section.combine_impl!r}: shardspeed has one "
            'combine (index-add of the weighted expert outputs); use "auto"'
        )


def _refuse_load_balance(section: ExpertParallelConfig, preset: MoEPreset) -> None:
    if section.load_balance_coeff is None:
        return
    if not preset.supports_load_balance_coeff:
        raise ValueError(
            f"expert_parallel.load_balance_coeff={section.load_balance_coeff} is not supported "
            f"for the {preset.name} preset (expert-bias, aux-loss-free load balancing is not "
            "supported for DeepSeek-V2/V3, nor in DeepSpeed); set load_balance_coeff to null"
        )
    raise ValueError(
        f"expert_parallel.load_balance_coeff={section.load_balance_coeff}: expert-bias load "
        "balancing is not implemented in shardspeed; set it to null (the model's own "
        "router aux loss, output_router_logits, still works)"
    )


def _check_sizes(specs: list[MoEBlockSpec], ep_size: int, world: int) -> None:
    if world % ep_size != 0:
        raise ValueError(
            f"expert_parallel.autoep_size={ep_size} must divide the world size ({world}); use "
            f"one of {_divisors(world)}"
        )
    for spec in specs:
        if spec.num_experts % ep_size != 0:
            raise ValueError(
                f"expert_parallel.autoep_size={ep_size} must divide the {spec.num_experts} "
                f"experts of {spec.name}; use one of "
                f"{[d for d in _divisors(spec.num_experts) if world % d == 0]}"
            )


def _routing_rule(
    spec: MoEBlockSpec, preset: MoEPreset, section: ExpertParallelConfig, model: nn.Module
) -> RoutingRule | None:
    """None for a router that routes itself (it is called as it is; overriding its routing
    would change the model, so routing keys are refused); else the rule from the keys."""
    if spec.hf_router:
        changed = [k for k in _ROUTING_KEYS if getattr(section, k) != _ROUTING_DEFAULTS[k]]
        if changed:
            router = type(getattr(spec.block, spec.router_name)).__name__
            raise ValueError(
                f"AutoEP: {spec.name}'s router ({router}) routes by itself, so expert_parallel.{changed} would not be "
                "applied; remove them (they are for custom models with an nn.Linear router)"
            )
        return None
    model_config = getattr(model, "config", None)
    route_norm = section.route_norm
    if route_norm is None:
        route_norm = bool(getattr(model_config, "norm_topk_prob", preset.route_norm))
    scale = section.routed_scaling_factor
    if scale == "auto":
        scale = getattr(model_config, "routed_scaling_factor", None) or section.route_scale
    return RoutingRule(
        top_k=spec.top_k,
        score_func=preset.score_func if section.score_func == "auto" else section.score_func,
        route_norm=route_norm,
        scale=float(scale),
        score_apply="post" if section.score_apply == "auto" else section.score_apply,
        num_groups=section.num_expert_groups,
        limited_groups=section.num_limited_groups,
    )


def apply_autoep(
    model: nn.Module,
    section: ExpertParallelConfig,
    *,
    zero_stage: int = 0,
    autotp_size: int = 0,
    mpu: Any = None,
    use_data_before_expert_parallel: bool = False,
) -> list[str]:
    """Replace every MoE block of ``model`` by an expert-parallel ``AutoEPMoELayer`` (in place)
    and return the replaced blocks' names. Every rank calls it."""
    _refuse_unsupported(section, zero_stage, autotp_size, mpu)
    preset = resolve_preset(model, section)
    _refuse_load_balance(section, preset)
    specs = detect_moe_blocks(model, preset, section)
    ep_size = int(section.autoep_size)
    _check_sizes(specs, ep_size, comm.get_world_size())
    groups._create_expert_and_data_parallel(ep_size, use_data_before_expert_parallel)
    group_name = groups.expert_group_name(ep_size)
    ep_rank = groups._get_expert_parallel_rank(group_name)
    ep_group = groups._get_expert_parallel_group(group_name) if ep_size > 1 else None
    for spec in specs:
        layer = AutoEPMoELayer(
            spec,
            ep_size=ep_size,
            ep_rank=ep_rank,
            ep_group=ep_group,
            group_name=group_name,
            w1_name=preset.expert_w1,
            w2_name=preset.expert_w2,
            routing=_routing_rule(spec, preset, section, model),
            use_grouped_mm=bool(section.use_grouped_mm),
        )
        model.set_submodule(spec.name, layer)
    log_dist(
        f"AutoEP ({preset.name}): {len(specs)} MoE blocks expert-parallel over {ep_size} ranks, "
        f"{specs[0].num_experts // ep_size} of {specs[0].num_experts} experts per rank",
        ranks=[0],
    )
    return [spec.name for spec in specs]
