"""Pipeline checkpoints in DeepSpeed's layout, loadable at another pipeline and data-parallel
degree.

A tag holds one ``layer_XX-model_states.pt`` per layer that is a module (its ``state_dict()``,
written by data-parallel rank 0 of the stage that holds it), one ``mp_rank_SS_model_states.pt``
per stage ``SS`` (counters, LR scheduler, client state, the partitioning, and the optimizer
state when it is replicated) and, under ZeRO stage 1, ``zero_pp_rank_D_mp_rank_SS_optim_states
.pt`` per rank. Layer files do not depend on the partitioning, so a job with other degrees
loads each of its layers from its file, and its optimizer state through :mod:`.restage` and the
strategy's re-partitioning. Files go through the same staging, manifest and commit as every
checkpoint (:func:`shardspeed.runtime.checkpointer.save`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardspeed.checkpoint.files import existing_tag, resolve_tag
from shardspeed.checkpoint.manifest import check_tag
from shardspeed.checkpoint.reader import load_file
from shardspeed.runtime import checkpointer
from shardspeed.runtime.pipe.restage import (
    LAYER_FILE,
    STAGE_SHARD,
    STAGE_STATES,
    restaged_shard,
)
from shardspeed.runtime.rank_agreement import agree_on
from shardspeed.runtime.train_state import COUNTERS
from shardspeed.utils.logging import log_dist
from shardspeed.version import __version__

if TYPE_CHECKING:
    from shardspeed.runtime.pipe.engine import PipelineEngine

_RESERVED = {
    "module",
    "optimizer",
    "lr_scheduler",
    "dp_world_size",
    "zero_stage",
    "ds_config",
    "ds_version",
    "pipeline",
    *COUNTERS,
}


def rank_files(
    engine: PipelineEngine, client_state: dict[str, Any], exclude_frozen: bool, commits: bool
) -> dict[str, Any]:
    """This rank's files of a pipeline tag (see the module docstring)."""
    del commits
    module = engine.pipe_module
    grid = engine.grid
    files: dict[str, Any] = {}
    replicated = engine.optimizer is not None and engine.strategy.checkpoint_shard_name() is None
    optimizer_state = engine.optimizer.state_dict() if engine.optimizer is not None else None
    if engine.optimizer is not None and not replicated:
        name = STAGE_SHARD.format(grid.get_data_parallel_rank(), engine.stage_id)
        files[name] = {
            "optimizer_state_dict": optimizer_state,
            "dp_world_size": engine.dp_world_size,
        }
    if grid.get_data_parallel_rank() != 0:
        return files
    frozen = (
        {id(p) for p in module.parameters() if not p.requires_grad} if exclude_frozen else set()
    )
    for index, layer in module.layer_modules(with_forward_fn=False).items():
        state = layer.state_dict(keep_vars=True)
        files[LAYER_FILE.format(index)] = {
            key: value.detach() for key, value in state.items() if id(value) not in frozen
        }
    files[STAGE_STATES.format(engine.stage_id)] = {
        "module": None,
        "optimizer": optimizer_state if replicated else None,
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler else None,
        "dp_world_size": engine.dp_world_size,
        "zero_stage": engine.zero_optimization_stage(),
        "ds_config": engine.config.raw,
        "ds_version": __version__,
        "pipeline": {
            "stages": engine.num_stages,
            "data_parallel": grid.get_data_parallel_world_size(),
            "parts": list(module.parts),
            "num_layers": len(module._layer_specs),
        },
        **engine.state.state_dict(),
        **client_state,
    }
    return files


def save(
    engine: PipelineEngine,
    save_dir: str,
    tag: str | None,
    client_state: dict[str, Any],
    save_latest: bool,
    exclude_frozen_parameters: bool,
) -> bool:
    return checkpointer.save(
        engine,
        save_dir,
        tag,
        client_state,
        save_latest,
        exclude_frozen_parameters,
        rank_files=rank_files,  # type: ignore[arg-type]
    )


def load(
    engine: PipelineEngine,
    load_dir: str,
    tag: str | None,
    *,
    load_module_strict: bool,
    load_optimizer_states: bool,
    load_lr_scheduler_states: bool,
    custom_load_fn: Any = None,
    allow_unsafe_pickle: bool | None = None,
) -> tuple[str | None, dict[str, Any] | None]:
    """Load a pipeline tag saved at any pipeline and data-parallel degree."""
    if custom_load_fn is not None:
        raise NotImplementedError(
            "load_checkpoint(custom_load_fn=...) is not supported by the PipelineEngine; "
            "load the layers with their own load_state_dict instead"
        )
    checkpointer.wait(engine)
    config = engine.config.checkpoint
    unsafe = config.allow_unsafe_pickle if allow_unsafe_pickle is None else allow_unsafe_pickle
    tag = resolve_tag(load_dir, tag, config.load_universal)
    if tag is None:
        log_dist(f"no 'latest' file in {load_dir} and no tag given: nothing loaded", ranks=[0])
        return None, None
    folder = existing_tag(load_dir, tag)
    module = engine.pipe_module
    failure, state = None, {}
    try:
        check_tag(folder, config.verify_checksums)
        state = _stage_states(folder, unsafe)
        info = state["pipeline"]
        if int(info["num_layers"]) != len(module._layer_specs):
            raise ValueError(
                f"{folder} holds a pipeline of {info['num_layers']} layers and this "
                f"PipelineModule has {len(module._layer_specs)}; load a checkpoint of this model"
            )
        for index, layer in module.layer_modules(with_forward_fn=False).items():
            path = folder / LAYER_FILE.format(index)
            layer.load_state_dict(load_file(path, allow_unsafe_pickle=unsafe), load_module_strict)
    except Exception as error:  # every rank must learn of it before any collective
        failure = error
    agree_on(failure, f"load pipeline checkpoint {folder}", engine.device)
    module.tied.synchronize()
    saved, failure = None, None
    if load_optimizer_states and engine.optimizer is not None:
        try:
            needed = {n for b in engine.strategy.bucket_layout() for n, _, _ in b["params"]}  # type: ignore[attr-defined]
            shard = restaged_shard(folder, module._layer_specs, state["pipeline"], needed, unsafe)
            if shard is not None:
                saved = engine.strategy.sharded_state(lambda _: shard, 1, module.state_dict())
        except Exception as error:  # every rank must learn of it before any collective
            failure = error
        agree_on(failure, f"load the optimizer state of {folder}", engine.device)
    if saved is not None:
        assert engine.optimizer is not None
        engine.optimizer.load_state_dict(saved)
    elif engine.optimizer is not None:
        engine.strategy.load_state_dict({})  # the masters follow the loaded weights
    if load_lr_scheduler_states and engine.lr_scheduler is not None and state.get("lr_scheduler"):
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    engine.state.load_state_dict(state)
    client_state = {k: v for k, v in state.items() if k not in _RESERVED}
    return str(folder / STAGE_STATES.format(0)), client_state


def _stage_states(folder: Path, unsafe: bool) -> dict[str, Any]:
    path = folder / STAGE_STATES.format(0)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist: {folder} is not a pipeline checkpoint tag (check load_dir "
            "and tag)"
        )
    state: dict[str, Any] = load_file(path, mmap=False, allow_unsafe_pickle=unsafe)
    if "pipeline" not in state:
        raise ValueError(
            f"{folder} was saved by a non-pipeline engine; load it into the plain model, or "
            "save from the PipelineEngine"
        )
    return state
