"""Building an engine's parts from the config, once: the rank grid, the precision policy, the
ZeRO strategy (always, also with no optimizer), the optimizer and its wrapper, the LR scheduler,
the data loader and the monitors. :func:`shardspeed.initialize` calls :func:`assemble` and hands
the result to :class:`~shardspeed.runtime.engine.DeepSpeedEngine`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardspeed import comm
from shardspeed.accelerator import get_accelerator
from shardspeed.comm.parallel_topology import (
    ParallelTopology,
    current_topology,
    set_current_topology,
)
from shardspeed.config import DeepSpeedConfig
from shardspeed.moe.autoep import apply_autoep
from shardspeed.ops.muon.tagging import set_optimizer_flags
from shardspeed.runtime import checkpointer
from shardspeed.runtime.dataloader import build_dataloader
from shardspeed.runtime.engine_monitoring import EngineObservability
from shardspeed.runtime.engine_parts import EngineParts
from shardspeed.runtime.expert_groups import expert_comm_for
from shardspeed.runtime.onebit_setup import bind_onebit_optimizer, check_onebit_optimizer
from shardspeed.runtime.optimizer_setup import build_basic_optimizer, build_lr_scheduler
from shardspeed.runtime.precision.autocast import init_autocast_params
from shardspeed.runtime.precision.loss_scaler import loss_scaler_for_policy
from shardspeed.runtime.precision.policy import PrecisionPolicy
from shardspeed.runtime.sequence_parallel.rules import (
    check_sequence_parallel,
    sequence_parallel_size,
)
from shardspeed.runtime.tensor_parallel.apply import TensorParallelModel, apply_tensor_parallel
from shardspeed.runtime.train_state import TrainState
from shardspeed.runtime.zero.comm_group import CommGroup
from shardspeed.runtime.zero.grad_norm import GradNormReducer
from shardspeed.runtime.zero.mics import mics_comm
from shardspeed.runtime.zero.model_parallel_norm import model_parallel_reducer
from shardspeed.runtime.zero.optimizer import ZeroOptimizer
from shardspeed.runtime.zero.options import zero_options
from shardspeed.runtime.zero.reduce_options import GradReduceOptions
from shardspeed.runtime.zero.registry import build_strategy
from shardspeed.runtime.zero.rules import check_zero_config
from shardspeed.runtime.zero.strategy import StrategyContext, ZeroStrategy
from shardspeed.runtime.zero.zeropp import asks_zeropp, zeropp_comm


def autotp_size(config: DeepSpeedConfig) -> int:
    """The AutoTP training degree the config asks for (1: none)."""
    return max(int(config.tensor_parallel.autotp_size), 1)


def check_tensor_parallel(config: DeepSpeedConfig, model: nn.Module, mpu: Any) -> None:
    """What AutoTP training does not combine with, refused before anything is split."""
    size = autotp_size(config)
    if size == 1:
        return
    if hasattr(mpu, "get_pipe_parallel_world_size"):  # a PipelineModule's grid
        raise NotImplementedError(
            f"tensor_parallel.autotp_size={size} with a PipelineModule: tensor parallelism "
            "inside pipeline stages is not built in shardspeed; remove autotp_size or train "
            "without pipeline stages"
        )
    if config.expert_parallel.enabled:
        raise ValueError(
            f"expert_parallel (AutoEP) cannot be combined with tensor_parallel.autotp_size="
            f"{size} (as in DeepSpeed); remove one of them"
        )
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        raise NotImplementedError(
            f"tensor_parallel.autotp_size={size} with a model built under zero.Init: AutoTP "
            "splits whole weights, which zero.Init has already partitioned; build the model "
            "outside zero.Init (ZeRO-3 still shards every tensor-parallel piece over the "
            "data-parallel ranks at initialize)"
        )


def _autotp_specs(config: DeepSpeedConfig, model: nn.Module) -> Any:
    """The layer specs of ``partition_config`` / ``preset_model`` (None: neither is set)."""
    tp = config.tensor_parallel
    if tp.partition_config is None and tp.preset_model is None:
        return None
    from shardspeed.runtime.tensor_parallel.specs import resolve_autotp_config

    model_config = getattr(model, "config", None)
    return resolve_autotp_config(
        tp.partition_config, tp.preset_model, getattr(model_config, "model_type", None)
    )


def split_tensor_parallel(
    config: DeepSpeedConfig, model: nn.Module, topology: ParallelTopology
) -> TensorParallelModel | None:
    """AutoTP training: ``model`` split over the topology's tensor-parallel group."""
    if autotp_size(config) == 1:
        return None
    return apply_tensor_parallel(
        model,
        topology,
        grain=int(config.tensor_parallel.tensor_parallel.tp_grain_size),
        specs=_autotp_specs(config, model),
        overlap_comm=bool(config.tensor_parallel.tp_overlap_comm),
    )


def build_topology(mpu: Any, tp: int = 1, sp: int = 1) -> ParallelTopology:
    """The job's topology (every rank calls it), made current for ``utils.groups``: the
    ``mpu``'s grid (a pipeline module's grid, or sequence parallelism's ``parallel_state_sp``,
    brings its own), else ``tp`` tensor-parallel ranks (AutoTP), ``sp`` sequence-parallel
    ranks and data parallelism over the rest. The current one is kept when it already
    describes the same grid."""
    current = current_topology()
    if getattr(current, "mpu", None) is mpu and (
        mpu is not None
        or (
            current.size("tp") == tp
            and current.size("sp") == sp
            and current.size("dp") * tp * sp == comm.get_world_size()
        )
    ):
        return current
    topology = getattr(mpu, "parallel_topology", None) if mpu is not None else None
    if topology is None:
        topology = (
            ParallelTopology.from_mpu(mpu)
            if mpu is not None
            else ParallelTopology.build(tp=tp, sp=sp)
        )
    if mpu is not None and tp > 1 and topology.size("tp") != tp:
        raise ValueError(
            f"tensor_parallel.autotp_size={tp} but the mpu's tensor-parallel group has "
            f"{topology.size('tp')} ranks; make them agree (or leave autotp_size out)"
        )
    topology.mpu = mpu
    set_current_topology(topology)
    return topology


def strategy_context(
    config: DeepSpeedConfig,
    precision: PrecisionPolicy,
    topology: ParallelTopology,
    device: torch.device,
    model: nn.Module | None = None,
) -> StrategyContext:
    """What the ZeRO strategy needs from the config (and, for Mixture of Experts, ``model``:
    its MoE layers get their expert-parallel groups here)."""
    zero = config.zero_optimization
    # every rank holding the same parameters: the data-parallel ranks and, with sequence
    # parallelism, the ranks splitting one sequence (DeepSpeed's sequence-data-parallel group)
    dp = CommGroup.of(topology.group("dp", "sp"))
    comm_for = None
    if model is not None:
        comm_for = expert_comm_for(
            model, dp, int(zero.stage), bool(config.use_data_before_expert_parallelism)
        )
    shard_over = None
    if zero.mics_shard_size > 0 and zero.stage == 3:
        if comm_for is not None:
            raise NotImplementedError(
                "zero_optimization.mics_shard_size (MiCS) with Mixture-of-Experts layers is not "
                "supported in shardspeed; remove mics_shard_size"
            )
        shard_over = mics_comm(topology, int(zero.mics_shard_size))
    if zero.stage == 3 and asks_zeropp(zero):
        if comm_for is not None or shard_over is not None:
            other, remove = (
                ("MiCS (mics_shard_size)", "mics_shard_size")
                if shard_over is not None
                else ("Mixture-of-Experts layers", "the MoE layers")
            )
            raise NotImplementedError(
                f"ZeRO++ (zero_hpz_partition_size / zero_quantized_*) with {other} is not "
                f"supported in shardspeed; remove the ZeRO++ keys or {remove}"
            )
        shard_over = zeropp_comm(topology, zero, dp)
    return StrategyContext(
        precision=precision,
        reduce=GradReduceOptions(
            allreduce_op=config.gradient_allreduce_op,
            prescale_gradients=config.prescale_gradients,
            gradient_predivide_factor=config.gradient_predivide_factor,
            communication_data_type=precision.comm_dtype,
            bucket_size=int(zero.reduce_bucket_size),
            overlap_comm=bool(zero.overlap_comm),
        ),
        data_parallel=dp,
        device=device,
        options=zero_options(zero, config.aio),
        allow_untested_optimizer=bool(config.zero_allow_untested_optimizer),
        grad_accum_dtype=config.data_types.grad_accum_dtype,
        comm_for=comm_for,
        shard_over=shard_over,
    )


def wrap_optimizer(
    strategy: ZeroStrategy,
    config: DeepSpeedConfig,
    precision: PrecisionPolicy,
    reducer: GradNormReducer | None = None,
) -> ZeroOptimizer:
    """The optimizer the user gets: the strategy's bound optimizer with loss scaling,
    overflow checks and clipping by the norm ``reducer`` takes (default: over the
    data-parallel groups)."""
    return ZeroOptimizer(
        strategy,
        loss_scaler_for_policy(precision, config.fp16),
        gradient_clipping=float(config.gradient_clipping),
        check_overflow=precision.needs_loss_scaling,
        reducer=reducer,
    )


def _parameters_of(model: nn.Module, given: Any) -> list[Any]:
    """``model_parameters`` checked against the model AutoEP just changed: a list made before
    ``initialize`` holds the experts it replaced, which nothing would train."""
    items = [
        {**item, "params": list(item["params"])} if isinstance(item, dict) else item
        for item in given
    ]
    live = {id(p) for p in model.parameters()}
    for item in items:
        for tensor in item["params"] if isinstance(item, dict) else [item]:
            if id(tensor) not in live:
                raise ValueError(
                    f"model_parameters holds a tensor of shape {tuple(tensor.shape)} that is not "
                    "in the model after AutoEP replaced its MoE blocks (a list built before "
                    "initialize); pass model.parameters() lazily, or leave model_parameters out"
                )
    return items


def assemble(
    config: DeepSpeedConfig,
    model: nn.Module,
    *,
    args: Any = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    mpu: Any = None,
    collate_fn: Any = None,
    dont_change_device: bool = False,
) -> EngineParts:
    """Every part of an engine for ``model`` under ``config``."""
    checkpointer.check_config(config)
    check_zero_config(config)
    check_tensor_parallel(config, model, mpu)
    check_sequence_parallel(config, mpu, comm.get_world_size())
    topology = build_topology(mpu, autotp_size(config), sequence_parallel_size(config, mpu))
    tensor_parallel = split_tensor_parallel(config, model, topology)
    dp = CommGroup.of(topology.group("dp"))
    if config.expert_parallel.enabled:  # AutoEP: swap HF MoE blocks before ZeRO sees the model
        apply_autoep(
            model,
            config.expert_parallel,
            zero_stage=int(config.zero_optimization.stage),
            autotp_size=int(config.tensor_parallel.autotp_size),
            mpu=mpu,
            use_data_before_expert_parallel=bool(config.use_data_before_expert_parallelism),
        )
        if model_parameters is not None:
            model_parameters = _parameters_of(model, model_parameters)
    precision = PrecisionPolicy.from_sections(
        config.fp16, config.bf16, config.torch_autocast, config.communication_data_type
    )
    if precision.autocast_dtype is not None:
        # DeepSpeed's module-level record, for user code that asks get_comm_dtype(param)
        init_autocast_params(
            model, precision.autocast_dtype, list(precision.lower_precision_safe_modules)
        )
    device = torch.device(get_accelerator().current_device_name())
    strategy = build_strategy(model, strategy_context(config, precision, topology, device, model))
    strategy.place_module(move=not dont_change_device)
    set_optimizer_flags(config, model)  # Muon: tag use_muon, as DeepSpeed's initialize does
    params = model_parameters if model_parameters is not None else model.parameters()
    basic_optimizer = build_basic_optimizer(
        optimizer, params, config, cpu_offload=strategy.offload.enabled
    )
    wrapped = None
    if basic_optimizer is not None:
        check_onebit_optimizer(basic_optimizer, strategy, topology)
        strategy.bind_optimizer(basic_optimizer)
        bind_onebit_optimizer(basic_optimizer, strategy)
        # with an mpu the norm also adds the tensor-parallel shards and pipeline stages
        reducer = model_parallel_reducer(strategy, model, topology)
        wrapped = wrap_optimizer(strategy, config, precision, reducer)
    state = TrainState()
    loader = None
    if training_data is not None:
        loader = build_dataloader(
            training_data, config, dp.world_size, dp.rank, collate_fn=collate_fn
        )
    return EngineParts(
        config=config,
        module=model,
        device=device,
        precision=precision,
        data_parallel=dp,
        global_rank=comm.get_rank(),
        strategy=strategy,
        optimizer=wrapped,
        basic_optimizer=basic_optimizer,
        lr_scheduler=build_lr_scheduler(lr_scheduler, config, basic_optimizer),
        training_dataloader=loader,
        observability=EngineObservability(
            config, model, state, dp, comm.get_rank(), precision.needs_loss_scaling
        ),
        state=state,
        topology=topology,
        tensor_parallel=tensor_parallel,
        args=args,
        mpu=mpu,
        collate_fn=collate_fn,
    )
