"""What ZeRO stages 1 and 2 share: optimizer state partitioned across data-parallel ranks.

Each rank keeps, per parameter group, one flat fp32 master tensor of its partition (see
:mod:`~shardspeed.runtime.zero.partition` for the layout) and the torch optimizer is rebound to
step those tensors, so its state exists for ``Ψ/N`` elements only. At the accumulation boundary
every gradient bucket is reduce-scattered: each rank receives the summed gradient of its own
chunk, straight into a partition-sized gradient buffer. After the optimizer step the updated
partitions are all-gathered back into the model parameters, ``allgather_bucket_size`` elements
at a time. Communication per step is one reduce-scatter and one all-gather of ``Ψ`` elements,
the ``2Ψ(N-1)/N`` bus volume of a plain all-reduce.

The stages differ only in how the gradient buckets hold gradients (``staged_gradients``): stage 1
keeps full-size gradient buffers (``.grad`` views, as stage 0); stage 2 stages each gradient into
a short-lived bucket buffer during the reducing backward and drops ``.grad``, so only the
partition and the buckets in flight hold gradients.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from shardspeed import comm
from shardspeed.runtime.precision.loss_scaler import has_inf_or_nan
from shardspeed.runtime.precision.overflow import unscale_
from shardspeed.runtime.zero.buckets import GradBucket, GradientBuckets
from shardspeed.runtime.zero.partition import ChunkSlot, FlatPartition, Piece, allgather_batches
from shardspeed.runtime.zero.stage0 import (
    accumulation_dtype,
    comm_source,
    reduce_scale_factors,
    scale_grads_,
    trainable_params,
)
from shardspeed.runtime.zero.strategy import ParamFragment, StrategyContext, ZeroStrategy
from shardspeed.utils.logging import log_dist

# torch optimizers DeepSpeed lists as ZeRO-supported; every optimizer in shardspeed.ops is too
_TESTED_TORCH_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad)


def check_optimizer_is_tested(optimizer: torch.optim.Optimizer, allow_untested: bool) -> None:
    """DeepSpeed's rule: ZeRO with an optimizer outside its tested list needs
    ``"zero_allow_untested_optimizer": true`` (then it only warns)."""
    cls = type(optimizer)
    if cls in _TESTED_TORCH_OPTIMIZERS or cls.__module__.startswith("shardspeed.ops"):
        return
    if not allow_untested:
        raise ValueError(
            f"optimizer {cls.__module__}.{cls.__qualname__} has not been tested with ZeRO "
            "(tested: torch.optim.Adam/AdamW/Adagrad and the shardspeed.ops optimizers); add "
            '"zero_allow_untested_optimizer": true to the config to use it anyway'
        )
    log_dist("**** You are using ZeRO with an untested optimizer, proceed with caution ****", [0])


@dataclass(eq=False)
class _Reduction:
    """A reduce-scatter in flight: ``output`` receives the chunk that belongs in ``target``."""

    bucket: GradBucket
    work: Any
    source: torch.Tensor
    output: torch.Tensor
    target: torch.Tensor


@dataclass(eq=False)
class _Gather:
    """An all-gather of updated partitions in flight, and where its result goes."""

    buckets: list[GradBucket]
    slots: list[ChunkSlot]
    work: Any
    gathered: torch.Tensor
    #: the sent tensor: kept alive until the gather completes
    local: torch.Tensor


class PartitionedStrategy(ZeroStrategy):
    """Stages 1 and 2: fp32 master weights, optimizer state and reduced gradients partitioned."""

    #: stage 2 drops full-size gradients during the reducing backward (see the module docstring)
    staged_gradients: ClassVar[bool] = False

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, ctx: StrategyContext):
        super().__init__(module, optimizer, ctx)
        check_optimizer_is_tested(optimizer, ctx.allow_untested_optimizer)
        if len(optimizer.state) > 0:
            raise ValueError(
                f"{type(optimizer).__name__} already has state; ZeRO partitions the optimizer "
                "before its first step, so pass an optimizer that has not stepped yet"
            )
        params = trainable_params(module, optimizer)
        self._params = params
        self._group_of = {
            id(p): index
            for index, group in enumerate(optimizer.param_groups)
            for p in group["params"]
        }
        self._pre_scale, self._post_scale = reduce_scale_factors(ctx)
        self.buckets = GradientBuckets(
            list(reversed(params)),
            ctx.reduce.bucket_size,
            self._launch,
            pad_to=ctx.dp_world_size,
            split_key=lambda p: self._group_of[id(p)],
            staged=self.staged_gradients,
            dtype=accumulation_dtype(ctx, ctx.precision.param_dtype),
        )
        self.partition = FlatPartition(
            self.buckets.buckets,
            self._group_of,
            len(optimizer.param_groups),
            ctx.dp_world_size,
            ctx.dp_rank,
        )
        device = params[0].device if params else torch.device("cpu")
        grad_dtypes = [ctx.precision.param_dtype] * len(optimizer.param_groups)
        for bucket, slot in zip(self.buckets.buckets, self.partition.chunks, strict=True):
            grad_dtypes[slot.group] = bucket.dtype
        #: this rank's reduced gradients, per group, in the gradient dtype
        self.grad_partitions = [
            torch.zeros(n, dtype=dt, device=device)
            for n, dt in zip(self.partition.group_numel, grad_dtypes, strict=True)
        ]
        #: this rank's fp32 master weights, per group: the tensors the optimizer steps
        self.fp32_partitions = [
            torch.zeros(n, dtype=ctx.precision.master_dtype, device=device)
            for n in self.partition.group_numel
        ]
        self._fill_masters_from_model()
        for group, master in zip(optimizer.param_groups, self.fp32_partitions, strict=True):
            group["params"] = [master]
        allgather_size = getattr(ctx.zero_config, "allgather_bucket_size", 500_000_000)
        self._gather_batches = allgather_batches(self.buckets.buckets, max(int(allgather_size), 1))
        self._inflight: deque[_Reduction] = deque()
        # stage 2 bounds the staged buckets alive at once: one in flight while the next fills
        # (overlap_comm), or none; stage 1's buffers exist anyway, so it never waits early
        unbounded = len(self.buckets.buckets)
        self._max_inflight = (
            (1 if ctx.reduce.overlap_comm else 0) if self.staged_gradients else unbounded
        )
        self._reduced = False

    # -- backward -------------------------------------------------------------------------
    def begin_backward(self, reduce: bool) -> None:
        self.buckets.begin(reduce)

    def _launch(self, bucket: GradBucket) -> None:
        assert bucket.buffer is not None
        slot = self.partition.chunks[bucket.index]
        target = self.grad_partitions[slot.group][slot.part_slice]
        source = comm_source(bucket.buffer, self.ctx, self._pre_scale)
        # stage 2 accumulates into the partition (a second reducing backward before the step
        # adds to it); stage 1's buffers already hold the running sum, so it overwrites
        direct = target.dtype == source.dtype and not self.staged_gradients
        output = target if direct else torch.empty_like(target, dtype=source.dtype)
        work = comm.reduce_scatter_tensor(output, source, group=self.ctx.dp_group, async_op=True)
        self._inflight.append(_Reduction(bucket, work, source, output, target))
        while len(self._inflight) > self._max_inflight:
            self._finish(self._inflight.popleft())

    def _finish(self, reduction: _Reduction) -> None:
        reduction.work.wait()
        if self._post_scale != 1.0:
            reduction.output.mul_(self._post_scale)
        if reduction.output is not reduction.target:
            if self.staged_gradients:
                reduction.target.add_(reduction.output)
            else:
                reduction.target.copy_(reduction.output)
        self.buckets.release(reduction.bucket)

    def end_backward(self) -> None:
        if self.buckets.flush():
            self._reduced = True
        while self._inflight:
            self._finish(self._inflight.popleft())

    # -- step -----------------------------------------------------------------------------
    def _master_grads(self) -> list[torch.Tensor]:
        return [m.grad for m in self.fp32_partitions if m.grad is not None]

    def prepare_step(self, inv_loss_scale: float) -> None:
        if not self._reduced:
            raise RuntimeError(
                f"ZeRO stage {self.stage}: the optimizer step needs gradients reduced by a "
                "backward at the accumulation boundary outside engine.no_sync(); call "
                "engine.backward() outside no_sync() before engine.step()"
            )
        for master, grad in zip(self.fp32_partitions, self.grad_partitions, strict=True):
            if grad.dtype == master.dtype:
                master.grad = grad
            else:
                if master.grad is None:
                    master.grad = torch.empty_like(master)
                master.grad.copy_(grad)
        unscale_(self._master_grads(), inv_loss_scale)

    def local_overflow(self) -> torch.Tensor:
        return has_inf_or_nan(self._master_grads())

    def global_grad_norm(self) -> torch.Tensor:
        grads = self._master_grads()
        # fp64 sum of squares: the partitioned sum rounds differently from a per-tensor norm,
        # and the extra precision keeps it within an ulp of the true norm
        squares = torch.zeros((), dtype=torch.float64, device=self.fp32_partitions[0].device)
        if grads:
            norms = torch.stack([n.double() for n in torch._foreach_norm(grads, 2.0)])
            squares = norms.square().sum()
        if self.ctx.dp_world_size > 1:
            comm.all_reduce(squares, group=self.ctx.dp_group)
        return squares.sqrt().float()

    def scale_gradients(self, coef: torch.Tensor) -> None:
        scale_grads_(self._master_grads(), coef)

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self._gather_params()

    @torch.no_grad()
    def _gather_params(self) -> None:
        """All-gather the updated partitions into the model parameters, batch by batch; the
        next batch's all-gather is in flight while this one is copied into the parameters."""
        pending: _Gather | None = None
        for batch in self._gather_batches:
            launched = self._launch_gather(batch)
            if pending is not None:
                self._scatter_gathered(pending)
            pending = launched
        if pending is not None:
            self._scatter_gathered(pending)

    def _launch_gather(self, batch: list[int]) -> _Gather:
        buckets = [self.buckets.buckets[i] for i in batch]
        slots = [self.partition.chunks[i] for i in batch]
        parts = [self.fp32_partitions[s.group][s.part_slice] for s in slots]
        # one bucket: send its partition slice as is (no concatenation copy)
        local = (parts[0] if len(parts) == 1 else torch.cat(parts)).to(buckets[0].dtype)
        world = self.ctx.dp_world_size
        gathered = torch.empty(world * local.numel(), dtype=local.dtype, device=local.device)
        work = comm.all_gather_into_tensor(gathered, local, group=self.ctx.dp_group, async_op=True)
        return _Gather(buckets, slots, work, gathered, local)

    def _scatter_gathered(self, gather: _Gather) -> None:
        """Wait for ``gather`` and copy every rank's chunks into the parameters they belong to."""
        gather.work.wait()
        rows = gather.gathered.view(self.ctx.dp_world_size, gather.local.numel())
        column = 0
        for bucket, slot in zip(gather.buckets, gather.slots, strict=True):
            # rank r's chunk of the bucket is its flat elements [r*chunk, (r+1)*chunk)
            flat = rows[:, column : column + slot.numel].reshape(-1)
            column += slot.numel
            values = [
                flat[offset : offset + p.numel()].view_as(p)
                for p, offset in zip(bucket.params, bucket.offsets, strict=True)
            ]
            torch._foreach_copy_([p.data for p in bucket.params], values)

    @torch.no_grad()
    def _fill_masters_from_model(self) -> None:
        for param in self._params:
            piece = self.partition.piece(param)
            if piece is not None:
                values = param.detach().reshape(-1)[piece.param_slice]
                self.fp32_partitions[piece.group][piece.part_slice].copy_(values)

    def zero_grad(self, set_to_none: bool = True) -> None:
        del set_to_none  # partition buffers are reused; zeroing them in place is cheaper
        self.buckets.zero_()
        for grad in self.grad_partitions:
            grad.zero_()
        self._reduced = False

    # -- inspection and state -------------------------------------------------------------
    def param_fragment(self, param: nn.Parameter) -> ParamFragment | None:
        group = self._group_of.get(id(param))
        if group is None or not param.requires_grad:
            return None
        # a rank owning none of ``param`` still takes part in collectives with an empty piece
        piece = self.partition.piece(param) or Piece(group, 0, 0, 0)
        master = self.fp32_partitions[piece.group]
        grad = self.grad_partitions[piece.group][piece.part_slice] if self._reduced else None
        return ParamFragment(
            param_slice=piece.param_slice,
            master=master.data[piece.part_slice],
            grad=grad,
            state_key=master,
            state_slice=piece.part_slice,
            partitioned=self.ctx.dp_world_size > 1,
            group=self.ctx.dp_group,
        )

    def checkpoint_shard_name(self) -> str | None:
        return f"zero_pp_rank_{self.ctx.dp_rank}_mp_rank_00_optim_states.pt"

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["dp_world_size"] = self.ctx.dp_world_size
        state["partition_numel"] = list(self.partition.group_numel)
        state["fp32_partitions"] = [m.detach().clone() for m in self.fp32_partitions]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("fp32_partitions")
        if saved is None:
            # no partitions saved (e.g. only the module was loaded): start from the model weights
            self._fill_masters_from_model()
            return
        numel = state.get("partition_numel")
        if state.get("dp_world_size") != self.ctx.dp_world_size or numel != list(
            self.partition.group_numel
        ):
            raise ValueError(
                f"checkpoint partitions were saved with data-parallel size "
                f"{state.get('dp_world_size')} and sizes {numel}; this run has "
                f"{self.ctx.dp_world_size} and {self.partition.group_numel}. Loading ZeRO "
                "checkpoints into another world size or bucket layout is not supported yet: "
                "resume with the same world size and zero_optimization settings"
            )
        with torch.no_grad():
            for master, value in zip(self.fp32_partitions, saved, strict=True):
                master.copy_(value)
        self._gather_params()

    def destroy(self) -> None:
        self.buckets.remove_hooks()
        super().destroy()
