"""DeepSpeed's own ZeRO-3 checkpoints, read without DeepSpeed.

A tag DeepSpeed's ZeRO-3 wrote holds, for each data-parallel rank ``r``:

- ``zero_pp_rank_r_mp_rank_00_model_states.pt`` (:data:`~.files.ZERO3_MODEL_STATES`): counters,
  config, ``param_shapes`` (one ordered dict name -> shape per optimizer sub-group),
  ``shared_params`` (tied name -> the name saved), ``frozen_param_shapes`` and
  ``frozen_param_fragments`` (rank ``r``'s partition of each frozen parameter), buffers whole,
  and every parameter as an empty tensor of the module's dtype;
- ``[bf16_]zero_pp_rank_r_mp_rank_00_optim_states.pt``: per sub-group one flat fp32 partition
  (``fp32_flat_groups``): rank ``r``'s part of each of the sub-group's parameters, one after the
  other. Every parameter is partitioned on its own, padded at its end to a multiple of the world
  size, so rank ``r`` holds its elements ``[r * p, (r + 1) * p)`` with ``p = ceil(numel /
  world)``. The base optimizer's state numbers the sub-groups' flat tensors in order; its groups'
  ``params`` say which sub-group belongs to which parameter group.

In the re-partitioner's terms (:mod:`.reshard`) each parameter is a bucket of its own
(:func:`~.layout.deepspeed_zero3_layout`): :func:`zero3_shard` cuts each sub-group's flat
partition and per-element optimizer state into those buckets, and :func:`zero3_tensors` puts the
module's weights back together from the same partitions. Not read, with an error that says so:
optimizer state DeepSpeed swapped to NVMe (it saves it as empty tensors) and MiCS (partitions over
fewer ranks than the world). Needs only torch: this module is part of the standalone
``zero_to_fp32.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import torch

from shardspeed.checkpoint.files import ZERO3_MODEL_STATES, shard_paths
from shardspeed.checkpoint.layout import StrategyState, deepspeed_zero3_layout
from shardspeed.checkpoint.reader import load_file

#: how the value of a ``zero_optimization`` key names an NVMe placement
_NVME = "nvme"


class SavedTensor(NamedTuple):
    """One entry of a ZeRO-3 tag's module state: how to build it (on the CPU, a new tensor),
    its shape and what it is (``"trainable"``: the fp32 master; ``"frozen"``: a frozen
    parameter in the module's dtype; ``"buffer"``: as saved)."""

    build: Callable[[], torch.Tensor]
    shape: torch.Size
    kind: str


def check_readable(model_state: dict[str, Any], where: str) -> None:
    """Refuse, by name, the ZeRO-3 forms whose files do not hold the whole state."""
    zero = (model_state.get("ds_config") or {}).get("zero_optimization") or {}
    if not isinstance(zero, dict):
        return
    for key in ("offload_optimizer", "offload_param"):
        if (zero.get(key) or {}).get("device") == _NVME:
            raise ValueError(
                f"{where} was saved by DeepSpeed's ZeRO-3 with {key}.device 'nvme': DeepSpeed "
                "saves the parts it had swapped to NVMe as empty tensors, so the tag does not "
                "hold them and shardspeed cannot load it. Save it again from DeepSpeed with "
                "offload to 'cpu' (or none), or consolidate it with DeepSpeed's own tools"
            )
    if int(zero.get("mics_shard_size", -1) or -1) > 0:
        raise ValueError(
            f"{where} was saved by DeepSpeed's MiCS (zero_optimization.mics_shard_size "
            f"{zero['mics_shard_size']}), whose partitions span fewer ranks than the job; "
            "shardspeed reads plain ZeRO-3 tags only. Consolidate it with DeepSpeed's "
            "zero_to_fp32 and load the weights"
        )


def _partition(numel: int, count: int) -> int:
    """Elements of a ``numel``-element parameter on each of ``count`` ranks (padding included)."""
    return -(-numel // count)


def _groups_of_sub_groups(base: dict[str, Any], count: int, where: str) -> list[int]:
    """The parameter group of each of ``count`` sub-groups, from the base optimizer's groups."""
    group_of = [-1] * count
    for group, saved in enumerate(base["param_groups"]):
        for index in saved["params"]:
            if not 0 <= int(index) < count:
                raise ValueError(f"{where}: optimizer group {group} names sub-group {index}")
            group_of[int(index)] = group
    if -1 in group_of:
        raise ValueError(f"{where}: sub-group {group_of.index(-1)} is in no optimizer group")
    return group_of


def zero3_shard(
    saved: dict[str, Any], param_shapes: list[dict[str, Any]], count: int, where: str
) -> dict[str, Any]:
    """One rank's ``optimizer_state_dict`` of a DeepSpeed ZeRO-3 tag saved by ``count`` ranks,
    as a shard of the re-partitioner's form: one bucket per parameter, its fp32 chunk and
    per-element optimizer state cut (as views) from its sub-group's flat partition."""
    flat = saved.get("fp32_flat_groups")
    if flat is None or saved.get("zero_stage") != 3:
        raise ValueError(
            f"{where} is not a DeepSpeed ZeRO-3 optimizer shard (no fp32_flat_groups, zero_stage "
            f"{saved.get('zero_stage')!r}) although the tag's model-states files are ZeRO-3's: "
            "the tag mixes files of different saves; copy it again whole"
        )
    if saved.get("partition_count") != count:
        raise ValueError(
            f"{where} is partitioned over {saved.get('partition_count')} ranks in a job of "
            f"{count} (MiCS or hierarchical partitioning); shardspeed reads plain ZeRO-3 tags"
        )
    if len(flat) != len(param_shapes):
        raise ValueError(
            f"{where} holds {len(flat)} optimizer sub-groups where param_shapes names "
            f"{len(param_shapes)}: the tag mixes files of different saves"
        )
    base = saved["optimizer_state_dict"]
    group_of = _groups_of_sub_groups(base, len(flat), where)
    chunks: list[torch.Tensor] = []
    states: dict[int, dict[str, Any]] = {}
    for sub_group, (shapes, partition) in enumerate(zip(param_shapes, flat, strict=True)):
        sizes = [_partition(math.prod(shape), count) for shape in shapes.values()]
        if partition.numel() != sum(sizes):
            raise ValueError(
                f"{where}: sub-group {sub_group}'s fp32 partition holds {partition.numel()} "
                f"elements where its {len(sizes)} parameters need {sum(sizes)}; DeepSpeed saves "
                "state it swapped to NVMe as empty tensors, so such a tag cannot be loaded"
            )
        state = base["state"].get(sub_group)
        offset = 0
        for size in sizes:
            if state is not None:
                states[len(chunks)] = {
                    key: value[offset : offset + size]
                    if torch.is_tensor(value)
                    and value.dim() == 1
                    and value.numel() == len(partition)
                    else value
                    for key, value in state.items()
                }
            chunks.append(partition[offset : offset + size])
            offset += size
    scaler = saved.get("loss_scaler")  # DeepSpeed's loss scaler, read as a dict of its fields
    strategy: StrategyState = {
        "layout": deepspeed_zero3_layout(param_shapes, group_of, count),
        "dp_world_size": count,
        "fp32_chunks": chunks,
    }
    return {
        "optimizer": {"state": states, "param_groups": base["param_groups"]},
        "loss_scaler": dict(scaler) if scaler is not None else {"cur_scale": 1.0},
        "strategy": strategy,
    }


def zero3_shards(
    folder: Path, model_state: dict[str, Any], allow_unsafe_pickle: bool = False
) -> tuple[Callable[[int], dict[str, Any]], int]:
    """(reader of rank ``r``'s shard in the re-partitioner's form, number of shards) of the
    DeepSpeed ZeRO-3 tag ``folder`` whose rank 0 model-states file holds ``model_state``."""
    check_readable(model_state, str(folder))
    count = int(model_state["dp_world_size"])
    paths = shard_paths(folder, count)

    def read(rank: int) -> dict[str, Any]:
        if not paths[rank].is_file():
            missing = [str(p) for p in paths if not p.is_file()]
            universal = (
                " The tag holds a zero/ folder: DeepSpeed's universal form, which shardspeed "
                "reads only as its own ds_to_universal writes it; load the ZeRO-3 tag it was "
                "converted from."
                if (folder / "zero").is_dir()
                else ""
            )
            raise FileNotFoundError(
                f"DeepSpeed ZeRO-3 optimizer shards missing from the checkpoint: {missing[:4]}. "
                "ZeRO-3 keeps the module weights in them too, so every rank's shard is needed: "
                f"copy the whole tag directory.{universal}"
            )
        saved = load_file(paths[rank], allow_unsafe_pickle=allow_unsafe_pickle)
        return zero3_shard(
            saved["optimizer_state_dict"], model_state["param_shapes"], count, str(paths[rank])
        )

    return read, count


def _gather(pieces: list[torch.Tensor], numel: int, shape: torch.Size) -> torch.Tensor:
    """A parameter whole from its partitions, one per rank in order (padding dropped)."""
    return torch.cat([p.reshape(-1) for p in pieces])[:numel].clone().view(shape)


def zero3_tensors(
    folder: Path, model_state: dict[str, Any], allow_unsafe_pickle: bool = False
) -> dict[str, SavedTensor]:
    """Every entry of the module state of the DeepSpeed ZeRO-3 tag ``folder`` (whose rank 0
    model-states file holds ``model_state``), in the saved order: trainable parameters (and
    their tied names) as their fp32 masters from the optimizer shards, frozen ones from every
    rank's fragment, buffers as saved. The shards are memory-mapped; nothing is built yet."""
    read, count = zero3_shards(folder, model_state, allow_unsafe_pickle)
    shards = [read(rank) for rank in range(count)]
    shapes = {
        name: torch.Size(shape)
        for group in model_state["param_shapes"]
        for name, shape in group.items()
    }
    trainable = {}
    for index, bucket in enumerate(shards[0]["strategy"]["layout"]):
        ((name, _, numel),) = bucket["params"]
        pieces = [shard["strategy"]["fp32_chunks"][index] for shard in shards]
        trainable[name] = partial(_gather, pieces, numel, shapes[name])
    frozen = {
        name: torch.Size(shape)
        for name, shape in (model_state.get("frozen_param_shapes") or {}).items()
    }
    fragments = [model_state.get("frozen_param_fragments") or {}]
    if frozen:  # each rank's model-states file holds its partition of every frozen parameter
        for rank in range(1, count):
            path = folder / ZERO3_MODEL_STATES.format(rank)
            other = load_file(path, allow_unsafe_pickle=allow_unsafe_pickle)
            fragments.append(other["frozen_param_fragments"])
    shared = model_state.get("shared_params") or {}
    buffers = set(model_state.get("buffer_names", ()))
    result = {}
    for name, saved in model_state["module"].items():
        source = shared.get(name, name)
        if source in trainable:
            result[name] = SavedTensor(trainable[source], shapes[source], "trainable")
        elif source in frozen:
            shape = frozen[source]
            pieces = [f[source] for f in fragments]
            result[name] = SavedTensor(
                partial(_gather, pieces, shape.numel(), shape), shape, "frozen"
            )
        else:
            kind = "buffer" if name in buffers else "frozen"
            result[name] = SavedTensor(saved.detach().clone, saved.shape, kind)
    return result


def zero3_module_state(
    folder: Path, model_state: dict[str, Any], allow_unsafe_pickle: bool = False
) -> dict[str, torch.Tensor]:
    """The module state_dict of the DeepSpeed ZeRO-3 tag ``folder``, whole, each parameter in
    the dtype DeepSpeed's module had (its bf16/fp16 weights are its fp32 masters rounded, as
    DeepSpeed keeps them)."""
    saved = model_state["module"]
    return {
        name: entry.build().to(saved[name].dtype)
        for name, entry in zero3_tensors(folder, model_state, allow_unsafe_pickle).items()
    }
