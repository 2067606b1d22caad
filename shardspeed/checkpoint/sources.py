"""Every saved form of optimizer state, as the per-rank shards the re-partitioner reads.

:class:`~shardspeed.checkpoint.reshard.Resharder` reads shards in one form: a bucket layout,
fp32 chunks and flat per-element optimizer state per rank. A checkpoint tag holds its optimizer
state in one of four forms, and :func:`saved_shards` finds which and hands back a reader:

- shardspeed's stage 1/2 shards (``zero_pp_rank_*``), already in that form;
- stage 0's whole state in the model file: one shard of a one-rank job whose every parameter is
  a bucket of its own (:func:`shard_from_replicated`);
- a universal folder (:mod:`shardspeed.checkpoint.ds_to_universal`): each parameter whole under
  ``zero/<name>/``, again one bucket per parameter (:func:`universal_shard`); told apart by
  that ``zero/`` folder (:func:`universal_layout`);
- DeepSpeed's own ZeRO 1/2 shards (``zero_pp_rank_*`` or, with bf16, ``bf16_zero_pp_rank_*``):
  one bucket per parameter group (:func:`shard_from_deepspeed`, :func:`deepspeed_partitions`);
- DeepSpeed's own ZeRO-3 shards: one bucket per parameter
  (:mod:`~shardspeed.checkpoint.deepspeed_zero3`), whose model-states files hold no weights:
  :func:`read_model_states` fills the module in from the shards.

Needs only torch: this module is part of the standalone ``zero_to_fp32.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from shardspeed.checkpoint.deepspeed_zero3 import zero3_module_state, zero3_shards
from shardspeed.checkpoint.files import (
    MODEL_STATES,
    UNIVERSAL_CHECKPOINT_INFO,
    UNIVERSAL_MASTER,
    is_deepspeed_zero3,
    model_states_path,
    shard_paths,
)
from shardspeed.checkpoint.layout import (
    StrategyState,
    check_layout_version,
    deepspeed_layout,
    param_bucket,
)
from shardspeed.checkpoint.reader import load_file

ShardReader = Callable[[int], dict[str, Any]]

#: the model-states key under which :mod:`~shardspeed.checkpoint.ds_to_universal` describes a
#: universal folder (its parameter groups and which parameter is in which). Not
#: :data:`~shardspeed.checkpoint.files.UNIVERSAL_CHECKPOINT_INFO`: DeepSpeed's jobs put that
#: key in their client state before converting, so any checkpoint may hold it.
UNIVERSAL_LAYOUT = "shardspeed_universal_layout"


def read_model_states(
    folder: Path, allow_unsafe_pickle: bool = False, mmap: bool = True
) -> dict[str, Any]:
    """What the model-states file of checkpoint tag ``folder``
    (:func:`~shardspeed.checkpoint.files.model_states_path`) holds, with the module state whole:
    DeepSpeed's ZeRO-3 saves its parameters empty, so they are built from its optimizer shards
    (in the dtype its module had)."""
    state = load_file(model_states_path(folder), mmap=mmap, allow_unsafe_pickle=allow_unsafe_pickle)
    if is_deepspeed_zero3(folder):
        state["module"] = zero3_module_state(folder, state, allow_unsafe_pickle)
    return state


def saved_shards(
    folder: Path, model_state: dict[str, Any], allow_unsafe_pickle: bool = False, mp_rank: int = 0
) -> tuple[ShardReader, int] | None:
    """(reader of rank ``r``'s shard, number of shards) for the optimizer state of the checkpoint
    tag ``folder`` whose model-states file (of tensor-parallel rank ``mp_rank``) holds
    ``model_state``; None if none was saved. Files
    are read safely (:func:`~shardspeed.checkpoint.reader.load_file`) unless
    ``allow_unsafe_pickle``."""
    universal = universal_layout(folder, model_state)
    if universal is not None:
        shard = universal_shard(folder, universal, allow_unsafe_pickle)
        return (lambda _: shard), 1
    if is_deepspeed_zero3(folder):
        return zero3_shards(folder, model_state, allow_unsafe_pickle)
    replicated = model_state.get("optimizer")
    if replicated is not None:
        if "strategy" not in replicated:
            raise ValueError(
                f"{folder / MODEL_STATES} holds optimizer state in a form shardspeed does not "
                "read (DeepSpeed without ZeRO, or its fp16 optimizer); DeepSpeed's ZeRO 1/2 "
                "checkpoints load. Pass load_optimizer_states=False to take the module weights"
            )
        check_layout_version(replicated["strategy"], str(folder / MODEL_STATES))
        shard = shard_from_replicated(replicated)
        return (lambda _: shard), 1
    deepspeed = "param_shapes" in model_state  # written by DeepSpeed's ZeRO 1/2
    if not model_state.get("zero_stage") and not deepspeed:
        return None  # stage 0 with nothing in "optimizer": none was saved
    count = int(model_state["dp_world_size"])
    paths = shard_paths(folder, count, mp_rank)

    def read(rank: int) -> dict[str, Any]:
        # read when first needed (a rank keeping its layout needs only its own), memory-mapped
        # (a rank reads only the pieces it re-partitions)
        if not paths[rank].is_file():
            missing = [str(p) for p in paths if not p.is_file()]
            raise FileNotFoundError(
                f"ZeRO optimizer shards missing from the checkpoint: {missing[:4]}; every rank "
                "of the saving job writes one, so copy the whole tag directory, or pass "
                "load_optimizer_states=False to take the module weights only"
            )
        saved = load_file(paths[rank], allow_unsafe_pickle=allow_unsafe_pickle)[
            "optimizer_state_dict"
        ]
        if deepspeed:
            return shard_from_deepspeed(saved, model_state["param_shapes"], count)
        check_layout_version(saved["strategy"], str(paths[rank]))
        return saved

    return read, count


def _flattened(state: dict[str, Any]) -> dict[str, Any]:
    """A parameter's optimizer state with every tensor of one or more dimensions made flat."""
    return {k: v.reshape(-1) if torch.is_tensor(v) and v.dim() > 0 else v for k, v in state.items()}


def shard_from_replicated(saved: dict[str, Any]) -> dict[str, Any]:
    """A stage 0 checkpoint's optimizer-wrapper state as the one shard of a one-rank job: state
    tensors flattened, masters the saved fp32 copies (None in fp32 training: the module weights
    are the masters, as in a stage 1/2 shard)."""
    strategy = saved["strategy"]
    layout = strategy.get("layout")
    if layout is None:
        raise ValueError("this stage 0 checkpoint carries no layout (saved by an older shardspeed)")
    saved_masters = strategy.get("fp32_masters")
    masters = {}
    if saved_masters is not None:
        masters = dict(zip(strategy["master_names"], saved_masters, strict=True))
    chunks = [
        masters[name].float().reshape(-1) if name in masters else None
        for ((name, _, _),) in (bucket["params"] for bucket in layout)
    ]
    states = {index: _flattened(state) for index, state in saved["optimizer"]["state"].items()}
    return {
        "optimizer": {"state": states, "param_groups": saved["optimizer"]["param_groups"]},
        "loss_scaler": saved["loss_scaler"],
        "strategy": {**strategy, "dp_world_size": 1, "fp32_chunks": chunks},
    }


def universal_layout(folder: Path, model_state: dict[str, Any]) -> dict[str, Any] | None:
    """The description of the universal folder ``folder`` (whose model-states file holds
    ``model_state``), or None if it is not one. A universal folder is marked by its layout, a
    ``zero/`` folder of per-parameter files, as DeepSpeed's converter writes it; the
    ``universal_checkpoint_info`` key marks nothing (it is the source job's client state)."""
    if not (folder / "zero").is_dir():
        return None
    layout = model_state.get(UNIVERSAL_LAYOUT)
    legacy = model_state.get(UNIVERSAL_CHECKPOINT_INFO)
    if layout is None and isinstance(legacy, dict) and "group_of" in legacy:
        layout = legacy  # written by an earlier shardspeed, under DeepSpeed's key
    if not isinstance(layout, dict):
        raise ValueError(
            f"{folder} is a universal checkpoint (it has a zero/ folder) that shardspeed's "
            "converter did not write, so its parameter groups are unknown; convert the "
            "original tag with python -m shardspeed.checkpoint.ds_to_universal, or load it "
            "with load_optimizer_states=False"
        )
    return layout


def universal_shard(
    folder: Path, info: dict[str, Any], allow_unsafe_pickle: bool = False
) -> dict[str, Any]:
    """A universal folder as the one shard of a one-rank job."""
    layout, chunks, states = [], [], {}
    for index, (name, group) in enumerate(info["group_of"].items()):
        files = sorted((folder / "zero" / name).glob("*.pt"))
        if not files:
            raise FileNotFoundError(f"{folder / 'zero' / name} holds no parameter files")
        values = {
            f.stem: load_file(f, allow_unsafe_pickle=allow_unsafe_pickle)["param"] for f in files
        }
        master = values.pop(UNIVERSAL_MASTER).reshape(-1)
        layout.append(param_bucket(group, index, name, master.numel()))
        chunks.append(master)
        states[index] = _flattened(values)
    strategy: StrategyState = {"layout": layout, "fp32_chunks": chunks, "dp_world_size": 1}
    return {
        "optimizer": {"state": states, "param_groups": info["param_groups"]},
        "loss_scaler": info["loss_scaler"],
        "strategy": strategy,
    }


def shard_from_deepspeed(
    saved: dict[str, Any], param_shapes: list[dict[str, Any]], count: int
) -> dict[str, Any]:
    """One rank's ``optimizer_state_dict`` from a DeepSpeed ZeRO 1/2 checkpoint, as a shard of
    the re-partitioner's form. DeepSpeed flattens each parameter group's parameters in the
    order of the model file's ``param_shapes`` (padding at the end) and splits the flat group
    into ``count`` equal partitions: one bucket per group, whose fp32 partition is
    ``single_partition_of_fp32_groups[g]`` and whose optimizer state is the base optimizer's
    state of its one flat parameter ``g``."""
    fp32 = deepspeed_partitions(saved)
    layout = deepspeed_layout(param_shapes, [p.numel() for p in fp32], count)
    scaler = saved.get("loss_scaler")  # DeepSpeed's loss scaler, read as a dict of its fields
    strategy: StrategyState = {"layout": layout, "dp_world_size": count, "fp32_chunks": fp32}
    return {
        "optimizer": saved["base_optimizer_state"],
        "loss_scaler": dict(scaler) if scaler is not None else {"cur_scale": 1.0},
        "strategy": strategy,
    }


def deepspeed_partitions(saved: dict[str, Any]) -> list[torch.Tensor]:
    """The fp32 partitions of a DeepSpeed ZeRO 1/2 shard's ``optimizer_state_dict``."""
    if "single_partition_of_fp32_groups" not in saved:
        raise ValueError(
            "this shard was written by a DeepSpeed optimizer whose format shardspeed does not "
            "read yet (its bf16 optimizer, used with ZeRO 0/1); DeepSpeed's ZeRO 1/2 "
            "checkpoints load. Pass load_optimizer_states=False to take the module weights"
        )
    return list(saved["single_partition_of_fp32_groups"])
