"""Tensor-parallel generation for the hybrid engine (``hybrid_engine.inference_tp_size`` > 1).

DeepSpeed's semantics: the world is cut into groups of ``inference_tp_size`` consecutive ranks;
in ``generate`` every rank's prompts are all-gathered inside its group, the group decodes them
together with the model split over its ranks, and each rank keeps the rows of its own prompts.

The split is shardspeed's inference AutoTP (:func:`~shardspeed.inference.tp_plan.build_plan` and
:func:`~shardspeed.inference.autotp.apply_plan`) applied to the generation view of the gathered
weights, never to the trained modules: the view's linears are replaced by this rank's slices
(copies; the gathered weights are released as usual when the call ends).

Prompts of different lengths (or batch sizes) on the ranks of a group are left-padded to the
longest with the pad id and decoded under an attention mask, which the fused decoder honours
(positions count real tokens only, so a padded prompt decodes exactly as an unpadded one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardspeed import comm
from shardspeed.comm.mesh import groups_for
from shardspeed.inference.autotp import apply_plan
from shardspeed.inference.fused.decoder import ACCEPTED_GENERATE_KWARGS
from shardspeed.inference.tp_group import TPGroup
from shardspeed.inference.tp_plan import build_plan
from shardspeed.inference.weight_source import ModuleWeights

__all__ = ["GroupBatch", "TP_KWARGS", "gather_group_batch", "make_inference_tp_group", "split_view"]

#: ``generate`` arguments the tensor-parallel (fused, greedy) path takes; any other argument
#: sends the call to the whole-model path
#: a streamer is left out: a TP group decodes the gathered batch of all its ranks
TP_KWARGS = (ACCEPTED_GENERATE_KWARGS - {"streamer"}) | {"synced_gpus"}


class InferenceTPSizeError(ValueError, AssertionError):
    """``hybrid_engine.inference_tp_size`` does not fit the launched world."""


def check_inference_tp_size(tp_size: int, world_size: int, mpu: Any) -> None:
    """Refuse a tensor-parallel degree the world cannot be cut into (at ``initialize``)."""
    if tp_size <= 1:
        return
    if mpu is not None:
        raise InferenceTPSizeError(
            f"hybrid_engine.inference_tp_size={tp_size} with an mpu: tensor-parallel generation "
            "of a model already split by Megatron-style model parallelism is not built in "
            "shardspeed; set inference_tp_size to 1 or train without an mpu"
        )
    if world_size % tp_size:
        raise InferenceTPSizeError(
            f"hybrid_engine.inference_tp_size={tp_size} does not divide the world size "
            f"{world_size}; the world is cut into groups of inference_tp_size consecutive "
            f"ranks, so launch a multiple of {tp_size} ranks or choose a divisor of {world_size}"
        )


def make_inference_tp_group(tp_size: int) -> TPGroup:
    """This rank's group of ``tp_size`` consecutive ranks (every rank makes every group, in the
    same order, through the group registry)."""
    world, rank = comm.get_world_size(), comm.get_rank()
    partition = [list(range(first, first + tp_size)) for first in range(0, world, tp_size)]
    group = groups_for(partition)
    return TPGroup(group=group, rank=rank % tp_size, size=tp_size)


@dataclass(frozen=True)
class GroupBatch:
    """The prompts of a whole group, left-padded to the longest, and where this rank's are."""

    ids: torch.Tensor
    """(rows of every rank, longest prompt), in rank order."""
    mask: torch.Tensor | None
    """Attention mask of :attr:`ids` (None: no rank padded and none gave a mask)."""
    first_row: int
    rows: int
    left_pad: int
    """Columns of padding this call added in front of this rank's prompts."""

    def own(self, output: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the group's ``output``, without the padding added here."""
        return output[self.first_row : self.first_row + self.rows, self.left_pad :]


def gather_group_batch(
    tp: TPGroup, ids: torch.Tensor, mask: torch.Tensor | None, ok: bool, pad_id: int
) -> GroupBatch | None:
    """All-gather the group's prompts; None (on every rank of the group alike) when some rank's
    call cannot take the tensor-parallel path (``ok`` false there)."""
    rows, length = ids.shape
    meta = torch.tensor([rows, length, int(ok), int(mask is not None)], dtype=torch.long)
    metas = _all_gather(tp, meta.to(ids.device)).cpu().view(tp.size, 4)
    if not bool(metas[:, 2].all()):
        return None
    most_rows, longest = int(metas[:, 0].max()), int(metas[:, 1].max())
    # ids and mask travel together in one tensor of the same shape on every rank
    padded = torch.full((2, most_rows, longest), pad_id, dtype=ids.dtype, device=ids.device)
    padded[1].zero_()
    padded[0, :rows, longest - length :] = ids
    padded[1, :rows, longest - length :] = 1 if mask is None else mask.to(ids.dtype)
    parts = _all_gather(tp, padded.unsqueeze(0)).view(tp.size, 2, most_rows, longest)
    counts = [int(n) for n in metas[:, 0]]
    group_ids = torch.cat([parts[r, 0, : counts[r]] for r in range(tp.size)])
    group_mask = torch.cat([parts[r, 1, : counts[r]] for r in range(tp.size)])
    needs_mask = bool(metas[:, 3].any()) or bool((metas[:, 1] != longest).any())
    return GroupBatch(
        ids=group_ids,
        mask=group_mask.to(mask.dtype if mask is not None else torch.long) if needs_mask else None,
        first_row=sum(counts[: tp.rank]),
        rows=rows,
        left_pad=longest - length,
    )


def _all_gather(tp: TPGroup, tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along dim 0, in rank order."""
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(tp.size)]
    comm.all_gather(parts, tensor, group=tp.group)
    return torch.cat(parts)


def split_view(model: nn.Module, tp: TPGroup, grain: int = 64) -> None:
    """Replace the view ``model``'s attention, MLP, embedding and head with this rank's slices
    (AutoTP's plan); the trained model's modules are not the view's and stay whole."""
    parameter = next(model.parameters())
    plan = build_plan(model, tp.size, tp.rank, grain)
    apply_plan(model, plan, tp, ModuleWeights(model), parameter.dtype, parameter.device)
