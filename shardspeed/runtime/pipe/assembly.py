"""What :func:`shardspeed.initialize` does differently for a :class:`~.module.PipelineModule`:
the grid is the ``mpu``, the ``pipeline`` config section is checked against the module, ZeRO
stages 2 and 3 are refused (a rule of :mod:`~shardspeed.runtime.zero.rules`), so is progressive
layer drop, and the engine is a :class:`~.engine.PipelineEngine` whose optimizer takes the
gradient norm over every stage."""

from __future__ import annotations

from typing import Any

from shardspeed.config import DeepSpeedConfig
from shardspeed.runtime.activation_checkpointing import checkpointing
from shardspeed.runtime.engine_parts import EngineParts
from shardspeed.runtime.pipe.module import PipelineModule
from shardspeed.runtime.progressive_layer_drop import refuse_in_pipeline
from shardspeed.runtime.zero.model_parallel_norm import model_parallel_reducer
from shardspeed.runtime.zero.rules import check_zero_config
from shardspeed.utils.logging import log_dist


def pipeline_mpu(model: PipelineModule, mpu: Any) -> Any:
    """The grid of ``model`` (DeepSpeed: ``initialize`` with a PipelineModule takes no mpu)."""
    if mpu is not None:
        raise ValueError(
            "initialize(mpu=...) with a PipelineModule: the module's topology is the grid "
            "(model.mpu()); leave mpu out"
        )
    return model.mpu()


def check_pipeline_config(config: DeepSpeedConfig, model: PipelineModule) -> None:
    """Refuse what a pipeline cannot do and apply the ``pipeline`` section to the module."""
    check_zero_config(config, pipeline=True)
    refuse_in_pipeline(config)
    section = config.pipeline
    if section.stages != "auto" and int(section.stages) != model.num_stages:
        raise ValueError(
            f"pipeline.stages={section.stages} but the PipelineModule has {model.num_stages} "
            "stages; set pipeline.stages to 'auto' or to the module's num_stages"
        )
    if section.activation_checkpoint_interval > 0:
        model.activation_checkpoint_interval = section.activation_checkpoint_interval
    if not section.use_reentrant:
        # also when the interval is 0 here: set_checkpoint_interval() may turn it on later
        model.activation_checkpoint_func = checkpointing.non_reentrant_checkpoint
    model._precompute_checkpointable_values()
    if section.seed_layers:
        model.seed_layers = True
    if model.mpu().get_slice_parallel_world_size() > 1 and (
        section.pipe_partitioned or section.grad_partitioned
    ):
        log_dist(
            "pipeline.pipe_partitioned / grad_partitioned: activations and gradients travel "
            "whole between stages in shardspeed (no split over the tensor-slice group)",
            ranks=[0],
        )


def attach_pipeline_norm(parts: EngineParts, model: PipelineModule) -> None:
    """Give the optimizer the pipeline's norm: every stage's and tensor slice's squares (the
    grid's model-parallel group), tied weights and tensor-parallel duplicates counted once."""
    if parts.optimizer is None:
        return
    parts.optimizer.reducer = model_parallel_reducer(
        parts.strategy, model, parts.topology, also_uncounted=model.tied.duplicates()
    )
