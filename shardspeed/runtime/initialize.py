"""``shardspeed.initialize``: read the config once, set up communication, assemble the
engine's parts (:mod:`~shardspeed.runtime.assembly`) and hand them to the engine."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardspeed import comm
from shardspeed.config import DeepSpeedConfig, DeepSpeedConfigError
from shardspeed.config.batch import BatchSizeError
from shardspeed.runtime.assembly import assemble
from shardspeed.runtime.engine import DeepSpeedEngine
from shardspeed.runtime.hybrid_engine import DeepSpeedHybridEngine, check_hybrid_config
from shardspeed.runtime.pipe import assembly as pipe_assembly
from shardspeed.runtime.pipe.engine import PipelineEngine
from shardspeed.runtime.pipe.module import PipelineModule
from shardspeed.runtime.sequence_parallel.rules import with_mesh_param
from shardspeed.runtime.tensor_parallel.legacy import MODEL_ATTRIBUTE, merge_tp_settings
from shardspeed.utils.logging import log_dist, warning_once
from shardspeed.version import __git_branch__, __git_hash__, __version__

TORCH_DISTRIBUTED_DEFAULT_PORT = 29500


class MissingModelError(ValueError, AssertionError):
    """``initialize()`` without ``model=`` (DeepSpeed asserts)."""


class ModelAsArgsError(TypeError, AssertionError):
    """``initialize(model)``: the model given positionally lands in ``args`` (DeepSpeed asserts
    that ``model`` is given)."""


def _config_source(args: Any, config: Any, config_params: Any) -> Any:
    """The one config the user meant, from ``config``, ``config_params`` or ``args``."""
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    legacy = getattr(args, "deepscale_config", None) if args is not None else None
    if legacy is not None:
        warning_once("--deepscale_config is deprecated; use --deepspeed_config")
        from_args = from_args or legacy
    given = {
        "args.deepspeed_config": from_args,
        "config": config,
        "config_params": config_params,
    }
    present = [name for name, value in given.items() if value is not None]
    if not present:
        raise DeepSpeedConfigError(
            "no DeepSpeed config given: pass config= (a dict or a JSON/HJSON path), "
            "config_params=, or args with --deepspeed_config"
        )
    if len(present) > 1:
        raise DeepSpeedConfigError(
            f"the DeepSpeed config was given twice ({' and '.join(present)}); pass only one"
        )
    return given[present[0]]


def _autotp_size(config: DeepSpeedConfig, model: nn.Module, mpu: Any) -> int:
    """The AutoTP training degree: the config's ``tensor_parallel.autotp_size`` merged with
    what ``tp_model_init`` recorded on ``model`` (conflicts are errors)."""
    dtype = (
        torch.bfloat16 if config.bf16.enabled else torch.float16 if config.fp16.enabled else None
    )
    record = getattr(model, MODEL_ATTRIBUTE, None)
    merged = merge_tp_settings(int(config.tensor_parallel.autotp_size), dtype, record, mpu)
    if merged is None:
        return 1
    if merged.tp_group is not None:
        raise NotImplementedError(
            "tp_model_init(tp_group=...): shardspeed builds the tensor-parallel group from the "
            "topology (consecutive ranks); leave tp_group out, or pass the groups as an mpu"
        )
    return merged.tp_size


def _data_parallel_of(world: int, size: int, key: str) -> int:
    if world % size:
        raise ValueError(
            f"{key}={size} does not divide the world size {world}; launch a multiple of "
            f"{size} ranks or choose a {key} that divides {world}"
        )
    return world // size


def _autotp_batch_config(
    world_config: DeepSpeedConfig, source: Any, world: int, autotp: int
) -> DeepSpeedConfig:
    """The config with its batch triangle over the ``world / autotp`` data-parallel ranks.

    DeepSpeed counts every rank in ``train_batch_size`` under AutoTP (tensor-parallel peers
    included), and the HF Trainer fills ``"auto"`` that way (``world * micro * accumulation``):
    a ``train_batch_size`` consistent over the whole world (``world_config`` solved it) is read
    as that count, and the real global batch (``micro * accumulation * data-parallel size``)
    replaces it."""
    dp = _data_parallel_of(world, autotp, "tensor_parallel.autotp_size")
    try:
        return DeepSpeedConfig(source, dp_world_size=dp)
    except BatchSizeError:
        micro = world_config.train_micro_batch_size_per_gpu
        accumulation = world_config.gradient_accumulation_steps
        raw = world_config.raw
        raw["train_batch_size"] = micro * accumulation * dp
        log_dist(
            f"tensor_parallel.autotp_size={autotp}: train_batch_size="
            f"{world_config.train_batch_size} counts all {world} ranks (as DeepSpeed does); "
            f"the {autotp} tensor-parallel ranks of a group share one batch, so the global "
            f"batch is {raw['train_batch_size']} over {dp} data-parallel rank(s)",
            ranks=[0],
        )
        return DeepSpeedConfig(raw, dp_world_size=dp)


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Any = None,
    config: Any = None,
    mesh_param: Any = None,
    config_params: Any = None,
) -> tuple[DeepSpeedEngine, Any, Any, Any]:
    """Wrap ``model`` for training. Returns ``(engine, optimizer, training_dataloader,
    lr_scheduler)``; the last three are None when not configured."""
    log_dist(
        f"shardspeed info: version={__version__}, git-hash={__git_hash__}, "
        f"git-branch={__git_branch__}",
        ranks=[0],
    )
    if isinstance(args, nn.Module) and model is None:
        raise ModelAsArgsError(
            "initialize() got a model as its first positional argument, which is `args`; "
            "call initialize(model=model, ...) with keywords"
        )
    if model is None:
        raise MissingModelError(
            "deepspeed.initialize requires a model: pass model=<your torch.nn.Module>"
        )
    source, sp = with_mesh_param(_config_source(args, config, config_params), mesh_param)
    comm.init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
    pipeline = model if isinstance(model, PipelineModule) else None
    if pipeline is not None:
        mpu = pipe_assembly.pipeline_mpu(pipeline, mpu)
    if mpu is not None:
        dp_world_size = mpu.get_data_parallel_world_size()
    else:  # the sequence-parallel ranks of a group share one batch
        dp_world_size = _data_parallel_of(comm.get_world_size(), sp, "sequence_parallel_size")
    ds_config = DeepSpeedConfig(source, mpu=mpu, dp_world_size=dp_world_size)
    autotp = _autotp_size(ds_config, model, mpu)
    if autotp > 1 and mpu is None:  # AutoTP: the batch is split over world / autotp ranks
        ds_config = _autotp_batch_config(ds_config, source, dp_world_size, autotp)
    if autotp > 1:
        ds_config.tensor_parallel.autotp_size = autotp
    if pipeline is not None:
        pipe_assembly.check_pipeline_config(ds_config, pipeline)
        if ds_config.hybrid_engine.enabled:
            raise ValueError(
                "hybrid_engine.enabled with a PipelineModule: the hybrid engine generates with "
                "the whole model on each rank; remove hybrid_engine or train without pipeline "
                "stages"
            )
    if ds_config.hybrid_engine.enabled:  # refused before any part is built
        check_hybrid_config(ds_config.hybrid_engine, comm.get_world_size(), mpu)
    parts = assemble(
        ds_config,
        model,
        args=args,
        optimizer=optimizer,
        model_parameters=model_parameters,
        training_data=training_data,
        lr_scheduler=lr_scheduler,
        mpu=mpu,
        collate_fn=collate_fn,
    )
    if pipeline is not None:
        pipe_assembly.attach_pipeline_norm(parts, pipeline)
        engine: DeepSpeedEngine = PipelineEngine(parts)
    elif ds_config.hybrid_engine.enabled:
        engine = DeepSpeedHybridEngine(parts)
    else:
        engine = DeepSpeedEngine(parts)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler
