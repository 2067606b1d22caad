"""A replicated shard group (ZeRO stage 0): every rank holds the whole parameters, gradients and
optimizer state; gradients are averaged with a bucketed all-reduce that overlaps backward.

Each bucket is reduced in place as soon as its last gradient is accumulated, at the
gradient-accumulation boundary only (earlier micro-batches just accumulate locally, so
communication is one all-reduce of the gradients per optimizer step). With fp16/bf16 parameters
the optimizer steps one fp32 master per parameter.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from shardspeed.runtime.precision.master_weights import MasterWeights
from shardspeed.runtime.precision.overflow import unscale_
from shardspeed.runtime.zero.buckets import GradBucket, GradientBuckets
from shardspeed.runtime.zero.grad_norm import GradSquares, replicated_squares
from shardspeed.runtime.zero.grad_storage import AccumulateStorage
from shardspeed.runtime.zero.records import ParamRecord
from shardspeed.runtime.zero.reduce_options import accumulation_dtype, comm_source
from shardspeed.runtime.zero.shard_group import ParamFragment, ShardGroup


class ReplicatedGroup(ShardGroup):
    """Replicated state, all-reduced gradients."""

    def inflight_limit(self) -> int | None:
        return None  # every bucket's all-reduce runs until the backward ends

    def build_buckets(self) -> GradientBuckets:
        policy = self.options.precision
        # DeepSpeed's bf16 optimizer accumulates gradients in fp32 by default; fp16 and fp32
        # accumulate in the model's dtype
        default = (
            policy.master_dtype if policy.param_dtype == torch.bfloat16 else policy.param_dtype
        )
        return GradientBuckets(
            list(reversed(self.records)),
            self.options.reduce.bucket_size,
            self._launch,
            dtype=accumulation_dtype(policy, self.options.grad_accum_dtype, default),
        )

    def build_masters(self) -> MasterWeights:
        masters = MasterWeights.from_policy([r.param for r in self.records], self.options.precision)
        for record, master in zip(self.records, masters.master_params, strict=True):
            record.master = master
        return masters

    def rebind(self, params: list[torch.Tensor], opt_group: int) -> list[torch.Tensor]:
        mine: dict[int, torch.Tensor] = {
            id(r.param): r.master for r in self.records if r.master is not None
        }
        return [mine[id(p)] if id(p) in mine else p for p in params]

    # -- backward ---------------------------------------------------------------------------
    def begin_backward(self, reduce: bool) -> None:
        reduce = reduce and self.comm.reduces
        if reduce and self.reduced:
            # a second reducing backward before the step: every rank's buffers hold the reduced
            # result R, which the next all-reduce adds world-size times; scale R so that this
            # gives back the plain sum of the first backward (a no-op for a plain average)
            factor = self.options.reduce.unscale_factor(self.comm.divisor) / self.comm.world_size
            if factor != 1.0:
                for bucket in self.buckets.buckets:
                    bucket.flat().mul_(factor)
        self.buckets.begin(reduce)

    def _launch(self, bucket: GradBucket) -> None:
        staging = comm_source(bucket.flat(), bucket.comm_dtype, self.pre_scale)
        if not self.comm.partitioned:  # alone in the group: only the average's scaling
            self._finish(bucket, staging)
            return
        work = self.comm.all_reduce(staging, async_op=True)
        self.inflight.add(work, partial(self._finish, bucket, staging))

    def _finish(self, bucket: GradBucket, staging: torch.Tensor) -> None:
        flat = bucket.flat()
        if staging is not flat:
            flat.copy_(staging)
        if self.post_scale != 1.0:
            flat.mul_(self.post_scale)

    def end_backward(self) -> None:
        self.reduced = self.reduced or bool(self.buckets.flush())
        self.inflight.drain()

    # -- step -------------------------------------------------------------------------------
    def prepare_step(self, inv_loss_scale: float) -> None:
        if self.comm.partitioned and not self.reduced and not self.local_gradients:
            # e.g. a direct loss.backward(), or no_sync() around the boundary micro-batch: the
            # ranks' gradients were never averaged, and stepping would let the replicas diverge
            raise RuntimeError(
                f"{self.options.label}: the optimizer step needs gradients averaged by "
                "engine.backward() at the accumulation boundary, outside engine.no_sync(); call "
                "engine.backward(loss) (not loss.backward()) before engine.step()"
            )
        buckets = self.buckets.buckets
        if self.masters.is_identity:
            if inv_loss_scale != 1.0:
                torch._foreach_mul_(self.step_grads(), inv_loss_scale)
        elif buckets and isinstance(buckets[0].mode, AccumulateStorage):
            # the buckets already hold master-dtype gradients: use them, no copy
            for record in self.records:
                assert record.master is not None
                record.master.grad = self.buckets.grad_of(record)
            unscale_(self.step_grads(), inv_loss_scale)
        else:
            self.masters.copy_grads_to_master(inv_loss_scale)

    def grad_squares(self) -> GradSquares:
        return replicated_squares(self.step_grads(), self.placement.device, self.comm)

    def after_step(self) -> None:
        if not self.masters.is_identity:
            self.masters.copy_master_to_model()

    def zero_grad(self) -> None:
        # the gradient buffers are reused; zeroing them in place is cheaper than freeing
        self.buckets.zero_()
        self.reduced = False
        if not self.masters.is_identity:
            for master in self.masters.master_params:
                master.grad = None

    # -- inspection and state ---------------------------------------------------------------
    def fragment(self, record: ParamRecord) -> ParamFragment:
        assert record.master is not None
        grad = self.buckets.grad_of(record)
        whole = slice(0, record.numel)
        return ParamFragment(
            param_slice=whole,
            master=record.master.data.view(-1),
            grad=None if grad is None else grad.view(-1),
            state_key=record.master,
            state_slice=whole,
            partitioned=False,
            group=self.comm.group,
        )

    @torch.no_grad()
    def fill_masters_from_model(self) -> None:
        if not self.masters.is_identity:
            for master, param in zip(
                self.masters.master_params, self.masters.model_params, strict=True
            ):
                master.copy_(param)

    def master_names(self) -> list[str]:
        return [r.name for r in self.records]

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"master_names": self.master_names()}
        if not self.masters.is_identity:
            state["fp32_masters"] = [m.detach().clone() for m in self.masters.master_params]
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        masters = state.get("fp32_masters")
        if masters is None:
            # a checkpoint without masters: rebuild them from the (loaded) model weights
            self.fill_masters_from_model()
            return
        for master, saved in zip(self.masters.master_params, masters, strict=True):
            master.copy_(saved)
        self.masters.copy_master_to_model()
