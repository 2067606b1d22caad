"""The ZeRO strategy: how parameters, gradients and optimizer state are split across ranks.

One subclass per stage (0 replicated, 1 optimizer-state partition, 2 + gradient partition,
3 + parameter partition), each a composition of
:class:`~shardspeed.runtime.zero.shard_group.ShardGroup`\\ s; the engine talks only to this
interface and never branches on the stage number. A strategy exists for every engine, also one
with no optimizer (forward and eval only): it places the module (:meth:`place_module`) and
serves its full state dict (:meth:`full_state_dict`); :meth:`bind_optimizer` then splits the
trained parameters into shard groups, one per process group they reduce over
(``StrategyContext.comm_for``; by default all on the data-parallel group).

The life of one optimizer step, as the engine and
:class:`~shardspeed.runtime.zero.optimizer.ZeroOptimizer` drive it::

    for each micro-batch:
        strategy.begin_backward(reduce=is_boundary and not no_sync)
        loss.backward()                      # the groups' hooks reduce gradients bucket by bucket
        strategy.end_backward()              # flush the last buckets, wait for them
    strategy.prepare_step(inv_loss_scale)    # gradients -> fp32 master gradients, unscaled
    strategy.overflow_flags()                # per group; one reducer agrees across ranks
    strategy.grad_squares()                  # per group; one reducer combines them
    strategy.scale_gradients(clip_coef)
    strategy.optimizer_step()                # update masters, write back to the model
    strategy.zero_grad()

Per-parameter facts live on one :class:`~shardspeed.runtime.zero.records.ParamRecord` each, in
the strategy's :class:`~shardspeed.runtime.zero.records.ParamRegistry`; debugging utilities
(``shardspeed.utils.safe_get_full_fp32_param`` ...) find a parameter's strategy through
:func:`strategy_of` and its piece through :meth:`ZeroStrategy.param_fragment`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from shardspeed import comm
from shardspeed.checkpoint.layout import versioned
from shardspeed.runtime.precision.autocast import lower_precision_safe_params
from shardspeed.runtime.precision.policy import PrecisionPolicy
from shardspeed.runtime.zero.comm_group import CommGroup
from shardspeed.runtime.zero.grad_norm import GradSquares
from shardspeed.runtime.zero.offload_states import StateOffloader
from shardspeed.runtime.zero.options import ZeroOptions
from shardspeed.runtime.zero.records import ParamRecord, ParamRegistry, record_of
from shardspeed.runtime.zero.reduce_options import GradReduceOptions
from shardspeed.runtime.zero.shard_group import GroupOptions, ParamFragment, ShardGroup
from shardspeed.runtime.zero.state_swap import SwapStore
from shardspeed.runtime.zero.sub_group_step import SubGroupStepper
from shardspeed.utils.logging import log_dist

__all__ = [
    "GradReduceOptions",
    "ParamFragment",
    "StrategyContext",
    "ZeroStrategy",
    "strategy_of",
]


@dataclass(frozen=True)
class StrategyContext:
    """Everything a strategy needs, handed over once at construction."""

    precision: PrecisionPolicy
    reduce: GradReduceOptions
    #: the data-parallel group: where the module is broadcast from and, by default, what every
    #: trained parameter reduces over
    data_parallel: CommGroup
    #: the accelerator device the module runs on
    device: torch.device
    #: the ``zero_optimization`` (and ``aio``) settings, resolved once
    options: ZeroOptions = field(default_factory=ZeroOptions.defaults)
    #: the ``zero_allow_untested_optimizer`` flag
    allow_untested_optimizer: bool = False
    #: ``data_types.grad_accum_dtype`` (None: the strategy's default)
    grad_accum_dtype: torch.dtype | None = None
    #: the process group a trained parameter reduces over (None: ``shard_over`` for all);
    #: Mixture of Experts puts expert parameters on their expert-data-parallel group
    comm_for: Callable[[ParamRecord], CommGroup] | None = None
    #: what parameters are sharded and reduced over (None: ``data_parallel``); MiCS's shard
    #: group, whose shards are replicated over the other groups
    shard_over: CommGroup | None = None

    @property
    def default_comm(self) -> CommGroup:
        """The group parameters reduce over unless ``comm_for`` says otherwise."""
        return self.shard_over if self.shard_over is not None else self.data_parallel


def strategy_of(param: torch.Tensor) -> ZeroStrategy | None:
    """The live strategy managing ``param``, or None."""
    record = record_of(param)
    owner = None if record is None else record.owner
    return owner if isinstance(owner, ZeroStrategy) else None


class ZeroStrategy:
    """Splits training state across ranks; one subclass per ZeRO stage, each naming the kind
    of shard group it is made of (:meth:`make_group`) and its checkpoint form."""

    stage: ClassVar[int]
    #: whether ``engine.no_sync()`` may suppress gradient reduction under this strategy
    supports_no_sync: ClassVar[bool] = True
    #: whether the optimizer may take over gradient averaging (the 1-bit optimizers): stage 0
    supports_local_gradients: ClassVar[bool] = False

    def __init__(self, module: nn.Module, ctx: StrategyContext) -> None:
        self.module = module
        self.ctx = ctx
        self.registry = ParamRegistry(module, self)
        self._mark_autocast_comm_dtypes()
        self.offload = ctx.options.offload_optimizer
        self.param_offload = ctx.options.offload_param
        self.placement = self.offload.placement(ctx.device)
        if (self.offload.pin_memory or self.param_offload.pin_memory) and ctx.device.type == "cpu":
            log_dist(
                "zero_optimization offload pin_memory: this run computes on the CPU, which has "
                "no pinned (page-locked) memory to give; using ordinary memory",
                [0],
                level=logging.WARNING,
            )
        self._swap_store: SwapStore | None = None
        #: engine.offload_states / reload_states
        self.state_offloader = StateOffloader(self)
        self.groups: list[ShardGroup] = []
        self.optimizer: torch.optim.Optimizer | None = None
        self.stepper = SubGroupStepper(0, None, [])
        #: DeepSpeed's ``engine.enable_backward_allreduce`` (the engine's property sets it)
        self.backward_allreduce = True

    def _mark_autocast_comm_dtypes(self) -> None:
        """torch_autocast: gradients of lower-precision-safe modules' parameters travel in the
        autocast dtype (DeepSpeed's behaviour); the rest in ``communication_data_type`` or
        their own dtype."""
        policy = self.ctx.precision
        if policy.autocast_dtype is None:
            return
        for param in lower_precision_safe_params(self.module, policy.lower_precision_safe_modules):
            self.registry[param].comm_dtype = policy.autocast_dtype

    # -- the module -------------------------------------------------------------------------
    def place_module(self, move: bool = True) -> None:
        """Cast the module to the training dtype, move it to the device (unless ``move`` is
        False: ``dont_change_device``) and start every data-parallel rank from rank 0's
        weights and buffers (expert parameters: from their expert-data-parallel group's first
        rank; the other ranks hold other experts)."""
        dtype = self.ctx.precision.param_dtype
        if dtype != torch.float32:
            self.module.to(dtype=dtype)
        if move:
            self.module.to(self.placement.device)
        by_group: dict[CommGroup, list[torch.Tensor]] = {}
        for record in self.registry.records:
            by_group.setdefault(self.comm_group_of(record), []).append(record.param)
        by_group.setdefault(self.ctx.data_parallel, []).extend(self.module.buffers())
        for group, tensors in by_group.items():
            for tensor in tensors:
                group.broadcast(tensor.data)

    def comm_group_of(self, record: ParamRecord) -> CommGroup:
        """The process group ``record``'s parameter is replicated over and reduces over."""
        return self.ctx.default_comm if self.ctx.comm_for is None else self.ctx.comm_for(record)

    def full_state_dict(
        self, prefix: str = "", keep_vars: bool = False, exclude_frozen_parameters: bool = False
    ) -> dict[str, Any]:
        """The whole module's state dict, as ``module.state_dict()`` gives it (stage 3 gathers)."""
        state = self.module.state_dict(prefix=prefix, keep_vars=keep_vars)
        if exclude_frozen_parameters:
            frozen = {prefix + r.name for r in self.registry.records if not r.param.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        return state

    def weights_for_save(
        self, exclude_frozen_parameters: bool = False, gather_partitioned: bool = False
    ) -> dict[str, Any] | None:
        """The module weights ``save_16bit_model`` writes (every rank calls it), or None when
        they are partitioned and ``gather_partitioned`` (the config's
        ``stage3_gather_16bit_weights_on_model_save``, read at save time) is false (it says
        why)."""
        del gather_partitioned  # nothing is partitioned below stage 3
        return self.full_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)

    def load_full_state_dict(
        self, state: dict[str, Any], strict: bool = True, custom_load_fn: Any = None
    ) -> None:
        """Load a whole-module state dict (``custom_load_fn(src=, dst=)`` does it if given)."""
        if custom_load_fn is not None:
            custom_load_fn(src=state, dst=self.module)
        else:
            self.module.load_state_dict(state, strict=strict)

    def empty_partition_cache(self) -> None:
        """Free parameters kept gathered between uses (stage 3); nothing to free before it."""

    # -- the optimizer ----------------------------------------------------------------------
    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Refuse an optimizer this strategy cannot step (before anything is changed)."""
        del optimizer

    def make_group(self, records: list[ParamRecord], comm_group: CommGroup) -> ShardGroup:
        """The shard group of ``records``, reducing over ``comm_group``."""
        raise NotImplementedError

    def keep_in_optimizer(self, tensor: torch.Tensor, stepped: set[int], index: int) -> bool:
        """Whether a tensor no shard group steps stays in optimizer group ``index``."""
        del tensor, stepped, index
        return False

    def group_options(self) -> GroupOptions:
        return GroupOptions(
            precision=self.ctx.precision,
            reduce=self.ctx.reduce,
            grad_accum_dtype=self.ctx.grad_accum_dtype,
            ignore_unused_parameters=self.ctx.options.ignore_unused_parameters,
            label=f"ZeRO stage {self.stage}",
        )

    def bind_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Split the parameters ``optimizer`` trains into shard groups and make it step what
        the groups hand it (masters, partitions) instead of the module's parameters."""
        if self.optimizer is not None:
            raise RuntimeError("this strategy already has an optimizer")
        self.check_optimizer(optimizer)
        opt_group = {
            id(p): index
            for index, group in enumerate(optimizer.param_groups)
            for p in group["params"]
        }
        by_comm: dict[CommGroup, list[ParamRecord]] = {self.ctx.default_comm: []}
        for record in self.registry.records:
            if record.param.requires_grad and id(record.param) in opt_group:
                record.opt_group = opt_group[id(record.param)]
                by_comm.setdefault(self.comm_group_of(record), []).append(record)
        self.groups = [self.make_group(records, group) for group, records in by_comm.items()]
        stepped = {id(t) for group in self.groups for t in group.masters.master_params}
        for index, param_group in enumerate(optimizer.param_groups):
            params = list(param_group["params"])
            for group in self.groups:
                params = group.rebind(params, index)
            param_group["params"] = [
                t for t in params if id(t) in stepped or self.keep_in_optimizer(t, stepped, index)
            ]
        self.optimizer = optimizer
        self._describe_matrices(optimizer)
        self.stepper = self.make_stepper()

    def _describe_matrices(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer that needs each matrix whole (Muon: ``bind_matrix_layouts``) learns
        how the groups' stepped tensors hold them."""
        bind = getattr(optimizer, "bind_matrix_layouts", None)
        if bind is not None:
            bind(
                {
                    key: layout
                    for group in self.groups
                    for key, layout in group.matrix_layouts().items()
                }
            )

    def make_stepper(self) -> SubGroupStepper:
        """How the optimizer steps: by ``sub_group_size`` (DeepSpeed applies it at stage 3;
        here every stage), with the offloaded masters' state swapped to NVMe if configured."""
        size = self.ctx.options.sub_group_size
        offloaded = [m for group in self.groups for m in group.offloaded_masters()]
        swapped = offloaded if self.offload.to_nvme else []
        swap = self.swap_store() if swapped or self.param_offload.to_nvme else None
        if swapped and swap is not None:
            # Adam-like optimizers keep two moments per element: make sure they will fit
            # before the first step writes any
            need = 2 * sum(t.numel() * t.element_size() for t in swapped)
            swap.check_space(need, "zero_optimization.offload_optimizer.nvme_path")
        # save_muon_momentum_buffer_in_memory: Muon's buffer is read by every step's gather
        # and is one tensor per master, so it may stay in memory while the moments swap
        resident = (
            ("momentum_buffer",) if self.ctx.options.save_muon_momentum_buffer_in_memory else ()
        )
        return SubGroupStepper(size, swap, swapped, resident=resident)

    def swap_store(self) -> SwapStore:
        """The files NVMe offload swaps to (made on first use): the optimizer's
        ``nvme_path`` if it offloads there, else the parameters'."""
        if self._swap_store is None:
            folder = self.offload.nvme_path if self.offload.to_nvme else None
            folder = folder or self.param_offload.nvme_path
            assert folder is not None, "an NVMe offload section names its folder"
            self._swap_store = SwapStore(
                folder,
                comm.get_rank() if comm.is_initialized() else 0,
                self.ctx.options.aio,
                pin_memory=self.offload.pin_memory or self.param_offload.pin_memory,
            )
        return self._swap_store

    # -- backward: every group in turn ------------------------------------------------------
    def begin_backward(self, reduce: bool) -> None:
        """Called before autograd runs; ``reduce`` says whether this backward reduces gradients
        (never while :meth:`gradients_allreduced` is False: the optimizer averages itself)."""
        exchanged = self.gradients_allreduced()
        for group in self.groups:
            group.local_gradients = not exchanged
            group.begin_backward(reduce and exchanged)

    def gradients_allreduced(self) -> bool:
        """False while the optimizer exchanges its own compressed state instead of the
        gradients: ``backward_allreduce`` off, or an optimizer whose
        ``needs_gradient_allreduce`` says so (the 1-bit optimizers after their freeze)."""
        wanted = getattr(self.optimizer, "needs_gradient_allreduce", True)
        return self.backward_allreduce and bool(wanted)

    def end_backward(self) -> None:
        """Called after autograd returns: launch what is left and wait for every reduction."""
        for group in self.groups:
            group.end_backward()

    def reduce_now(self) -> None:
        """Reduce the gradients accumulated so far, with no backward (coalesced reduction)."""
        self.begin_backward(reduce=True)
        self.end_backward()

    # -- step ------------------------------------------------------------------------------
    def prepare_step(self, inv_loss_scale: float) -> None:
        for group in self.groups:
            group.prepare_step(inv_loss_scale)

    def overflow_flags(self) -> list[torch.Tensor]:
        """Each group's local inf/nan flag."""
        return [group.local_overflow() for group in self.groups]

    def grad_squares(self) -> list[GradSquares]:
        """Each group's part of the squared global gradient norm."""
        return [group.grad_squares() for group in self.groups]

    def scale_gradients(self, coef: torch.Tensor) -> None:
        for group in self.groups:
            group.scale_gradients(coef)

    def optimizer_step(self) -> None:
        """Run the bound optimizer (``sub_group_size`` elements at a time, swapping NVMe
        offloaded state in and out) and bring the model parameters up to date."""
        assert self.optimizer is not None, "bind_optimizer() first"
        self.stepper.step(self.optimizer)
        for group in self.groups:
            group.after_step()

    @contextmanager
    def optimizer_state_resident(self) -> Iterator[None]:
        """The optimizer state in memory inside the block (NVMe offload keeps it in files
        between steps): for checkpoints and state inspection."""
        swap = self.stepper.swap
        if swap is None or self.optimizer is None:
            yield
            return
        with swap.resident(self.stepper.all_items(self.optimizer)):
            yield

    def optimizer_state_replaced(self) -> None:
        """The optimizer's state tensors were replaced (a checkpoint was loaded)."""
        if self.stepper.swap is not None:
            self.stepper.swap.forget()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the accumulated gradients (each group reuses or frees its buffers)."""
        del set_to_none
        for group in self.groups:
            group.zero_grad()

    # -- inspection ------------------------------------------------------------------------
    def param_fragment(self, param: nn.Parameter) -> ParamFragment | None:
        """This rank's piece of ``param``; None if the optimizer does not train it."""
        record = self.registry.get(param)
        if record is None or record.group is None or not param.requires_grad:
            return None
        return record.group.fragment(record)

    def param_names(self) -> dict[int, str]:
        """Each module parameter's name, by ``id`` (a tied parameter under its first name)."""
        return self.registry.names()

    def master_params(self) -> list[torch.Tensor]:
        """The tensors the optimizer steps (for state inspection and checkpoints)."""
        if self.optimizer is None:
            return []
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    # -- checkpoint state (the form is the subclass's) --------------------------------------
    def checkpoint_shard_name(self, dp_rank: int | None = None) -> str | None:
        """File name of data-parallel rank ``dp_rank``'s (default: this rank's) optimizer
        checkpoint, or None if the optimizer state is replicated (then it is saved once, with
        the model states)."""
        del dp_rank
        return None

    def checkpoint_world_size(self) -> int:
        """How many ranks' optimizer shards a checkpoint holds (MiCS: one shard group's)."""
        return self.ctx.default_comm.world_size

    def dense_group(self) -> ShardGroup:
        """The shard group of the model's dense parameters, whose state the strategy's
        checkpoint holds (Mixture-of-Experts groups are saved expert by expert, see
        :mod:`shardspeed.runtime.moe_checkpoint`)."""
        dense = [g for g in self.groups if not g.comm.label]
        if len(dense) != 1:
            raise RuntimeError(
                f"expected one shard group of dense parameters, found {len(dense)} (a model "
                "whose every trained parameter is an expert has no dense state to checkpoint)"
            )
        return dense[0]

    def state_dict(self) -> dict[str, Any]:
        return versioned({"stage": self.stage})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` into the dense group; ``{}`` makes the masters follow the
        module's weights (expert groups always do; their saved state is set after)."""
        dense = self.dense_group() if self.groups else None
        for group in self.groups:
            group.load_state_dict(state if group is dense else {})

    def sharded_state(
        self,
        load_shard: Callable[[int], dict[str, Any]],
        count: int,
        module_state: dict[str, torch.Tensor],
    ) -> dict[str, Any]:
        """This rank's optimizer-wrapper state from a checkpoint whose ``count`` ranks each
        saved a shard (``load_shard(r)`` reads rank ``r``'s) beside the module state
        ``module_state``, whatever stage, world size and buckets saved it."""
        raise NotImplementedError(f"ZeRO stage {self.stage} keeps no optimizer shards")

    def destroy(self) -> None:
        """Remove the hooks this strategy installed and forget its parameters."""
        if self._swap_store is not None:
            self._swap_store.close()
        for group in self.groups:
            group.destroy()
        self.registry.forget()
