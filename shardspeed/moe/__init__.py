"""Mixture of Experts (``deepspeed.moe``): the ``MoE`` layer, gating, experts and param-group
helpers. With ``ep_size > 1`` each rank holds ``num_experts / ep_size`` experts and tokens reach
them by all-to-all over the expert-parallel group (``shardspeed.utils.groups``)."""

from shardspeed.moe.experts import Experts
from shardspeed.moe.layer import MoE
from shardspeed.moe.sharded_moe import MOELayer, TopKGate, top1gating, top2gating, topkgating
from shardspeed.moe.utils import (
    configure_moe_param_groups,
    has_moe_layers,
    is_moe_param,
    split_params_into_different_moe_groups_for_optimizer,
)

__all__ = [
    "Experts",
    "MOELayer",
    "MoE",
    "TopKGate",
    "configure_moe_param_groups",
    "has_moe_layers",
    "is_moe_param",
    "split_params_into_different_moe_groups_for_optimizer",
    "top1gating",
    "top2gating",
    "topkgating",
]
