"""Pipeline checkpoints in DeepSpeed's layout, loadable at another pipeline and data-parallel
degree.

A tag holds one ``layer_XX-model_states.pt`` per layer that is a module (its ``state_dict()``,
written by data-parallel rank 0 of the stage that holds it), one ``mp_rank_SS_model_states.pt``
per stage ``SS`` (counters, LR scheduler, client state, the partitioning, and the optimizer
state when it is replicated) and, under ZeRO stage 1, ``zero_pp_rank_D_mp_rank_SS_optim_states
.pt`` per rank. Layer files do not depend on the partitioning, so a job with other degrees
loads each of its layers from its file, and its optimizer state through :mod:`.restage` and the
strategy's re-partitioning. Saves and loads go through the one writer and reader
(:class:`~shardspeed.runtime.checkpoint_format.PlannedFormat`).

What each file holds, as the planner records it (:mod:`~shardspeed.checkpoint.planner`), each
stage's files being one copy of its tensors (a tied weight is in several stages): a layer file
its module's tensors whole, named as the pipeline names them (``<layer>.<key>``, or
``tied_modules.<key>.<key>``); a stage file its replicated optimizer state whole; a stage shard
the ranges of each parameter's flattened elements in its chunk of each bucket.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardspeed.checkpoint.planner import (
    MODULE,
    OPTIMIZER,
    SavePlan,
    Shape,
    layout_pieces,
    whole_pieces,
)
from shardspeed.checkpoint.reader import load_file
from shardspeed.runtime.checkpoint_format import PlannedFormat
from shardspeed.runtime.pipe.restage import (
    LAYER_FILE,
    STAGE_SHARD,
    STAGE_STATES,
    layer_prefix,
    restaged_shard,
)
from shardspeed.runtime.train_state import COUNTERS
from shardspeed.runtime.zero_checkpoint import param_shapes
from shardspeed.version import __version__

if TYPE_CHECKING:
    from shardspeed.runtime.checkpoint_reader import LoadOptions
    from shardspeed.runtime.pipe.engine import PipelineEngine


class PipelineFormat(PlannedFormat["PipelineEngine"]):
    """:class:`~shardspeed.runtime.checkpoint_format.PlannedFormat` of the
    :class:`~shardspeed.runtime.pipe.engine.PipelineEngine` (see the module docstring)."""

    reserved = frozenset(
        {
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
    )

    # -- save ---------------------------------------------------------------------------------
    def plan_save(
        self,
        engine: PipelineEngine,
        client_state: dict[str, Any],
        exclude_frozen_parameters: bool,
        commits: bool,
    ) -> SavePlan:
        """This rank's files of a pipeline tag (see the module docstring)."""
        del commits
        module, grid, stage = engine.pipe_module, engine.grid, engine.stage_id
        first = grid.get_data_parallel_rank() == 0
        plan = SavePlan({}, record_file=STAGE_STATES.format(0) if first and stage == 0 else None)
        files, shapes = plan.files, param_shapes(module)
        replicated = (
            engine.optimizer is not None and engine.strategy.checkpoint_shard_name() is None
        )
        optimizer_state = engine.optimizer.state_dict() if engine.optimizer is not None else None
        if optimizer_state is not None and not replicated:
            dp_rank, count = grid.get_data_parallel_rank(), engine.dp_world_size
            name = STAGE_SHARD.format(dp_rank, stage)
            files[name] = {"optimizer_state_dict": optimizer_state, "dp_world_size": count}
            layout = optimizer_state["strategy"].get("layout", [])
            plan.hold(name, OPTIMIZER, layout_pieces(layout, count, dp_rank, shapes), stage)
        if not first:
            return plan
        frozen = (
            {id(p) for p in module.parameters() if not p.requires_grad}
            if exclude_frozen_parameters
            else set()
        )
        for index, layer in module.layer_modules(with_forward_fn=False).items():
            state = layer.state_dict(keep_vars=True)
            name = LAYER_FILE.format(index)
            files[name] = {k: v.detach() for k, v in state.items() if id(v) not in frozen}
            prefix = layer_prefix(module._layer_specs, index)
            plan.hold(name, MODULE, whole_pieces(files[name], prefix), stage)
        name = STAGE_STATES.format(stage)
        files[name] = {
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
        if replicated and optimizer_state is not None:
            layout = optimizer_state["strategy"].get("layout", [])
            plan.hold(name, OPTIMIZER, layout_pieces(layout, 1, 0, shapes), stage)
        return plan

    # -- load ---------------------------------------------------------------------------------
    def check_options(self, options: LoadOptions) -> None:
        if options.custom_load_fn is not None:
            raise NotImplementedError(
                "load_checkpoint(custom_load_fn=...) is not supported by the PipelineEngine; "
                "load the layers with their own load_state_dict instead"
            )

    def states_path(self, folder: Path) -> Path:
        path = folder / STAGE_STATES.format(0)
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} does not exist: {folder} is not a pipeline checkpoint tag (check "
                "load_dir and tag)"
            )
        return path

    def read_states(self, folder: Path, path: Path, unsafe: bool) -> dict[str, Any]:
        state: dict[str, Any] = load_file(path, mmap=False, allow_unsafe_pickle=unsafe)
        if "pipeline" not in state:
            raise ValueError(
                f"{folder} was saved by a non-pipeline engine; load it into the plain model, or "
                "save from the PipelineEngine"
            )
        return state

    def expected(
        self, engine: PipelineEngine, module: bool, optimizer: bool
    ) -> Mapping[str, Mapping[str, Shape]]:
        stage = engine.pipe_module
        out: dict[str, dict[str, Shape]] = {}
        if module:
            named = chain(
                stage.named_parameters(remove_duplicate=False),
                stage.named_buffers(remove_duplicate=False),
            )
            out[MODULE] = {n: tuple(t.shape) for n, t in named}
        if optimizer:
            trained = stage.named_parameters()  # tied: under its first name, as stepped
            out[OPTIMIZER] = {n: tuple(p.shape) for n, p in trained if p.requires_grad}
        return out

    def read_module(
        self,
        engine: PipelineEngine,
        folder: Path,
        state: dict[str, Any],
        unsafe: bool,
        options: LoadOptions,
    ) -> Any:
        """Load each of this stage's layers from its file (no collective)."""
        module = engine.pipe_module
        saved_layers = int(state["pipeline"]["num_layers"])
        if saved_layers != len(module._layer_specs):
            raise ValueError(
                f"{folder} holds a pipeline of {saved_layers} layers and this PipelineModule "
                f"has {len(module._layer_specs)}; load a checkpoint of this model"
            )
        for index, layer in module.layer_modules(with_forward_fn=False).items():
            saved = load_file(folder / LAYER_FILE.format(index), allow_unsafe_pickle=unsafe)
            layer.load_state_dict(saved, options.module_strict)
        return None

    def apply_module(self, engine: PipelineEngine, weights: Any, options: LoadOptions) -> None:
        engine.pipe_module.tied.synchronize()

    def optimizer_state(
        self, engine: PipelineEngine, folder: Path, state: dict[str, Any], unsafe: bool
    ) -> dict[str, Any] | None:
        """This stage's parameters' state, gathered by name from the saved stages as one whole
        shard (:mod:`.restage`), re-partitioned by the strategy."""
        module = engine.pipe_module
        needed = {n for b in engine.strategy.bucket_layout() for n, _, _ in b["params"]}  # type: ignore[attr-defined]
        shard = restaged_shard(folder, module._layer_specs, state["pipeline"], needed, unsafe)
        if shard is None:
            return None
        return engine.strategy.sharded_state(lambda _: shard, 1, module.state_dict())


#: the format the pipeline engine saves and loads through
PIPELINE_FORMAT = PipelineFormat()
