"""Optimizer state of a pipeline checkpoint for another partitioning: this stage's parameters
gathered from whichever saved stages held them, as the one shard of a one-rank job
(the re-partitioner's form), which the ZeRO strategy then splits for its own data-parallel
size and buckets (:meth:`~shardspeed.runtime.zero.strategy.ZeroStrategy.sharded_state`).

Parameter names do not depend on the partitioning (layers are named by global index, tied
modules by key), so a name saved by any stage is this stage's parameter of that name; a tied
weight saved by several stages is taken from the first (they are equal).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from shardspeed.checkpoint.layout import BucketLayout, param_bucket
from shardspeed.checkpoint.reader import load_file
from shardspeed.checkpoint.reshard import Resharder
from shardspeed.checkpoint.sources import shard_from_replicated
from shardspeed.runtime.pipe.layer_spec import TiedLayerSpec

#: per stage: model states (counters, scheduler, replicated optimizer) and ZeRO shards
STAGE_STATES = "mp_rank_{:02d}_model_states.pt"
STAGE_SHARD = "zero_pp_rank_{}_mp_rank_{:02d}_optim_states.pt"
LAYER_FILE = "layer_{:02d}-model_states.pt"


def layer_prefix(specs: Sequence[Any], index: int) -> str:
    """The module-state prefix of global layer ``index``: its index, or its tied key."""
    spec = specs[index]
    return f"tied_modules.{spec.key}." if isinstance(spec, TiedLayerSpec) else f"{index}."


def saved_stage_module(
    folder: Path, specs: Sequence[Any], parts: Sequence[int], stage: int, unsafe: bool
) -> dict[str, torch.Tensor]:
    """The module state saved stage ``stage`` had, from the layer files (a tied module from
    any layer file of its key)."""
    state: dict[str, torch.Tensor] = {}
    for index in range(parts[stage], parts[stage + 1]):
        prefix = layer_prefix(specs, index)
        candidates = [index]
        spec = specs[index]
        if isinstance(spec, TiedLayerSpec):
            candidates += [
                i
                for i, s in enumerate(specs)
                if isinstance(s, TiedLayerSpec) and s.key == spec.key and i != index
            ]
        for candidate in candidates:
            path = folder / LAYER_FILE.format(candidate)
            if path.is_file():
                saved = load_file(path, allow_unsafe_pickle=unsafe)
                state.update({prefix + key: value for key, value in saved.items()})
                break
    return state


def _stage_shards(
    folder: Path, stage: int, info: dict[str, Any], unsafe: bool
) -> tuple[Callable[[int], dict[str, Any]], int] | None:
    states = load_file(folder / STAGE_STATES.format(stage), allow_unsafe_pickle=unsafe)
    replicated = states.get("optimizer")
    if replicated is not None:
        shard = shard_from_replicated(replicated)
        return (lambda _: shard), 1
    if not states.get("zero_stage"):
        return None
    count = int(info["data_parallel"])

    def read(rank: int) -> dict[str, Any]:
        path = folder / STAGE_SHARD.format(rank, stage)
        return load_file(path, allow_unsafe_pickle=unsafe)["optimizer_state_dict"]  # type: ignore[no-any-return]

    return read, count


def restaged_shard(
    folder: Path,
    specs: Sequence[Any],
    info: dict[str, Any],
    needed: set[str],
    unsafe: bool = False,
) -> dict[str, Any] | None:
    """The optimizer-wrapper state of parameters ``needed`` (by name) as one whole shard, from
    a checkpoint saved with ``info["stages"]`` stages; None if it holds no optimizer state."""
    layout: list[BucketLayout] = []
    chunks: list[torch.Tensor] = []
    states: dict[int, Any] = {}
    reference: dict[str, Any] | None = None
    for stage in range(int(info["stages"])):
        if needed <= {b["params"][0][0] for b in layout}:
            break
        shards = _stage_shards(folder, stage, info, unsafe)
        if shards is None:
            return None
        module_state = saved_stage_module(folder, specs, info["parts"], stage, unsafe)
        resharder = Resharder(*shards, module_state)
        whole_layout = [
            param_bucket(bucket["group"], 0, name, numel)
            for bucket in resharder.old_layout
            for name, _, numel in bucket["params"]
        ]
        for index, bucket in enumerate(whole_layout):
            bucket["state_index"] = index
        whole = resharder.state_for(whole_layout, 1, 0)
        reference = reference or whole
        have = {b["params"][0][0] for b in layout}
        for bucket, master in zip(whole_layout, whole["strategy"]["fp32_chunks"], strict=True):
            name = bucket["params"][0][0]
            if name not in needed or name in have:
                continue
            index = len(layout)
            layout.append(param_bucket(bucket["group"], index, name, bucket["size"]))
            chunks.append(master)
            saved_state = whole["optimizer"]["state"].get(bucket["state_index"])
            if saved_state is not None:
                states[index] = saved_state
    missing = sorted(needed - {b["params"][0][0] for b in layout})
    if missing or reference is None:
        raise ValueError(
            f"the pipeline checkpoint {folder} holds no optimizer state for {missing[:5]}; it "
            "was saved from another model (load with load_optimizer_states=False to take the "
            "layer weights only)"
        )
    return {
        "optimizer": {"state": states, "param_groups": reference["optimizer"]["param_groups"]},
        "loss_scaler": reference["loss_scaler"],
        "strategy": {"layout": layout, "fp32_chunks": chunks, "dp_world_size": 1},
    }
