"""AutoTP training: a whole model split over the topology's tensor-parallel group, in place.

:func:`apply_tensor_parallel` (called by ``initialize`` before ZeRO sees the model) makes every
rank of a tensor-parallel group start from the same whole weights and random state (rank 0 of
the group's), plans the split (:mod:`.plan`), replaces the planned modules by their parallel
forms (which adopt the original parameters, split in place) and sets the attention modules'
head counts to this rank's. ZeRO then shards each rank's pieces over the data-parallel group.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardspeed.accelerator import get_accelerator
from shardspeed.comm.parallel_topology import ParallelTopology
from shardspeed.runtime.tensor_parallel.input_check import check_inputs_once
from shardspeed.runtime.tensor_parallel.layers import (
    SHARED_COPIES,
    ColumnParallelLinear,
    PieceSource,
    RowParallelLinear,
    VocabParallelEmbedding,
    sum_gradient_over,
)
from shardspeed.runtime.tensor_parallel.partition import SplitLayout
from shardspeed.runtime.tensor_parallel.plan import TrainingPlan, build_training_plan
from shardspeed.runtime.zero.comm_group import CommGroup

__all__ = ["TensorParallelModel", "apply_tensor_parallel"]


@dataclass
class TensorParallelModel:
    """What :func:`apply_tensor_parallel` did: the group and the plan it followed."""

    group: CommGroup
    plan: TrainingPlan


def _from_rank0(tensor: torch.Tensor, group: CommGroup, device: torch.device) -> torch.Tensor:
    """A new tensor holding the group's rank 0's ``tensor`` (sent through ``device``: NCCL has
    no host tensors), on ``tensor``'s device."""
    copy = tensor.detach().to(device, copy=True)
    group.broadcast(copy)
    return copy.to(tensor.device)


def _agree_on_start(
    model: nn.Module, group: CommGroup, device: torch.device, split: set[int]
) -> None:
    """Every rank of ``group`` takes rank 0's weights, buffers and random state: the pieces
    must come from one model, and dropout outside split regions must draw the same. The
    parameters in ``split`` (ids) are not sent whole: each rank receives its piece of rank 0's
    as it is split (:func:`_rank0_piece`), and never reads its own whole copy."""
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.is_meta:
            raise ValueError(
                "AutoTP training needs the model's weights: a parameter is on the meta device "
                "(load or initialise the model before deepspeed.initialize)"
            )
        if id(tensor) not in split:
            # a copy of its own: a tensor still viewing the loaded file's memory map would keep
            # the whole map, every page rank 0 read to cut the pieces, resident
            tensor.data = _from_rank0(tensor.data, group, device)
    torch.set_rng_state(_from_rank0(torch.get_rng_state(), group, device))
    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        accelerator.set_rng_state(_from_rank0(accelerator.get_rng_state(), group, device))


def _rank0_piece(group: CommGroup, device: torch.device) -> PieceSource:
    """A piece source handing each rank its piece of rank 0's whole tensor (rank 0 cuts and
    sends every rank's; the others receive only theirs)."""

    def source(whole: torch.Tensor, layout: SplitLayout, rank: int) -> torch.Tensor:
        mine = None
        for member in range(group.world_size):
            if group.rank == 0:
                buffer = layout.take(whole, member).contiguous().to(device, copy=True)
            else:
                buffer = torch.empty(layout.local_shape(member), dtype=whole.dtype, device=device)
            group.broadcast(buffer)
            if member == rank:
                mine = buffer
        assert mine is not None
        return mine.to(whole.device)

    return source


#: the tensors each kind of split cuts (a row-parallel bias stays whole)
_SPLIT_ATTRS = {"column": ("weight", "bias"), "row": ("weight",), "vocab": ("weight",)}


def _split_parameters(model: nn.Module, plan: TrainingPlan) -> set[int]:
    """Ids of the parameters the plan splits (their pieces come from rank 0 one by one)."""
    ids = set()
    for name, split in plan.splits.items():
        module = model.get_submodule(name)
        for attr in _SPLIT_ATTRS.get(split.kind, ()):
            value = getattr(module, attr, None)
            if isinstance(value, torch.Tensor):
                ids.add(id(value))
    return ids


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


class _Replicas:
    """Sub-groups of the tensor-parallel group whose ranks hold the same piece (made in the
    same order on every rank, as they are needed)."""

    def __init__(self, topology: ParallelTopology) -> None:
        self.topology = topology

    def of(self, layout: SplitLayout | None) -> CommGroup | None:
        if layout is None:
            return None
        sets = layout.replica_sets()
        size = len(sets[0])
        if size == 1:
            return None
        tp = len(layout.pieces)
        if any(s != list(range(s[0], s[0] + size)) for s in sets) or len(sets) * size != tp:
            raise ValueError(
                f"ranks sharing a piece must be equal blocks of consecutive tensor-parallel "
                f"ranks, got {sets}"
            )
        return CommGroup.of(self.topology.tensor_replica_group(size))


def apply_tensor_parallel(
    model: nn.Module,
    topology: ParallelTopology,
    *,
    grain: int = 1,
    specs: Any = None,
    overlap_comm: bool = False,
) -> TensorParallelModel:
    """Split ``model`` in place over ``topology``'s ``tp`` group (see the module docs)."""
    group = CommGroup.of(topology.group("tp"))
    device = torch.device(get_accelerator().current_device_name())
    plan = build_training_plan(model, group.world_size, grain=grain, specs=specs)
    _agree_on_start(model, group, device, _split_parameters(model, plan))
    source = _rank0_piece(group, device)
    replicas = _Replicas(topology)
    # embeddings first: a head tied to one adopts its already split weight
    order = sorted(plan.splits.items(), key=lambda item: item[1].kind != "vocab")
    for name, split in order:
        module = model.get_submodule(name)
        new: nn.Module
        if split.kind == "vocab":
            assert isinstance(module, nn.Embedding)
            new = VocabParallelEmbedding(module, group, source=source)
        elif split.kind == "column":
            new = ColumnParallelLinear(
                module,
                group,
                gather_output=split.gather_output,
                layout=split.layout,
                replicas=replicas.of(split.layout),
                overlap_comm=overlap_comm,
                source=source,
            )
        elif split.kind == "row":
            new = RowParallelLinear(
                module,
                group,
                input_is_parallel=split.input_is_parallel,
                layout=split.layout,
                source=source,
            )
        else:  # replicated, each rank's gradient a share: summed over the group
            for param in module.parameters(recurse=False):
                sum_gradient_over(param, group)
            continue
        _replace(model, name, new)
    for name, attr, value in plan.attrs:
        setattr(model.get_submodule(name), attr, value)
    for name in plan.local_configs:
        _localise_config(model.get_submodule(name), plan)
    if group.partitioned:
        check_inputs_once(model, group, device)
        model.register_forward_pre_hook(lambda *_: SHARED_COPIES.begin())
        model.register_forward_hook(lambda *_: SHARED_COPIES.end())
    return TensorParallelModel(group, plan)


def _localise_config(module: nn.Module, plan: TrainingPlan) -> None:
    """A copy of ``module.config`` with this rank's head counts (Phi-3's attention reads
    ``config.num_attention_heads`` to cut its fused projection)."""
    config = copy.copy(module.config)
    for attr, value in plan.head_counts.items():
        if isinstance(getattr(config, attr, None), int):
            setattr(config, attr, value)
    module.config = config
