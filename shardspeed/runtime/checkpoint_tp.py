"""AutoTP checkpoints in the ZeRO format: what a tensor-parallel rank saves, and loading a
checkpoint saved at any tensor-parallel size into a model split at any other (or whole).

Saving: every tensor-parallel rank ``t`` has files of its own, as DeepSpeed names them
(``mp_rank_{t:02d}_model_states.pt`` from the first data-parallel rank of its group,
``zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt`` from every data-parallel rank ``d``), and
the record of the save gains the split of every split parameter
(:class:`~shardspeed.checkpoint.tp_layout.TpRecord`, from ``param.tp_layout``).

Loading: the module weights are assembled whole from the saved ranks' pieces and cut to this
rank's piece; the optimizer state (fp32 masters and every per-element state such as Adam's
``exp_avg``/``exp_avg_sq``) of each saved rank is first re-partitioned into whole pieces (one
bucket per parameter, :class:`~shardspeed.checkpoint.reshard.Resharder`), assembled whole and
cut the same way, then handed to the strategy as the one shard of a one-rank job, which it
re-partitions for its own stage and data-parallel size like any other checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from shardspeed.checkpoint.files import MODEL_STATES, tp_file_name
from shardspeed.checkpoint.layout import param_bucket
from shardspeed.checkpoint.planner import TensorPiece
from shardspeed.checkpoint.reader import load_file
from shardspeed.checkpoint.reshard import Resharder
from shardspeed.checkpoint.sources import saved_shards
from shardspeed.checkpoint.tp_layout import TpLayoutError, TpRecord, TpSplit, tp_record_of
from shardspeed.runtime.tensor_parallel.gather import split_parameters
from shardspeed.runtime.tensor_parallel.partition import SplitLayout

if TYPE_CHECKING:
    from torch import nn

    from shardspeed.runtime.engine import DeepSpeedEngine


def tp_rank_and_size(engine: DeepSpeedEngine) -> tuple[int, int]:
    """This rank's index in its tensor-parallel group and the group's size ((0, 1) without
    AutoTP)."""
    tp = getattr(engine, "tensor_parallel", None)
    if tp is None:
        return 0, 1
    return tp.group.rank, tp.group.world_size


def tp_record(module: nn.Module, size: int) -> TpRecord:
    """The tensor-parallel section of the record of a save of ``module`` split over ``size``
    ranks: every split parameter's whole shape, split dimension and every rank's ranges."""
    splits = {
        name: TpSplit(
            tuple(layout.full_shape), layout.dim, tuple(piece.pieces for piece in layout.pieces)
        )
        for name, layout in split_parameters(module).items()
    }
    return TpRecord(size, splits)


def module_pieces(state: dict[str, Any], record: TpRecord | None, rank: int) -> list[TensorPiece]:
    """The pieces tensor-parallel rank ``rank``'s module state ``state`` holds: each split
    tensor at its ranges of the whole, the others whole."""
    pieces = []
    for name, value in state.items():
        if not torch.is_tensor(value):
            continue
        split = None if record is None else record.splits.get(name)
        if split is None:
            pieces.append(TensorPiece.whole(name, value.shape))
            continue
        for start, stop in split.ranks[rank]:
            offsets = [0] * len(split.full_shape)
            offsets[split.dim] = start
            shape = list(split.full_shape)
            shape[split.dim] = stop - start
            pieces.append(TensorPiece(name, split.full_shape, tuple(offsets), tuple(shape)))
    return pieces


def involved(engine: DeepSpeedEngine, state: dict[str, Any], where: str) -> bool:
    """Whether loading ``state`` (the model-states file read from ``where``) into ``engine``
    goes through tensor-parallel pieces: saved by an AutoTP job, or loaded into one."""
    return tp_record_of(state, where) is not None or tp_rank_and_size(engine)[1] > 1


def saved_states(folder: Path, state: dict[str, Any], unsafe: bool) -> list[dict[str, Any]]:
    """Every saved tensor-parallel rank's model-states file (``state``: rank 0's), each checked
    against the record's tensor-parallel section."""
    record = tp_record_of(state, str(folder / MODEL_STATES))
    if record is None:
        return [state]
    states = [state]
    for rank in range(1, record.size):
        path = folder / tp_file_name(MODEL_STATES, rank)
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} is missing: the checkpoint was saved by {record.size} tensor-parallel "
                "ranks, each with its own model-states file; copy the whole tag folder"
            )
        states.append(load_file(path, allow_unsafe_pickle=unsafe))
    for rank, saved in enumerate(states):
        name = tp_file_name(MODEL_STATES, rank)
        record.check_state(saved["module"], rank, str(folder / name))
    return states


def whole_module_state(folder: Path, state: dict[str, Any], unsafe: bool) -> dict[str, Any]:
    """The saved module state with every split tensor whole."""
    states = saved_states(folder, state, unsafe)
    record = tp_record_of(state, str(folder / MODEL_STATES))
    if record is None:
        return dict(state["module"])
    return record.assemble_state([s["module"] for s in states])


def cut_for(
    engine: DeepSpeedEngine, layouts: Mapping[str, SplitLayout], name: str, whole: torch.Tensor
) -> torch.Tensor:
    """This rank's piece of tensor ``name`` from the whole tensor (itself where it is not
    split here; ``layouts``: this model's splits, :func:`split_parameters`)."""
    layout = layouts.get(name)
    if layout is None:
        return whole
    if tuple(whole.shape) != tuple(layout.full_shape):
        raise TpLayoutError(
            f"the checkpoint holds {name!r} whole with shape {list(whole.shape)}, but this "
            f"model's {name!r} is split from a whole of {list(layout.full_shape)}: the "
            "checkpoint is of another model"
        )
    rank, _ = tp_rank_and_size(engine)
    return layout.take(whole, rank).clone()


def local_module_state(engine: DeepSpeedEngine, whole: dict[str, Any]) -> dict[str, Any]:
    """``whole`` (a whole module state) cut to this rank's pieces (tied names stay one)."""
    layouts = split_parameters(engine.module)
    cut: dict[int, torch.Tensor] = {}
    out = {}
    for name, value in whole.items():
        if not torch.is_tensor(value):
            out[name] = value
        elif id(value) in cut:
            out[name] = cut[id(value)]
        else:
            out[name] = cut[id(value)] = cut_for(engine, layouts, name, value)
    return out


def optimizer_shard(
    engine: DeepSpeedEngine, folder: Path, state: dict[str, Any], unsafe: bool
) -> dict[str, Any] | None:
    """The checkpoint's optimizer state as the one shard of a one-rank job holding this
    rank's pieces, one bucket per parameter (None if none was saved)."""
    record = tp_record_of(state, str(folder / MODEL_STATES))
    states = saved_states(folder, state, unsafe)
    per_rank = []
    for rank, saved in enumerate(states):
        shards = saved_shards(folder, saved, unsafe, mp_rank=rank)
        if shards is None:
            return None
        resharder = Resharder(*shards, saved["module"])
        layout = [
            param_bucket(bucket["group"], 0, name, numel)
            for bucket in resharder.old_layout
            for name, _, numel in bucket["params"]
        ]
        for index, bucket in enumerate(layout):
            bucket["state_index"] = index
        groups = resharder.reference["optimizer"]["param_groups"]
        per_rank.append((layout, resharder.state_for(layout, 1, 0, groups)))
    layout0, first = per_rank[0]
    layouts = split_parameters(engine.module)
    new_layout, masters, new_states = [], [], {}
    for index, bucket in enumerate(layout0):
        ((name, _, _),) = bucket["params"]
        split = None if record is None else record.splits.get(name)

        def whole(
            values: list[torch.Tensor], split: TpSplit | None = split, name: str = name
        ) -> torch.Tensor:
            if split is None:
                return values[0].view(states[0]["module"][name].shape)
            parts = [v.view(split.local_shape(r)) for r, v in enumerate(values)]
            return split.assemble(parts)

        chunks = [out["strategy"]["fp32_chunks"][index] for _, out in per_rank]
        master = cut_for(engine, layouts, name, whole(chunks)).reshape(-1)
        masters.append(master)
        new_layout.append(param_bucket(bucket["group"], index, name, master.numel()))
        saved = first["optimizer"]["state"].get(index)
        if saved is None:
            continue
        numel = chunks[0].numel()
        new_states[index] = {
            key: cut_for(
                engine,
                layouts,
                name,
                whole([o["optimizer"]["state"][index][key] for _, o in per_rank]),
            ).reshape(-1)
            if torch.is_tensor(value) and value.dim() == 1 and value.numel() == numel
            else value
            for key, value in saved.items()
        }
    strategy = {**first["strategy"], "layout": new_layout, "fp32_chunks": masters}
    strategy.update(dp_world_size=1, chunk_numel=[m.numel() for m in masters])
    return {
        "optimizer": {"state": new_states, "param_groups": first["optimizer"]["param_groups"]},
        "loss_scaler": first["loss_scaler"],
        "strategy": strategy,
    }
