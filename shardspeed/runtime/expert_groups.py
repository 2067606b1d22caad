"""Mixture of Experts at initialize: make each MoE layer's expert-parallel groups and say which
process group every expert parameter reduces over.

DeepSpeed marks an expert parameter with ``allreduce = False`` and the name of its layers'
groups (``group_name = "ep_size_<n>"``). Such a parameter is replicated, and its gradient
reduced, over its expert-data-parallel group only (the ranks holding the same experts), averaged
over the whole data-parallel group: the gradient of an expert already sums the tokens its
expert-parallel peers routed to it. Everything else reduces over the data-parallel group.
Expert parameters form shard groups of their own also at ``ep_size=1``, so the dense
parameters' checkpoint layout does not depend on the expert-parallel size. At ZeRO stage 3 the
expert parameters are also sharded over their expert-data-parallel group (DeepSpeed refuses
expert parallelism at stage 3).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from torch import nn

from shardspeed import comm
from shardspeed.moe.layer import MoE
from shardspeed.moe.utils import is_moe_param
from shardspeed.runtime.zero.comm_group import CommGroup
from shardspeed.runtime.zero.records import ParamRecord
from shardspeed.utils import groups


def expert_comm_for(
    model: nn.Module, dp: CommGroup, zero_stage: int, use_data_before_expert_parallel: bool
) -> Callable[[ParamRecord], CommGroup] | None:
    """Make the groups of every ``MoE`` layer of ``model`` (each rank, layers in module order)
    and return the strategy's ``comm_for``; None for a model with no expert parameters.
    Every ZeRO stage takes the same groups (``zero_stage`` is not consulted)."""
    del zero_stage
    for module in model.modules():
        if isinstance(module, MoE):
            module.set_deepspeed_parallelism(use_data_before_expert_parallel)
    names = {p.group_name for p in model.parameters() if is_moe_param(p)}  # type: ignore[attr-defined]
    if not names:
        return None
    by_name: dict[str, CommGroup] = {}
    for name in sorted(names):
        ep_size = groups._get_expert_parallel_world_size(name)
        if ep_size == 1:  # reduced as the dense parameters are, but kept as a group apart
            by_name[name] = dataclasses.replace(dp, label=name)
            continue
        if dp.world_size != comm.get_world_size():
            raise NotImplementedError(
                "expert parallelism needs the data-parallel group to be the whole world "
                f"(here {dp.world_size} of {comm.get_world_size()} ranks: pipeline or model "
                "parallelism is in use); use ep_size=1"
            )
        by_name[name] = dataclasses.replace(
            CommGroup.of(groups._get_expert_data_parallel_group(name)),
            average_over=dp.world_size,
            spread_over=CommGroup.of(groups._get_expert_parallel_group(name)),
            label=name,
        )

    def comm_for(record: ParamRecord) -> CommGroup:
        if is_moe_param(record.param):
            return by_name[record.param.group_name]  # type: ignore[attr-defined]
        return dp

    return comm_for
