"""What ZeRO stages 1 and 2 share: optimizer state partitioned across data-parallel ranks.

The model's parameters are moved into one flat buffer per gradient bucket
(:mod:`~shardspeed.runtime.zero.flat_params`) and each rank owns one contiguous chunk of every
bucket (:mod:`~shardspeed.runtime.zero.partition`). The torch optimizer is rebound to step this
rank's chunks only, so its state exists for ``Ψ/N`` elements. With fp32 parameters the chunk it
steps is the model's own memory; with fp16/bf16 parameters it steps an fp32 master copy of the
chunk. At the accumulation boundary every gradient bucket is reduce-scattered: each rank
receives the summed gradient of its chunk, straight into its gradient chunk (stage 1: its own
chunk of the full gradient buffer, in place; stage 2: a chunk-sized buffer). After
the step every bucket is all-gathered in place, so each rank's parameters are whole again with
no gather buffer and no copy. Communication per step is one reduce-scatter and one all-gather of
``Ψ`` elements, the ``2Ψ(N-1)/N`` bus volume of a plain all-reduce. (``allgather_bucket_size``
is accepted for compatibility; the in-place gather needs no buffer for it to bound.)

The stages differ only in how the gradient buckets hold gradients (``staged_gradients``): stage 1
keeps full-size gradient buffers (``.grad`` views, as stage 0); stage 2 stages each gradient into
a short-lived bucket buffer during the reducing backward and drops ``.grad``, so only the
partition and the buckets in flight hold gradients.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from shardspeed import comm
from shardspeed.runtime.precision.loss_scaler import has_inf_or_nan
from shardspeed.runtime.precision.overflow import unscale_
from shardspeed.runtime.zero.buckets import GradBucket, GradientBuckets
from shardspeed.runtime.zero.flat_params import FlatParams
from shardspeed.runtime.zero.partition import FlatPartition, Piece
from shardspeed.runtime.zero.reshard import BucketLayout, Resharder, layouts_match
from shardspeed.runtime.zero.stage0 import (
    accumulation_dtype,
    comm_source,
    reduce_scale_factors,
    scale_grads_,
    trainable_params,
)
from shardspeed.runtime.zero.strategy import ParamFragment, StrategyContext, ZeroStrategy
from shardspeed.utils.logging import log_dist
from shardspeed.utils.zero_to_fp32 import OPTIM_SHARD

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
    """A reduce-scatter in flight: ``output`` receives the chunk that belongs in ``target``,
    which it replaces (``overwrite``) or is added to."""

    bucket: GradBucket
    work: Any
    source: torch.Tensor
    output: torch.Tensor
    target: torch.Tensor
    overwrite: bool


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
        buckets = self.buckets.buckets
        #: the model's parameters, now views of one flat buffer per bucket
        self.flat_params = FlatParams(buckets)
        self.partition = FlatPartition(buckets, ctx.dp_world_size, ctx.dp_rank)
        #: this rank's reduced gradient of each bucket's chunk, in the bucket's dtype: stage 1
        #: reduces in place into its own chunk of the full gradient buffer; stage 2 into a
        #: chunk-sized buffer that exists only from the bucket's first reduction to the next
        #: zero_grad (``None`` outside), so it holds no memory while the forward stores
        #: activations (DeepSpeed frees its gradient partitions after the step too)
        self.grad_chunks: list[torch.Tensor | None] = [
            None if self.staged_gradients else b.flat()[self.partition.chunk_slice(b.index)]
            for b in buckets
        ]
        #: the tensors the optimizer steps, one per bucket: this rank's chunk of the parameters
        #: itself when they are in the master dtype, else an fp32 copy of it
        self.master_chunks = [self._master_for(b) for b in range(len(buckets))]
        for index, group in enumerate(optimizer.param_groups):
            group["params"] = [
                master
                for bucket, master in zip(buckets, self.master_chunks, strict=True)
                if self._group_of[id(bucket.params[0])] == index
            ]
        self._inflight: deque[_Reduction] = deque()
        # reductions in flight at once: one while the next bucket fills (overlap_comm), or
        # none. A reduction holds memory until finished (stage 2's staged bucket, the receive
        # buffer of gloo's all-to-all path), so the bound keeps that to one bucket's worth.
        self._max_inflight = 1 if ctx.reduce.overlap_comm else 0
        self._reduced = False

    def _param_chunk(self, bucket: int) -> torch.Tensor:
        return self.flat_params.chunk(bucket, self.partition.chunk_slice(bucket))

    def _master_for(self, bucket: int) -> torch.Tensor:
        chunk = self._param_chunk(bucket)
        if chunk.dtype == self.ctx.precision.master_dtype:
            return chunk
        return chunk.to(dtype=self.ctx.precision.master_dtype, copy=True)

    def _aliased(self, bucket: int) -> bool:
        """Whether the optimizer steps bucket ``bucket``'s parameter chunk itself."""
        return self.master_chunks[bucket].data_ptr() == self._param_chunk(bucket).data_ptr()

    # -- backward -------------------------------------------------------------------------
    def begin_backward(self, reduce: bool) -> None:
        if reduce and self._reduced and not self.staged_gradients:
            self._rebase_running_sums()
        self.buckets.begin(reduce)

    @torch.no_grad()
    def _rebase_running_sums(self) -> None:
        """Prepare stage 1's buffers for a second reducing backward before the step.

        After a reduction this rank's chunk holds the averaged sum over ranks (``S/N``) and the
        rest of its buffers the local gradients already sent to their owners. Clearing the rest
        and scaling the chunk back to the plain sum ``S`` makes the next reduce-scatter, which
        averages again, give ``(S + S')/N``: the same as one reduction of everything."""
        for bucket in self.buckets.buckets:
            flat, own = bucket.flat(), self.partition.chunk_slice(bucket.index)
            flat[: own.start].zero_()
            flat[own.stop :].zero_()
            flat[own].mul_(self.ctx.dp_world_size)  # the pre and post factors multiply to 1/N

    def _launch(self, bucket: GradBucket) -> None:
        assert bucket.buffer is not None
        source = comm_source(bucket.buffer, self.ctx, self._pre_scale)
        # stage 1's buffers hold the running sum (see begin_backward), so each reduction
        # replaces the chunk, in place; stage 2 stages only this backward's gradients, so a
        # second reducing backward before the step adds to what the first one left
        target = self.grad_chunks[bucket.index]
        overwrite = target is None or not self.staged_gradients
        if target is None:
            numel = self.partition.chunk_numel[bucket.index]
            target = torch.empty(numel, dtype=bucket.dtype, device=bucket.device)
            self.grad_chunks[bucket.index] = target
        direct = overwrite and target.dtype == source.dtype
        output = target if direct else torch.empty_like(target, dtype=source.dtype)
        work = comm.reduce_scatter_tensor(output, source, group=self.ctx.dp_group, async_op=True)
        self._inflight.append(_Reduction(bucket, work, source, output, target, overwrite))
        while len(self._inflight) > self._max_inflight:
            self._finish(self._inflight.popleft())

    def _finish(self, reduction: _Reduction) -> None:
        reduction.work.wait()
        if self._post_scale != 1.0:
            reduction.output.mul_(self._post_scale)
        if reduction.output is not reduction.target:
            if reduction.overwrite:
                reduction.target.copy_(reduction.output)
            else:
                reduction.target.add_(reduction.output)
        self.buckets.release(reduction.bucket)

    def end_backward(self) -> None:
        reduced = bool(self.buckets.flush())
        self._reduced = self._reduced or reduced
        while self._inflight:
            self._finish(self._inflight.popleft())
        self.buckets.drop_spares()
        if reduced and not getattr(self.ctx.zero_config, "ignore_unused_parameters", True):
            self._refuse_unused()

    def _refuse_unused(self) -> None:
        """``ignore_unused_parameters: false``: stop, on every rank, if any rank trained a
        parameter that got no gradient in the whole accumulation window (checked after the
        reductions, so no rank is left inside a collective)."""
        names = self.param_names()
        unused = [names.get(id(p), str(tuple(p.shape))) for p in self.buckets.unused_params()]
        device = self.master_chunks[0].device if self.master_chunks else None
        count = torch.tensor([float(len(unused))], device=device)
        if self.ctx.dp_world_size > 1:
            comm.all_reduce(count, op=comm.ReduceOp.MAX, group=self.ctx.dp_group)
        if count.item() > 0:
            where = f"{unused[:5]}" if unused else "on another rank"
            raise ValueError(
                f"parameters got no gradient in this accumulation window ({where}) and "
                "zero_optimization.ignore_unused_parameters is false; set it to true "
                "(DeepSpeed's default: unused parameters reduce as zeros) or make every "
                "trainable parameter take part in the loss"
            )

    # -- step -----------------------------------------------------------------------------
    def _master_grads(self) -> list[torch.Tensor]:
        return [m.grad for m in self.master_chunks if m.grad is not None]

    def prepare_step(self, inv_loss_scale: float) -> None:
        if not self._reduced:
            raise RuntimeError(
                f"ZeRO stage {self.stage}: the optimizer step needs gradients reduced by a "
                "backward at the accumulation boundary outside engine.no_sync(); call "
                "engine.backward() outside no_sync() before engine.step()"
            )
        for master, grad in zip(self.master_chunks, self.grad_chunks, strict=True):
            assert grad is not None  # a reducing backward launched every bucket
            # the chunk itself, or an fp32 copy of it (zero_grad drops either)
            master.grad = grad.to(master.dtype)
        unscale_(self._master_grads(), inv_loss_scale)

    def local_overflow(self) -> torch.Tensor:
        return has_inf_or_nan(self._master_grads())

    def global_grad_norm(self) -> torch.Tensor:
        grads = self._master_grads()
        # fp64 sum of squares: the partitioned sum rounds differently from a per-tensor norm,
        # and the extra precision keeps it within an ulp of the true norm
        device = self.master_chunks[0].device if self.master_chunks else torch.device("cpu")
        squares = torch.zeros((), dtype=torch.float64, device=device)
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
        """Bring every rank's updated chunks into the parameters: copy the fp32 masters into the
        chunks (fp16/bf16 models) and all-gather each bucket in place, every bucket in flight
        at once."""
        works = []
        for bucket, flat in enumerate(self.flat_params.buffers):
            chunk = self._param_chunk(bucket)
            if not self._aliased(bucket):
                chunk.copy_(self.master_chunks[bucket])
            if self.ctx.dp_world_size > 1:
                works.append(
                    comm.all_gather_into_tensor(flat, chunk, group=self.ctx.dp_group, async_op=True)
                )
        for work in works:
            work.wait()

    @torch.no_grad()
    def _fill_masters_from_model(self) -> None:
        for bucket, master in enumerate(self.master_chunks):
            if not self._aliased(bucket):
                master.copy_(self._param_chunk(bucket))

    def zero_grad(self, set_to_none: bool = True) -> None:
        del set_to_none  # stage 1 zeroes its buffers in place, stage 2 frees its chunks
        self.buckets.zero_()
        if self.staged_gradients:  # (stage 1's chunks are views of the zeroed buffers)
            self.grad_chunks = [None] * len(self.grad_chunks)
        for master in self.master_chunks:
            master.grad = None
        self._reduced = False

    # -- inspection and state -------------------------------------------------------------
    def param_fragment(self, param: nn.Parameter) -> ParamFragment | None:
        if id(param) not in self._group_of or not param.requires_grad:
            return None
        # a rank owning none of ``param`` still takes part in collectives with an empty piece
        piece = self.partition.piece(param) or Piece(self.buckets.bucket_of(param).index, 0, 0, 0)
        master = self.master_chunks[piece.bucket]
        chunk = self.grad_chunks[piece.bucket]
        grad = chunk[piece.chunk_slice] if self._reduced and chunk is not None else None
        return ParamFragment(
            param_slice=piece.param_slice,
            master=master.detach()[piece.chunk_slice],
            grad=grad,
            state_key=master,
            state_slice=piece.chunk_slice,
            partitioned=self.ctx.dp_world_size > 1,
            group=self.ctx.dp_group,
        )

    def checkpoint_shard_name(self, dp_rank: int | None = None) -> str | None:
        rank = self.ctx.dp_rank if dp_rank is None else dp_rank
        return OPTIM_SHARD.format(rank)

    def bucket_layout(self) -> list[BucketLayout]:
        """Which parameter (by name) sits where in which bucket: saved with every shard, so the
        checkpoint can be re-partitioned (:mod:`~shardspeed.runtime.zero.reshard`)."""
        names = self.param_names()
        stepped = [p for group in self.optimizer.param_groups for p in group["params"]]
        index = {id(p): i for i, p in enumerate(stepped)}  # torch's state_dict numbering
        return [
            {
                "group": self._group_of[id(bucket.params[0])],
                "size": bucket.size,
                "state_index": index[id(self.master_chunks[bucket.index])],
                "params": [
                    [names[id(p)], offset, p.numel()]
                    for p, offset in zip(bucket.params, bucket.offsets, strict=True)
                ],
            }
            for bucket in self.buckets.buckets
        ]

    def sharded_state(
        self,
        load_shard: Callable[[int], dict[str, Any]],
        count: int,
        module_state: dict[str, torch.Tensor],
    ) -> dict[str, Any]:
        # always rebuilt from the shards, also when nothing changed: one path, and the
        # rebuilt tensors own their memory (the shards may be memory-mapped files)
        layout, world = self.bucket_layout(), self.ctx.dp_world_size
        rank = self.ctx.dp_rank
        resharder = Resharder(load_shard, count, module_state, reference=min(rank, count - 1))
        if not layouts_match(resharder.reference["strategy"], layout, world):
            log_dist(
                f"re-partitioning ZeRO optimizer shards saved by {count} ranks for {world} "
                "ranks and this run's buckets",
                [0],
            )
        return resharder.state_for(layout, world, rank, self.optimizer.param_groups)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["dp_world_size"] = self.ctx.dp_world_size
        state["chunk_numel"] = list(self.partition.chunk_numel)
        state["layout"] = self.bucket_layout()
        # None where the optimizer steps the parameters themselves (the module weights saved
        # beside are the masters); else copies: a chunk of a flat buffer would save it whole
        state["fp32_chunks"] = [
            None if self._aliased(b) else m.detach().clone()
            for b, m in enumerate(self.master_chunks)
        ]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("fp32_chunks")
        if saved is None:
            # no partitions saved (e.g. only the module was loaded): start from the model weights
            self._fill_masters_from_model()
            return
        if not layouts_match(state, self.bucket_layout(), self.ctx.dp_world_size):
            raise ValueError(
                f"this optimizer state is one rank's partition for data-parallel size "
                f"{state.get('dp_world_size')} and chunk sizes {state.get('chunk_numel')}; this "
                f"run has {self.ctx.dp_world_size} and {self.partition.chunk_numel}. Load it "
                "with engine.load_checkpoint(), which re-partitions the saved shards"
            )
        with torch.no_grad():
            for master, value in zip(self.master_chunks, saved, strict=True):
                if value is not None:  # None: the master is the parameter chunk itself
                    master.copy_(value)
        self._gather_params()

    def destroy(self) -> None:
        self.buckets.remove_hooks()
        super().destroy()
