"""The saved layout of optimizer state: which parameter, by name, sits where in which flat bucket.

Every rank of a stage 1/2 job saves its chunk of each bucket together with the bucket layout
(:class:`BucketLayout`); stage 0 saves its state whole with a layout of one bucket per parameter
(:func:`replicated_layout`), DeepSpeed's ZeRO 1/2 files read as one bucket per parameter
group (:func:`deepspeed_layout`) and its ZeRO-3 files as one bucket per parameter
(:func:`deepspeed_zero3_layout`). The layout lives in a shard's strategy state
(:class:`StrategyState`), as plain Python containers, so checkpoints stay readable without
shardspeed. Its structure is versioned (:data:`LAYOUT_VERSION`): readers refuse a version newer
than they know (:func:`check_layout_version`). Needs only torch: this module is part of the
standalone ``zero_to_fp32.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypedDict

import torch

#: the version of the layout and strategy-state structure this shardspeed writes and reads;
#: checkpoints written before versioning carry none and read as version 0 (the same structure)
LAYOUT_VERSION = 1


class BucketLayout(TypedDict):
    """One flat bucket as saved."""

    #: the optimizer parameter group the bucket belongs to
    group: int
    #: elements in the bucket, padding included (a multiple of the data-parallel size)
    size: int
    #: the index of the bucket's flat tensor in the torch optimizer's state numbering
    state_index: int
    #: ``[name, offset, numel]`` of each parameter in the bucket, in order (lists, not tuples:
    #: as saved)
    params: list[list[Any]]


class StrategyState(TypedDict, total=False):
    """The ZeRO strategy's part of a saved optimizer state (``state["strategy"]``)."""

    stage: int
    #: :data:`LAYOUT_VERSION` of the writer; absent before versioning (version 0)
    layout_version: int
    #: the data-parallel size that saved the shard (stages 1/2)
    dp_world_size: int
    #: each bucket's chunk length on every rank (stages 1/2)
    chunk_numel: list[int]
    layout: list[BucketLayout]
    #: this rank's fp32 master chunk of each bucket; None where the optimizer stepped the fp32
    #: parameters themselves (the module weights are the masters) (stages 1/2)
    fp32_chunks: Sequence[torch.Tensor | None]
    #: the parameter name of each fp32 master (stage 0)
    master_names: list[str]
    #: the fp32 masters whole, absent in fp32 training (stage 0)
    fp32_masters: Sequence[torch.Tensor]


def check_layout_version(saved: Mapping[str, Any], where: str) -> int:
    """The layout version of the strategy state ``saved`` read from ``where`` (0 when it names
    none: written before versioning); a version newer than :data:`LAYOUT_VERSION` is refused."""
    version = saved.get("layout_version", 0)
    if version > LAYOUT_VERSION:
        raise ValueError(
            f"{where} holds a checkpoint of layout version {version}, written by a newer "
            f"shardspeed; this one reads versions up to {LAYOUT_VERSION}. Upgrade shardspeed "
            "(pip install -U shardspeed) to load it"
        )
    return int(version)


def versioned(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (a strategy's ``state_dict()``) stamped with this :data:`LAYOUT_VERSION`, in
    place; returns it."""
    state["layout_version"] = LAYOUT_VERSION
    return state


def layouts_match(saved: Mapping[str, Any], layout: list[BucketLayout], world: int) -> bool:
    """Whether a rank's saved strategy state has exactly this run's partitioning."""
    return saved.get("dp_world_size") == world and saved.get("layout") == layout


def chunk_ranges(first: int, last: int, chunk: int) -> Iterator[tuple[int, slice]]:
    """Elements ``[first, last)`` of a flat bucket split into equal ``chunk``-sized parts, one
    per rank: ``(rank, slice of that rank's chunk)`` for each part the range touches."""
    while first < last:
        owner = first // chunk
        end = min(last, (owner + 1) * chunk)
        yield owner, slice(first - owner * chunk, end - owner * chunk)
        first = end


def param_bucket(group: int, state_index: int, name: str, numel: int) -> BucketLayout:
    """A bucket holding one whole parameter (stage 0's layout, universal checkpoints)."""
    return {"group": group, "size": numel, "state_index": state_index, "params": [[name, 0, numel]]}


def replicated_layout(
    param_groups: list[dict[str, Any]], name_of: Callable[[torch.Tensor], str | None]
) -> list[BucketLayout]:
    """The layout of a replicated optimizer: each trainable tensor it steps is a bucket of its
    own (``name_of`` names it; None for a frozen one, which is left out but keeps its index in
    torch's state numbering)."""
    layout, index = [], 0
    for group_index, group in enumerate(param_groups):
        for tensor in group["params"]:
            name = name_of(tensor)
            if name is not None:
                layout.append(param_bucket(group_index, index, name, tensor.numel()))
            index += 1
    return layout


def deepspeed_layout(
    param_shapes: list[dict[str, Any]], partitions: list[int], count: int
) -> list[BucketLayout]:
    """The bucket layout of a DeepSpeed ZeRO 1/2 checkpoint: each parameter group is one flat
    bucket of its parameters in ``param_shapes`` order, padded at the end, split into ``count``
    partitions of ``partitions[g]`` elements."""
    layout: list[BucketLayout] = []
    for group, shapes in enumerate(param_shapes):
        params: list[list[Any]] = []
        offset = 0
        for name, shape in shapes.items():
            numel = math.prod(shape)
            params.append([name, offset, numel])
            offset += numel
        size = partitions[group] * count
        layout.append({"group": group, "size": size, "state_index": group, "params": params})
    return layout


def deepspeed_zero3_layout(
    param_shapes: list[dict[str, Any]], group_of: list[int], count: int
) -> list[BucketLayout]:
    """The bucket layout of a DeepSpeed ZeRO-3 checkpoint: DeepSpeed partitions each parameter
    on its own (padded at the end to a multiple of ``count``), so each is a bucket of its own,
    in ``param_shapes`` order (one dict per optimizer sub-group; sub-group ``s`` belongs to
    parameter group ``group_of[s]``)."""
    layout: list[BucketLayout] = []
    for sub_group, shapes in enumerate(param_shapes):
        for name, shape in shapes.items():
            numel = math.prod(shape)
            bucket = param_bucket(group_of[sub_group], len(layout), name, numel)
            bucket["size"] = -(-numel // count) * count
            layout.append(bucket)
    return layout
