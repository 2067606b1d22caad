"""Whole tensors from tensor-parallel pieces: what a 16-bit save, ``zero_to_fp32`` and a
checkpoint read at another tensor-parallel size need."""

from __future__ import annotations

import torch
from torch import nn

from shardspeed.runtime.tensor_parallel.layers import tp_layout_of
from shardspeed.runtime.tensor_parallel.partition import SplitLayout
from shardspeed.runtime.zero.comm_group import CommGroup

__all__ = ["gather_whole", "split_parameters", "whole_state_dict"]


def gather_whole(local: torch.Tensor, layout: SplitLayout, group: CommGroup) -> torch.Tensor:
    """The whole tensor from every rank's piece (``local`` is this rank's; every rank of
    ``group`` calls it)."""
    dim, sizes = layout.dim, [piece.size for piece in layout.pieces]
    if not group.partitioned:
        return layout.assemble([local])
    widest = max(sizes)
    padded = local.detach()
    if padded.shape[dim] < widest:
        shape = list(padded.shape)
        shape[dim] = widest - padded.shape[dim]
        padded = torch.cat([padded, padded.new_zeros(shape)], dim=dim)
    flat = padded.contiguous().reshape(-1)
    out = flat.new_empty(group.world_size * flat.numel())
    group.all_gather(out, flat)
    stacked = out.reshape(group.world_size, *padded.shape)
    return layout.assemble([stacked[r].narrow(dim, 0, sizes[r]) for r in range(len(sizes))])


def whole_state_dict(
    model: nn.Module, state: dict[str, torch.Tensor], group: CommGroup
) -> dict[str, torch.Tensor]:
    """``state`` (``model``'s state dict, this rank's pieces) with every split parameter
    gathered whole; every rank of ``group`` calls it and gets the same result. The names of
    one tied parameter share one whole tensor (it is gathered once)."""
    layouts = split_parameters(model)
    owners = {name: id(p) for name, p in model.named_parameters(remove_duplicate=False)}
    whole: dict[int, torch.Tensor] = {}
    out = {}
    for key, value in state.items():
        if key not in layouts:
            out[key] = value
            continue
        owner = owners[key]
        if owner not in whole:
            whole[owner] = gather_whole(value, layouts[key], group)
        out[key] = whole[owner]
    return out


def split_parameters(model: nn.Module) -> dict[str, SplitLayout]:
    """``{parameter name: its split}`` of the parameters AutoTP split in ``model`` (every name
    of a tied parameter)."""
    out = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        layout = tp_layout_of(param)
        if layout is not None:
            out[name] = layout
    return out
