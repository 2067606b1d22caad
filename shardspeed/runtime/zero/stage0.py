"""ZeRO stage 0: plain data parallelism.

Every rank holds the full model, gradients and optimizer state. Gradients are averaged with a
bucketed all-reduce that overlaps backward: each bucket is reduced in place as soon as its last
gradient is accumulated, at the gradient-accumulation boundary only (earlier micro-batches just
accumulate locally, so communication is one all-reduce of the gradients per optimizer step).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardspeed import comm
from shardspeed.runtime.precision.loss_scaler import has_inf_or_nan
from shardspeed.runtime.precision.master_weights import MasterWeights
from shardspeed.runtime.precision.overflow import unscale_
from shardspeed.runtime.zero.buckets import GradBucket, GradientBuckets
from shardspeed.runtime.zero.reshard import (
    BucketLayout,
    Resharder,
    replicated_from_shard,
    replicated_layout,
)
from shardspeed.runtime.zero.strategy import ParamFragment, StrategyContext, ZeroStrategy


def trainable_params(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    """The module's parameters the optimizer updates, in module order, each once."""
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return [p for p in module.parameters() if p.requires_grad and id(p) in in_optimizer]


def reduce_scale_factors(ctx: StrategyContext) -> tuple[float, float]:
    """(factor before, factor after) the sum-reduction, following DeepSpeed's averaging knobs:
    prescaling divides by the world size up front; otherwise divide by
    ``gradient_predivide_factor`` before and by ``world_size / predivide`` after."""
    world = ctx.dp_world_size
    if ctx.reduce.prescale_gradients:
        return 1.0 / world, 1.0
    predivide = ctx.reduce.gradient_predivide_factor
    return 1.0 / predivide, predivide / world


def comm_source(buffer: torch.Tensor, ctx: StrategyContext, pre_scale: float) -> torch.Tensor:
    """What to send for ``buffer``: cast to the communication dtype if one is set (a copy),
    then multiplied by the pre-reduction factor in place."""
    comm_dtype = ctx.reduce.communication_data_type
    if comm_dtype is not None and comm_dtype != buffer.dtype:
        buffer = buffer.to(comm_dtype)
    if pre_scale != 1.0:
        buffer.mul_(pre_scale)
    return buffer


def scale_grads_(grads: list[torch.Tensor], coef: torch.Tensor) -> None:
    """Multiply every gradient in ``grads`` by the 0-dim ``coef`` in place (clipping)."""
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))


def accumulation_dtype(ctx: StrategyContext, default: torch.dtype) -> torch.dtype:
    """``data_types.grad_accum_dtype`` if given, else ``default``; it must be the model's
    dtype or the fp32 master dtype."""
    requested = ctx.grad_accum_dtype or default
    allowed = {ctx.precision.param_dtype, ctx.precision.master_dtype}
    if requested not in allowed:
        names = " or ".join(sorted(str(d).removeprefix("torch.") for d in allowed))
        raise ValueError(
            f"data_types.grad_accum_dtype={str(requested).removeprefix('torch.')} is not "
            f"supported with this precision setup; use {names}"
        )
    return requested


class ReplicatedStrategy(ZeroStrategy):
    """Stage 0: replicate everything, all-reduce gradients bucket by bucket."""

    stage = 0

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, ctx: StrategyContext):
        super().__init__(module, optimizer, ctx)
        params = trainable_params(module, optimizer)
        self._pre_scale, self._post_scale = reduce_scale_factors(ctx)
        policy = ctx.precision
        # DeepSpeed's bf16 optimizer accumulates gradients in fp32 by default; fp16 and fp32
        # accumulate in the model's dtype
        default = (
            policy.master_dtype if policy.param_dtype == torch.bfloat16 else policy.param_dtype
        )
        self.buckets = GradientBuckets(
            list(reversed(params)),
            ctx.reduce.bucket_size,
            self._launch,
            dtype=accumulation_dtype(ctx, default),
        )
        self._reduced = False
        self.masters = MasterWeights.from_policy(params, ctx.precision)
        self.masters.rebind_optimizer(optimizer)
        self._master_of = {
            id(p): m
            for p, m in zip(self.masters.model_params, self.masters.master_params, strict=True)
        }

    # -- backward -------------------------------------------------------------------------
    def begin_backward(self, reduce: bool) -> None:
        self.buckets.begin(reduce and self.ctx.dp_world_size > 1)

    def _launch(self, bucket: GradBucket) -> None:
        staging = comm_source(bucket.flat(), self.ctx, self._pre_scale)
        work = comm.all_reduce(staging, group=self.ctx.dp_group, async_op=True)
        bucket.inflight = (work, staging)

    def end_backward(self) -> None:
        buckets = self.buckets.flush()
        self._reduced = self._reduced or bool(buckets)
        for bucket in buckets:
            work, staging = bucket.inflight
            work.wait()
            flat = bucket.flat()
            if staging is not flat:
                flat.copy_(staging)
            if self._post_scale != 1.0:
                flat.mul_(self._post_scale)
            bucket.inflight = None

    # -- step -----------------------------------------------------------------------------
    def _step_grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.masters.master_params if p.grad is not None]

    def prepare_step(self, inv_loss_scale: float) -> None:
        if self.ctx.dp_world_size > 1 and not self._reduced:
            # e.g. a direct loss.backward(), or no_sync() around the boundary micro-batch: the
            # ranks' gradients were never averaged, and stepping would let the replicas diverge
            raise RuntimeError(
                "ZeRO stage 0: the optimizer step needs gradients averaged by engine.backward() "
                "at the accumulation boundary, outside engine.no_sync(); call "
                "engine.backward(loss) (not loss.backward()) before engine.step()"
            )
        if self.masters.is_identity:
            if inv_loss_scale != 1.0:
                torch._foreach_mul_(self._step_grads(), inv_loss_scale)
        elif self.buckets.buckets and self.buckets.buckets[0].accumulates:
            # the buckets already hold master-dtype gradients: use them, no copy
            for master, param in zip(
                self.masters.master_params, self.masters.model_params, strict=True
            ):
                master.grad = self.buckets.view_of(param)  # type: ignore[arg-type]
            unscale_(self._step_grads(), inv_loss_scale)
        else:
            self.masters.copy_grads_to_master(inv_loss_scale)

    def local_overflow(self) -> torch.Tensor:
        return has_inf_or_nan(self._step_grads())

    def global_grad_norm(self) -> torch.Tensor:
        grads = self._step_grads()
        if not grads:
            return torch.zeros((), dtype=torch.float32)
        norms = torch._foreach_norm(grads, 2.0)
        return torch.linalg.vector_norm(torch.stack([n.float() for n in norms]), 2.0)

    def scale_gradients(self, coef: torch.Tensor) -> None:
        scale_grads_(self._step_grads(), coef)

    def optimizer_step(self) -> None:
        self.optimizer.step()
        if not self.masters.is_identity:
            self.masters.copy_master_to_model()

    def zero_grad(self, set_to_none: bool = True) -> None:
        del set_to_none  # the gradient buffers are reused; zeroing them in place is cheaper
        self.buckets.zero_()
        self._reduced = False
        if not self.masters.is_identity:
            for master in self.masters.master_params:
                master.grad = None

    def param_fragment(self, param: nn.Parameter) -> ParamFragment | None:
        master = self._master_of.get(id(param))
        if master is None:
            return None
        grad = self.buckets.grad_of(param)
        whole = slice(0, param.numel())
        return ParamFragment(
            param_slice=whole,
            master=master.data.view(-1),
            grad=None if grad is None else grad.view(-1),
            state_key=master,
            state_slice=whole,
            partitioned=False,
            group=self.ctx.dp_group,
        )

    # -- state ----------------------------------------------------------------------------
    def _master_names(self) -> list[str]:
        names = self.param_names()
        return [names[id(p)] for p in self.masters.model_params]

    def bucket_layout(self) -> list[BucketLayout]:
        """Each stepped tensor as a bucket of its own, named after its model parameter: what
        re-partitioning to and from stages 1/2 works with (:mod:`.reshard`)."""
        masters = self.masters.master_params
        named = dict(zip((id(m) for m in masters), self._master_names(), strict=True))
        return replicated_layout(self.optimizer.param_groups, lambda t: named.get(id(t)))

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["layout"] = self.bucket_layout()
        state["master_names"] = self._master_names()
        if not self.masters.is_identity:
            state["fp32_masters"] = [m.detach().clone() for m in self.masters.master_params]
        return state

    def sharded_state(
        self,
        load_shard: Callable[[int], dict[str, Any]],
        count: int,
        module_state: dict[str, torch.Tensor],
    ) -> dict[str, Any]:
        """Gather a checkpoint's shards (of any stage, world size or source) into this
        replicated optimizer's state."""
        layout = self.bucket_layout()
        resharder = Resharder(load_shard, count, module_state)
        state = resharder.state_for(layout, 1, 0, self.optimizer.param_groups)
        shapes, indices, index = {}, [], 0
        for group in self.optimizer.param_groups:
            indices.append(list(range(index, index + len(group["params"]))))
            for tensor in group["params"]:
                shapes[index] = tensor.shape
                index += 1
        optimizer, masters = replicated_from_shard(state, layout, shapes, indices)
        by_name = {b["params"][0][0]: m for b, m in zip(layout, masters, strict=True)}
        strategy: dict[str, Any] = {"stage": self.stage, "layout": layout}
        if not self.masters.is_identity:
            strategy["fp32_masters"] = [by_name[name] for name in self._master_names()]
        return {"optimizer": optimizer, "loss_scaler": state["loss_scaler"], "strategy": strategy}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        masters = state.get("fp32_masters")
        if masters is None:
            if not self.masters.is_identity:
                # a checkpoint without masters: rebuild them from the (loaded) model weights
                for master, param in zip(
                    self.masters.master_params, self.masters.model_params, strict=True
                ):
                    master.data.copy_(param.data)
            return
        for master, saved in zip(self.masters.master_params, masters, strict=True):
            master.data.copy_(saved)
        self.masters.copy_master_to_model()

    def destroy(self) -> None:
        self.buckets.remove_hooks()
        super().destroy()
