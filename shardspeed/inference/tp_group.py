"""The tensor-parallel group of an inference engine and the two collectives its layers use."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from shardspeed import comm
from shardspeed.comm.mesh import Mesh
from shardspeed.inference.config import DeepSpeedTPConfig

__all__ = ["TPGroup", "resolve_tp_group"]


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in its tensor-parallel group (``group`` None: a group of one)."""

    group: Any
    rank: int
    size: int

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the group in place and return it."""
        if self.size > 1:
            comm.inference_all_reduce(tensor, group=self.group)
        return tensor

    def gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``tensor`` along its last dimension, in rank order."""
        if self.size == 1:
            return tensor
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        comm.all_gather(parts, tensor, group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE = TPGroup(group=None, rank=0, size=1)


def resolve_tp_group(tp: DeepSpeedTPConfig, mpu: Any = None) -> TPGroup:
    """The group from ``tp.tp_group``, an ``mpu``, or consecutive ranks of the world.

    Without an explicit group, ``tp_size`` must divide the world size; the world is split into
    groups of ``tp_size`` consecutive ranks (every rank creates every group, as torch requires).
    """
    mpu = tp.mpu if tp.mpu is not None else mpu
    if not tp.enabled or (tp.tp_size == 1 and tp.tp_group is None and mpu is None):
        return SINGLE
    if not comm.is_initialized():
        comm.init_distributed()
    if tp.tp_group is not None or mpu is not None:
        group = tp.tp_group if tp.tp_group is not None else mpu.get_model_parallel_group()
        size = comm.get_world_size(group)
        if tp.tp_size not in (1, size):
            raise ValueError(
                f"tensor_parallel.tp_size={tp.tp_size} but the given TP group has {size} ranks; "
                "set tp_size to the group's size (or leave it at 1)."
            )
        return TPGroup(group=group, rank=comm.get_rank(group), size=size)
    world = comm.get_world_size()
    if world % tp.tp_size:
        raise ValueError(
            f"tensor_parallel.tp_size={tp.tp_size} does not divide the world size {world}; "
            f"launch a multiple of {tp.tp_size} ranks or choose a tp_size that divides {world}."
        )
    mesh = Mesh.grid({"dp": world // tp.tp_size, "tp": tp.tp_size})
    group = mesh.group("tp")
    if group is None:
        group = comm.get_world_group()
    return TPGroup(group=group, rank=mesh.local_rank("tp"), size=tp.tp_size)
