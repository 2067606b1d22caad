"""The training engine: forward, backward, step, and the checkpoint verbs.

The engine owns the micro-step counter and composes its parts through their interfaces: a
:class:`~shardspeed.runtime.zero.strategy.ZeroStrategy` (how state is split across ranks), a
:class:`~shardspeed.runtime.zero.optimizer.ZeroOptimizer` (loss scaling, overflow, clipping), an
LR scheduler and a data loader. It never branches on the ZeRO stage.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from shardspeed import comm
from shardspeed.accelerator import get_accelerator
from shardspeed.config import DeepSpeedConfig
from shardspeed.runtime import checkpointer
from shardspeed.runtime.dataloader import DeepSpeedDataLoader
from shardspeed.runtime.engine_monitoring import EngineObservability
from shardspeed.runtime.optimizer_setup import build_basic_optimizer, build_lr_scheduler
from shardspeed.runtime.precision.loss_scaler import loss_scaler_for_policy
from shardspeed.runtime.precision.policy import PrecisionPolicy
from shardspeed.runtime.torch_autocast import autocast_if_enabled
from shardspeed.runtime.zero.optimizer import ZeroOptimizer
from shardspeed.runtime.zero.registry import build_strategy
from shardspeed.runtime.zero.strategy import GradReduceOptions, StrategyContext
from shardspeed.utils.logging import log_dist
from shardspeed.utils.timer import (
    BACKWARD_INNER_GLOBAL_TIMER,
    BACKWARD_REDUCE_GLOBAL_TIMER,
    STEP_GLOBAL_TIMER,
)

ROUTE_TRAIN = "train"
ROUTE_EVAL = "eval"


class DeepSpeedEngine(nn.Module):
    """Wraps a model for distributed training; returned by :func:`shardspeed.initialize`."""

    def __init__(
        self,
        args: Any,
        model: nn.Module,
        optimizer: Any = None,
        model_parameters: Any = None,
        training_data: Any = None,
        lr_scheduler: Any = None,
        mpu: Any = None,
        dist_init_required: bool | None = None,
        collate_fn: Any = None,
        config: Any = None,
        config_class: DeepSpeedConfig | None = None,
        mesh_device: Any = None,
        dont_change_device: bool = False,
    ) -> None:
        super().__init__()
        del dist_init_required, mesh_device  # initialize() already set up the process group
        self.args = args
        self.mpu = mpu
        self.collate_fn = collate_fn
        self._config = config_class if config_class is not None else DeepSpeedConfig(config)
        checkpointer.check_config(self._config)
        self.module = model
        self.micro_steps = 0
        #: ``micro_steps`` when the current accumulation window opened (a loaded checkpoint
        #: opens a new one: it holds no partly accumulated gradients, and may have been saved
        #: with another gradient_accumulation_steps)
        self._window_start = 0
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self._step_applied = False
        self._no_sync = False
        self._coalescing = False
        self._boundary_override: bool | None = None

        self._setup_data_parallel_group(mpu)
        self.precision = PrecisionPolicy.from_sections(
            self._config.fp16,
            self._config.bf16,
            self._config.torch_autocast,
            self._config.communication_data_type,
        )
        self.device = torch.device(get_accelerator().current_device_name())
        self._configure_module(dont_change_device)

        params = model_parameters if model_parameters is not None else self.module.parameters()
        self.basic_optimizer = build_basic_optimizer(optimizer, params, self._config)
        self.optimizer: ZeroOptimizer | None = None
        if self.basic_optimizer is not None:
            self.optimizer = self._build_zero_optimizer(self.basic_optimizer)
        self.lr_scheduler = build_lr_scheduler(lr_scheduler, self._config, self.basic_optimizer)
        self.training_dataloader = (
            self.deepspeed_io(training_data) if training_data is not None else None
        )
        self.observability = EngineObservability(self)

    # -- construction -----------------------------------------------------------------------
    def _setup_data_parallel_group(self, mpu: Any) -> None:
        if mpu is not None:
            self.dp_group = mpu.get_data_parallel_group()
        else:
            self.topology = comm.Topology(axes={"data": comm.get_world_size()})
            self.dp_group = self.topology.get_group("data")
        self.dp_world_size = comm.get_world_size(self.dp_group)
        self.dp_rank = comm.get_rank(self.dp_group)
        self.global_rank = comm.get_rank()

    def _configure_module(self, dont_change_device: bool) -> None:
        dtype = self.precision.param_dtype
        if dtype != torch.float32:
            self.module.to(dtype=dtype)
        if not dont_change_device:
            self.module.to(self.device)
        self._broadcast_module()

    def _broadcast_module(self) -> None:
        """Start every data-parallel rank from the same weights and buffers as its group's rank 0."""
        if self.dp_world_size == 1:
            return
        src = comm.get_global_rank(self.dp_group, 0) if self.dp_group is not None else 0
        for tensor in [*self.module.parameters(), *self.module.buffers()]:
            comm.broadcast(tensor.data, src=src, group=self.dp_group)

    def _build_zero_optimizer(self, basic_optimizer: torch.optim.Optimizer) -> ZeroOptimizer:
        zero = self._config.zero_optimization
        ctx = StrategyContext(
            dp_group=self.dp_group,
            dp_world_size=self.dp_world_size,
            dp_rank=self.dp_rank,
            precision=self.precision,
            reduce=GradReduceOptions(
                prescale_gradients=self._config.prescale_gradients,
                gradient_predivide_factor=self._config.gradient_predivide_factor,
                communication_data_type=self.precision.comm_dtype,
                bucket_size=int(zero.reduce_bucket_size),
                overlap_comm=bool(zero.overlap_comm),
            ),
            zero_config=zero,
            allow_untested_optimizer=bool(self._config.zero_allow_untested_optimizer),
            grad_accum_dtype=self._config.data_types.grad_accum_dtype,
        )
        strategy = build_strategy(self.module, basic_optimizer, ctx)
        scaler = loss_scaler_for_policy(self.precision, self._config.fp16)
        return ZeroOptimizer(
            strategy,
            scaler,
            gradient_clipping=float(self._config.gradient_clipping),
            check_overflow=self.precision.needs_loss_scaling,
        )

    # -- the training verbs -------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        policy = self.precision
        with (
            self.observability.forward(inputs),
            autocast_if_enabled(
                policy.autocast_enabled,
                policy.autocast_dtype,
                self.device.type,
                native_low_precision=policy.param_dtype != torch.float32,
            ),
        ):
            return self.module(*inputs, **kwargs)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss multiplied by the active loss scale (for a manual ``.backward()``)."""
        return loss if self.optimizer is None else self.optimizer.scale_loss(loss)

    def backward(
        self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True
    ) -> torch.Tensor:
        """Backpropagate ``loss`` (divided by the accumulation steps); reduce gradients at the
        accumulation boundary. Returns the loss as scaled for accumulation."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(
                "engine.backward(loss) takes the scalar loss tensor of a forward pass; got "
                f"{type(loss).__name__}{'' if not isinstance(loss, torch.Tensor) else tuple(loss.shape)}"
            )
        if self.optimizer is None:
            raise RuntimeError(
                "engine.backward() needs an optimizer: pass optimizer= to initialize() or add an "
                "'optimizer' section to the config"
            )
        with self.observability.backward(loss):
            gas = self.gradient_accumulation_steps()
            if scale_wrt_gas and gas > 1:
                loss = loss / gas
            strategy = self.optimizer.strategy
            strategy.begin_backward(
                reduce=self.is_gradient_accumulation_boundary()
                and not (self._no_sync or self._coalescing)
            )
            with self.observability.phase(BACKWARD_INNER_GLOBAL_TIMER):
                self.optimizer.scale_loss(loss).backward(retain_graph=retain_graph)
            with self.observability.phase(BACKWARD_REDUCE_GLOBAL_TIMER):
                strategy.end_backward()
        return loss

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """Update the weights if this micro-step ends a gradient-accumulation window."""
        if self._coalescing:
            raise RuntimeError(
                "engine.step() inside coalesce_grad_reduction(): gradients are reduced when the "
                "block exits, so call step() after it"
            )
        self._step_applied = False
        boundary = self.is_gradient_accumulation_boundary()
        if boundary:
            if self.optimizer is None:
                raise RuntimeError(
                    "engine.step() needs an optimizer (see initialize(optimizer=...))"
                )
            with self.observability.phase(STEP_GLOBAL_TIMER):
                self._step_applied = self.optimizer.step()
                if self._step_applied:
                    if self.lr_scheduler is not None:
                        self.lr_scheduler.step(**(lr_kwargs or {}))
                else:
                    self.skipped_steps += 1
            self.global_steps += 1
            self.global_samples += self.train_batch_size()
            self._report_progress()
        self.micro_steps += 1
        self.observability.after_step(boundary)

    def _report_progress(self) -> None:
        every = self._config.steps_per_print
        if not every or self.global_steps % every != 0:
            return
        message = (
            f"step={self.global_steps}, skipped={self.skipped_steps}, "
            f"lr={self.get_lr()}, mom={self.get_mom()}"
        )
        if self.precision.needs_loss_scaling and self.optimizer is not None:
            message += f", loss_scale={self.optimizer.loss_scale}"
        log_dist(message, ranks=[0])

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally inside this block, with no reduction even at a boundary."""
        if self.optimizer is not None and not self.optimizer.strategy.supports_no_sync:
            raise AssertionError(
                f"no_sync() is not supported with ZeRO stage {self.zero_optimization_stage()}"
            )
        if self._no_sync:
            raise RuntimeError("no_sync() blocks cannot be nested")
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False

    @contextmanager
    def coalesce_grad_reduction(self) -> Iterator[None]:
        """Inside the block, ``backward()`` calls only accumulate locally; on exit, at an
        accumulation boundary, one reduction covers all of them (same result as reducing per
        backward, one collective pass instead of N). ``step()`` must come after the block."""
        if self.optimizer is None:
            raise RuntimeError("coalesce_grad_reduction() needs an optimizer")
        if self._no_sync:
            raise RuntimeError("coalesce_grad_reduction() cannot be used inside no_sync()")
        if self._coalescing:
            raise RuntimeError("coalesce_grad_reduction() blocks cannot be nested")
        self._coalescing = True
        try:
            yield
        finally:
            self._coalescing = False
        if self.is_gradient_accumulation_boundary():
            # a reduction with no backward: every bucket is launched by the flush
            strategy = self.optimizer.strategy
            strategy.begin_backward(reduce=True)
            strategy.end_backward()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none)

    # -- accumulation boundary ------------------------------------------------------------------
    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary_override is not None:
            return self._boundary_override
        window = self.micro_steps - self._window_start
        return (window + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Override the boundary computed from the micro-step counter (None-like reset: use
        :meth:`reset_gradient_accumulation_boundary`)."""
        self._boundary_override = bool(is_boundary)

    def reset_gradient_accumulation_boundary(self) -> None:
        self._boundary_override = None

    # -- batch sizes ----------------------------------------------------------------------------
    def train_batch_size(self) -> int:
        return self._config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self._config.gradient_accumulation_steps

    def get_batch_info(self) -> tuple[int, int, int]:
        return (
            self.train_batch_size(),
            self.train_micro_batch_size_per_gpu(),
            self.gradient_accumulation_steps(),
        )

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Change the global batch by changing the accumulation steps (micro-batch is kept)."""
        per_step = self.train_micro_batch_size_per_gpu() * self.dp_world_size
        if train_batch_size % per_step != 0:
            raise ValueError(
                f"train_batch_size={train_batch_size} must be a multiple of "
                f"train_micro_batch_size_per_gpu * data-parallel size = {per_step}"
            )
        self._config.set_batch_sizes(train_batch_size, None, train_batch_size // per_step)

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """Change the micro-batch; the global batch follows (accumulation steps are kept)."""
        gas = self.gradient_accumulation_steps()
        self._config.set_batch_sizes(
            micro_batch_size * gas * self.dp_world_size, micro_batch_size, gas
        )

    # -- queries --------------------------------------------------------------------------------
    def get_lr(self) -> list[float]:
        return [] if self.optimizer is None else [g["lr"] for g in self.optimizer.param_groups]

    def get_mom(self) -> list[Any]:
        if self.optimizer is None:
            return []
        return [g.get("betas", g.get("momentum")) for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        return None if self.optimizer is None else self.optimizer.global_grad_norm

    def was_step_applied(self) -> bool:
        return self._step_applied

    def zero_optimization_stage(self) -> int:
        return int(self._config.zero_optimization.stage)

    def zero_optimization(self) -> bool:
        return self.zero_optimization_stage() > 0

    def zero_optimization_partition_gradients(self) -> bool:
        return self.zero_optimization_stage() >= 2

    def fp16_enabled(self) -> bool:
        return bool(self._config.fp16.enabled)

    def bfloat16_enabled(self) -> bool:
        return bool(self._config.bf16.enabled)

    @property
    def config(self) -> DeepSpeedConfig:
        return self._config

    @property
    def loss_scale(self) -> float:
        return 1.0 if self.optimizer is None else self.optimizer.loss_scale

    # -- data -----------------------------------------------------------------------------------
    def deepspeed_io(
        self,
        dataset: Any,
        batch_size: int | None = None,
        route: str = ROUTE_TRAIN,
        pin_memory: bool = True,
        data_sampler: Any = None,
        collate_fn: Any = None,
        num_local_io_workers: int | None = None,
    ) -> DeepSpeedDataLoader:
        """A loader of this rank's shard of ``dataset`` in micro-batches."""
        del route
        return DeepSpeedDataLoader(
            dataset,
            batch_size=batch_size or self.train_micro_batch_size_per_gpu(),
            pin_memory=pin_memory,
            local_rank=comm.get_local_rank(),
            collate_fn=collate_fn or self.collate_fn,
            num_local_io_workers=num_local_io_workers,
            data_sampler=data_sampler,
            data_parallel_world_size=self.dp_world_size,
            data_parallel_rank=self.dp_rank,
            dataloader_drop_last=bool(self._config.dataloader_drop_last),
        )

    # -- state ----------------------------------------------------------------------------------
    def module_state_dict(
        self,
        destination: Any = None,
        prefix: str = "",
        keep_vars: bool = False,
        exclude_frozen_parameters: bool = False,
    ) -> dict[str, Any]:
        state = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if exclude_frozen_parameters:
            frozen = {prefix + n for n, p in self.module.named_parameters() if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        return state

    def load_module_state_dict(
        self,
        checkpoint: dict[str, Any],
        strict: bool = True,
        custom_load_fn: Any = None,
        fetch_z3_params: bool = False,
    ) -> None:
        del fetch_z3_params
        module_state = checkpoint.get("module", checkpoint)
        if custom_load_fn is not None:
            custom_load_fn(src=module_state, dst=self.module)
        else:
            self.module.load_state_dict(module_state, strict=strict)

    def save_checkpoint(
        self,
        save_dir: str,
        tag: str | None = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """Save model, optimizer, scheduler and counters under ``save_dir/tag``."""
        return checkpointer.save(
            self, save_dir, tag, client_state or {}, save_latest, exclude_frozen_parameters
        )

    def load_checkpoint(
        self,
        load_dir: str,
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Any = None,
    ) -> tuple[str | None, dict[str, Any] | None]:
        """Restore a checkpoint written by :meth:`save_checkpoint`; returns (path, client_state)."""
        loaded = checkpointer.load(
            self,
            load_dir,
            tag,
            load_module_strict=load_module_strict,
            load_optimizer_states=load_optimizer_states and not load_module_only,
            load_lr_scheduler_states=load_lr_scheduler_states and not load_module_only,
            custom_load_fn=custom_load_fn,
        )
        self._window_start = self.micro_steps
        return loaded

    def save_16bit_model(
        self,
        save_dir: str,
        save_filename: str = "pytorch_model.bin",
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """Save the model weights in their training dtype (rank 0 writes)."""
        return checkpointer.save_module_weights(
            self, save_dir, save_filename, exclude_frozen_parameters
        )

    def destroy(self) -> None:
        """Remove the gradient hooks; the engine must not be used afterwards."""
        if self.optimizer is not None:
            self.optimizer.strategy.destroy()
        self.observability.close()
