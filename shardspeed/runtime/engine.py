"""The training engine: forward, backward, step, and the checkpoint verbs.

The engine owns nothing it builds: :func:`shardspeed.initialize` assembles its parts
(:class:`~shardspeed.runtime.engine_parts.EngineParts`) and the engine composes them through
their interfaces: a :class:`~shardspeed.runtime.zero.strategy.ZeroStrategy` (how state is split
across ranks, always present), a :class:`~shardspeed.runtime.zero.optimizer.ZeroOptimizer`
(loss scaling, overflow, clipping; absent without an optimizer), an LR scheduler, a data loader,
the step counters (:class:`~shardspeed.runtime.train_state.TrainState`) and the observability
hooks. It never branches on the ZeRO stage.

Beside the verbs here, the engine is made of: its getters and batch-size setters
(:class:`~shardspeed.runtime.engine_queries.EngineQueries`), the verbs on the model's state that
only call the strategy (:class:`~shardspeed.runtime.engine_state.EngineStateVerbs`), the
accumulation window that ``no_sync()`` and ``coalesce_grad_reduction()`` hold back
(:class:`~shardspeed.runtime.engine_accumulation.AccumulationWindow`), and attribute fall-through
to the wrapped model (:class:`~shardspeed.runtime.engine_attributes.ModuleAttributes`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
from torch import nn

from shardspeed.accelerator import get_accelerator
from shardspeed.comm.parallel_topology import current_topology
from shardspeed.compression.scheduler import build_compression_scheduler
from shardspeed.runtime import checkpointer
from shardspeed.runtime.autotuning_probe import AutotuningProbe
from shardspeed.runtime.checkpoint_format import CheckpointFormat
from shardspeed.runtime.checkpoint_writer import PendingSave
from shardspeed.runtime.data_pipeline.engine_hooks import DataEfficiencyHooks
from shardspeed.runtime.dataloader import DeepSpeedDataLoader, build_dataloader
from shardspeed.runtime.eigenvalue import Eigenvalue
from shardspeed.runtime.engine_accumulation import AccumulationWindow
from shardspeed.runtime.engine_attributes import ModuleAttributes
from shardspeed.runtime.engine_checks import checkpoint_dir
from shardspeed.runtime.engine_data_efficiency import EngineDataEfficiency
from shardspeed.runtime.engine_parts import EngineParts, NoOptimizer
from shardspeed.runtime.engine_queries import EngineQueries
from shardspeed.runtime.engine_state import EngineStateVerbs
from shardspeed.runtime.precision.autocast import autocast_if_enabled
from shardspeed.runtime.progressive_layer_drop import (
    ProgressiveLayerDrop,
    build_progressive_layer_drop,
    with_pld_state,
)
from shardspeed.runtime.zero.optimizer import ZeroOptimizer
from shardspeed.runtime.zero_checkpoint import ZERO_FORMAT
from shardspeed.utils.logging import log_dist
from shardspeed.utils.timer import (
    BACKWARD_INNER_GLOBAL_TIMER,
    BACKWARD_REDUCE_GLOBAL_TIMER,
    STEP_GLOBAL_TIMER,
)

ROUTE_TRAIN = "train"
ROUTE_EVAL = "eval"


def _counter(name: str) -> property:
    """An engine attribute that is the :class:`TrainState` counter ``name`` (DeepSpeed's
    ``engine.global_steps`` and friends, readable and settable)."""

    def get(engine: DeepSpeedEngine) -> int:
        return int(getattr(engine.state, name))

    def set_(engine: DeepSpeedEngine, value: int) -> None:
        setattr(engine.state, name, value)

    return property(get, set_, doc=f"The step counter ``{name}``.")


class DeepSpeedEngine(
    EngineQueries, EngineStateVerbs, EngineDataEfficiency, ModuleAttributes, nn.Module
):
    """Wraps a model for distributed training; returned by :func:`shardspeed.initialize`.
    Attributes it lacks are the wrapped model's (``engine.moe_1`` is ``engine.module.moe_1``)."""

    #: ``save`` / ``load`` through the one writer and reader: DeepSpeed's directory layout here,
    #: its per-layer pipeline layout for the PipelineEngine
    checkpoint_format: ClassVar[CheckpointFormat] = ZERO_FORMAT

    global_steps = _counter("global_steps")
    global_samples = _counter("global_samples")
    skipped_steps = _counter("skipped_steps")
    micro_steps = _counter("micro_steps")

    def __init__(self, parts: EngineParts) -> None:
        if not isinstance(parts, EngineParts):
            raise TypeError(
                "DeepSpeedEngine is built by shardspeed.initialize(model=..., config=...); "
                "call that instead of constructing the engine directly"
            )
        super().__init__()
        self.module = parts.module
        self._config = parts.config
        self.args, self.mpu, self.collate_fn = parts.args, parts.mpu, parts.collate_fn
        self.device = parts.device
        self.precision = parts.precision
        self.data_parallel = parts.data_parallel
        self.dp_group = parts.data_parallel.group
        self.dp_world_size = parts.data_parallel.world_size
        self.dp_rank = parts.data_parallel.rank
        self.global_rank = parts.global_rank
        self.topology = parts.topology if parts.topology is not None else current_topology()
        #: DeepSpeed's names for sequence parallelism: the ranks splitting one sequence, and
        #: every rank holding the same parameters (what ZeRO shards and averages over)
        self.sequence_parallel_size = self.topology.size("sp")
        self.seq_parallel_group = (
            self.topology.group("sp") if self.sequence_parallel_size > 1 else None
        )
        self.seq_data_parallel_group = parts.strategy.ctx.data_parallel.group
        self.seq_dp_world_size = parts.strategy.ctx.data_parallel.world_size
        #: what AutoTP training split (None without ``tensor_parallel.autotp_size``)
        self.tensor_parallel = parts.tensor_parallel
        self.strategy = parts.strategy
        self.basic_optimizer = parts.basic_optimizer
        self.optimizer: ZeroOptimizer | None = parts.optimizer
        # the one place the engine asks whether it has an optimizer
        self._optim: ZeroOptimizer | NoOptimizer = (
            parts.optimizer if parts.optimizer is not None else NoOptimizer()
        )
        self.lr_scheduler = parts.lr_scheduler
        self.training_dataloader = parts.training_dataloader
        self.state = parts.state
        self.observability = parts.observability
        self.observability.attach_engine(self)
        #: the accumulation window: boundary, no_sync() and coalesce_grad_reduction() blocks
        self.accumulation = AccumulationWindow(parts.state)
        self._is_compiled = False
        #: a checkpoint being written in the background (``checkpoint.writer.decoupled``)
        self.pending_checkpoint: PendingSave | None = None
        #: the progressive-layer-drop schedule (None unless ``progressive_layer_drop.enabled``)
        self.progressive_layer_drop: ProgressiveLayerDrop | None = build_progressive_layer_drop(
            parts.config
        )
        #: per-block Hessian eigenvalues (``eigenvalue`` section; None when off) and the last ones
        self.eigenvalue = Eigenvalue.from_config(self._config.eigenvalue)
        self.block_eigenvalue: dict[int, tuple[float, int]] = {}
        #: curriculum schedules and random-LTD (``data_efficiency``, legacy ``curriculum_learning``)
        self.data_efficiency = DataEfficiencyHooks(
            parts.config, self.train_batch_size(), self.train_micro_batch_size_per_gpu()
        )
        #: switches compression techniques on at their offsets (None without compression_training)
        self.compression_scheduler = build_compression_scheduler(
            self.module, self._config.compression_training
        )
        #: times an autotuning experiment and ends it (None outside ``shardspeed --autotuning``)
        self.autotuning_probe = AutotuningProbe.from_config(
            parts.config,
            self.module,
            self.global_rank,
            self.train_batch_size(),
            self.train_micro_batch_size_per_gpu(),
        )

    # -- the training verbs -------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        kwargs = with_pld_state(self.progressive_layer_drop, self.module.training, kwargs)
        kwargs = self.data_efficiency.forward_kwargs(
            self.module, self.module.training, self.global_steps, kwargs
        )
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

    def compile(  # type: ignore[override]
        self,
        backend: str | Callable[..., Any] | None = None,
        compile_kwargs: dict[str, Any] | None = None,
        schedule: Any = None,
        compiled_autograd_enabled: bool = False,
    ) -> None:
        """``torch.compile`` the wrapped model in place (its ``__call__``; the ZeRO hooks stay
        outside or run as the compiled graph calls them). ``backend`` defaults to the
        accelerator's (``get_accelerator().get_compile_backend()``)."""
        if schedule is not None or compiled_autograd_enabled:
            raise NotImplementedError(
                "engine.compile(schedule=..., compiled_autograd_enabled=True) belongs to "
                "DeepSpeed's DeepCompile passes, which shardspeed does not have; call "
                "engine.compile(backend=..., compile_kwargs=...) without them"
            )
        if self.is_compiled:
            return
        chosen = backend if backend is not None else get_accelerator().get_compile_backend()
        self.module.compile(backend=chosen, **(compile_kwargs or {}))
        self._is_compiled = True

    @property
    def is_compiled(self) -> bool:
        """Whether :meth:`compile` has compiled the wrapped model."""
        return self._is_compiled

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss multiplied by the active loss scale (for a manual ``.backward()``)."""
        return self._optim.scale_loss(loss)

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
        self._optim.require("backward()")
        with self.observability.backward(loss):
            gas = self.gradient_accumulation_steps()
            if scale_wrt_gas and gas > 1:
                loss = loss / gas
            self.strategy.begin_backward(reduce=self.accumulation.reduces(gas))
            with self.observability.phase(BACKWARD_INNER_GLOBAL_TIMER):
                scaled = self._optim.scale_loss(loss)
                # eigenvalue differentiates the gradients again: their graph must outlive this
                keep = self.eigenvalue is not None and self.eigenvalue.collect(self.module, scaled)
                scaled.backward(retain_graph=retain_graph or keep)
            with self.observability.phase(BACKWARD_REDUCE_GLOBAL_TIMER):
                self.strategy.end_backward()
        return loss

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """Update the weights if this micro-step ends a gradient-accumulation window."""
        self.accumulation.check_step()
        self.state.step_applied = False
        boundary = self.is_gradient_accumulation_boundary()
        if boundary:
            self._optim.require("step()")
            if self.progressive_layer_drop is not None:
                # DeepSpeed's order: the schedule takes the step count before this step
                # counts, so the forwards of step t run with theta(t - 1) (1.0 for t = 0, 1)
                self.progressive_layer_drop.update_state(self.global_steps)
            if self.eigenvalue is not None:  # before the step changes the weights
                found = self.eigenvalue.at_boundary(self.module, self.device, self.loss_scale)
                if found is not None:
                    self.block_eigenvalue = found
            with self.observability.phase(STEP_GLOBAL_TIMER):
                applied = self._optim.step()
                if applied and self.compression_scheduler is not None:
                    self.compression_scheduler.step()  # DeepSpeed: after each applied step
                if applied and self.lr_scheduler is not None:
                    self.lr_scheduler.step(**(lr_kwargs or {}))
            self.state.end_optimizer_step(applied, self.train_batch_size())
            if self.eigenvalue is not None:
                self.observability.monitor.write_events(self.eigenvalue.events(self.global_samples))
            self._report_progress()
            if self.autotuning_probe is not None:
                self.autotuning_probe.after_step(self.global_steps)
        self.state.end_micro_step()
        self.observability.after_step(boundary, self.get_lr(), self.loss_scale)

    def _report_progress(self) -> None:
        every = self._config.steps_per_print
        if not every or self.global_steps % every != 0:
            return
        message = (
            f"step={self.global_steps}, skipped={self.skipped_steps}, "
            f"lr={self.get_lr()}, mom={self.get_mom()}"
        )
        if self.precision.needs_loss_scaling:
            message += f", loss_scale={self.loss_scale}"
        log_dist(message, ranks=[0])

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally inside this block, with no reduction even at a boundary
        (``step()`` comes after the block)."""
        stage = self.zero_optimization_stage()
        with self.accumulation.suppressed(self.strategy.supports_no_sync, stage):
            yield

    @contextmanager
    def coalesce_grad_reduction(self) -> Iterator[None]:
        """Inside the block, ``backward()`` calls only accumulate locally; on exit, at an
        accumulation boundary, one reduction covers all of them (same result as reducing per
        backward, one collective pass instead of N). ``step()`` must come after the block."""
        self._optim.require("coalesce_grad_reduction()")
        with self.accumulation.coalesced():
            yield
        if self.is_gradient_accumulation_boundary():
            self.strategy.reduce_now()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optim.zero_grad(set_to_none)

    @property
    def enable_backward_allreduce(self) -> bool:
        """Whether backward all-reduces the gradients (DeepSpeed's attribute). The 1-bit
        optimizers turn it off through the strategy after their freeze step, without this."""
        return self.strategy.gradients_allreduced()

    @enable_backward_allreduce.setter
    def enable_backward_allreduce(self, value: bool) -> None:
        if not value and not self.strategy.supports_local_gradients:
            raise ValueError(
                "enable_backward_allreduce=False leaves gradients local, which only ZeRO stage "
                f"0 can step from (this engine runs stage {self.strategy.stage})"
            )
        self.strategy.backward_allreduce = bool(value)

    # -- progressive layer drop ------------------------------------------------------------------
    def get_pld_theta(self) -> float | None:
        """The current PLD keep probability; None when progressive layer drop is off."""
        pld = self.progressive_layer_drop
        return pld.get_theta() if pld is not None else None

    # -- accumulation boundary ------------------------------------------------------------------
    def is_gradient_accumulation_boundary(self) -> bool:
        return self.accumulation.is_boundary(self.gradient_accumulation_steps())

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Override the boundary computed from the micro-step counter (None-like reset: use
        :meth:`reset_gradient_accumulation_boundary`)."""
        self.accumulation.boundary_override = bool(is_boundary)

    def reset_gradient_accumulation_boundary(self) -> None:
        self.accumulation.boundary_override = None

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
        return build_dataloader(
            dataset,
            self._config,
            self.dp_world_size,
            self.dp_rank,
            batch_size=batch_size,
            pin_memory=pin_memory,
            data_sampler=data_sampler,
            collate_fn=collate_fn or self.collate_fn,
            num_local_io_workers=num_local_io_workers,
        )

    # -- checkpoint files (the strategy's state verbs: engine_state.py) ------------------------
    def save_checkpoint(
        self,
        save_dir: str,
        tag: str | None = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """Save model, optimizer, scheduler and counters under ``save_dir/tag``."""
        save_dir = checkpoint_dir(save_dir, "save_dir", "save_checkpoint")
        return self.checkpoint_format.save(
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
        *,
        allow_unsafe_pickle: bool | None = None,
    ) -> tuple[str | None, dict[str, Any] | None]:
        """Restore a checkpoint written by :meth:`save_checkpoint`; returns (path, client_state).
        Files are read without running pickled code; ``allow_unsafe_pickle=True`` (default: the
        config's ``checkpoint.allow_unsafe_pickle``) reads a trusted legacy file that needs
        more."""
        loaded = self.checkpoint_format.load(
            self,
            checkpoint_dir(load_dir, "load_dir", "load_checkpoint"),
            tag,
            load_module_strict=load_module_strict,
            load_optimizer_states=load_optimizer_states and not load_module_only,
            load_lr_scheduler_states=load_lr_scheduler_states and not load_module_only,
            custom_load_fn=custom_load_fn,
            allow_unsafe_pickle=allow_unsafe_pickle,
        )
        self.state.open_window()
        if self.progressive_layer_drop is not None and self.global_steps > 0:
            # where the schedule stood when the checkpoint was saved (DeepSpeed restarts it at
            # 1.0 until the next step), so a resumed run drops layers as an unbroken one does
            self.progressive_layer_drop.update_state(self.global_steps - 1)
        if self.compression_scheduler is not None:
            # the techniques on at the save are on again (DeepSpeed restarts its count at 0,
            # so its resumed run computes densely until every offset comes round again)
            self.compression_scheduler.load_state_dict({"training_steps": self.global_steps})
        return loaded

    def save_16bit_model(
        self,
        save_dir: str,
        save_filename: str = "pytorch_model.bin",
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """Save the model weights in their training dtype, whole (rank 0 writes; every rank
        calls it: ZeRO-3 partitions and AutoTP pieces are gathered). False when ZeRO-3 is not
        allowed to gather (``stage3_gather_16bit_weights_on_model_save`` false)."""
        return checkpointer.save_module_weights(
            self, save_dir, save_filename, exclude_frozen_parameters
        )

    def wait_for_checkpoint(self) -> None:
        """Wait until the checkpoint being written in the background (``checkpoint.writer
        .decoupled``) is on disk and ``latest`` names it. Every rank must call it, as
        ``save_checkpoint``; if any rank failed to write, it raises on every rank (and
        ``latest`` still names the previous tag). Does nothing when no save is in flight."""
        checkpointer.wait(self)

    def destroy(self) -> None:
        """Finish a background checkpoint save, remove the gradient hooks; the engine must not
        be used afterwards."""
        checkpointer.wait(self)
        self.strategy.destroy()
        self.observability.close()
