"""The first forward's inputs checked equal across a tensor-parallel group.

Every rank of a tensor-parallel group must run the same micro-batch: the group is one model. A
loader that shards by global rank (as plain data parallelism does) feeds them different rows and
the split layers then mix them into a wrong result without an error. Like DeepSpeed, the first
forward after ``initialize`` compares the inputs once (a forward pre-hook that removes itself):
a signature of every tensor (its size, sum and a position-weighted sum, in float64) from the
group's rank 0 against each rank's own.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from shardspeed import comm
from shardspeed.runtime.zero.comm_group import CommGroup

__all__ = ["TensorParallelInputError", "check_inputs_once", "input_signature"]

MESSAGE = (
    "Data inconsistency within the TP group. Please check the Dataloader implementation to "
    "ensure consistency."
)


class TensorParallelInputError(ValueError, AssertionError):
    """Ranks of one tensor-parallel group got different inputs (DeepSpeed asserts)."""


def input_signature(args: Any, kwargs: Any, device: torch.device) -> torch.Tensor:
    """(numel, sum, weighted sum) of every tensor in ``args`` / ``kwargs``, in order."""
    leaves, _ = tree_flatten((args, kwargs))
    parts = []
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            continue
        flat = leaf.detach().reshape(-1).to(device=device, dtype=torch.float64)
        weights = torch.arange(flat.numel(), device=device, dtype=torch.float64) % 1009 + 1
        parts.append(
            torch.stack([flat.new_tensor(flat.numel()), flat.sum(), (flat * weights).sum()])
        )
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64, device=device)


def _agree(signature: torch.Tensor, group: CommGroup) -> bool:
    device = signature.device
    length = torch.tensor([signature.numel(), -signature.numel()], device=device)
    group.all_reduce(length, op=comm.ReduceOp.MAX)
    same = bool(length[0] == -length[1])
    if same:
        first = signature.clone()
        group.broadcast(first)
        same = torch.equal(first, signature)
    flag = torch.tensor([0.0 if same else 1.0], device=device)
    group.all_reduce(flag)  # every rank raises, not only the odd one
    return bool(flag.item() == 0)


def check_inputs_once(model: nn.Module, group: CommGroup, device: torch.device) -> None:
    """Compare the first forward's inputs across ``group`` (see the module docs)."""

    def check(module: nn.Module, args: Any, kwargs: Any) -> None:
        handle.remove()
        if not _agree(input_signature(args, kwargs, device), group):
            raise TensorParallelInputError(
                f"{MESSAGE} The {group.world_size} ranks of a tensor-parallel group got "
                "different inputs in their first forward: they must run the same micro-batch. "
                "Shard your data by engine.dp_rank / engine.dp_world_size (the data-parallel "
                "rank), not by the global rank, or pass training_data to initialize (its loader "
                "does this)"
            )

    handle = model.register_forward_pre_hook(check, prepend=True, with_kwargs=True)
