"""A partitioned shard group (ZeRO stages 1 and 2): fp32 masters, optimizer state and reduced
gradients split across the group's ranks.

The parameters are moved into one flat buffer per gradient bucket
(:mod:`~shardspeed.runtime.zero.flat_params`) and each rank owns one contiguous chunk of every
bucket (:mod:`~shardspeed.runtime.zero.partition`). The optimizer steps this rank's chunks only,
so its state exists for ``Ψ/N`` elements. With fp32 parameters the chunk it steps is the model's
own memory; with fp16/bf16 parameters it steps an fp32 master copy of the chunk. At the
accumulation boundary every bucket is reduce-scattered: each rank receives the summed gradient of
its chunk. After the step every bucket is all-gathered in place, so each rank's parameters are
whole again with no gather buffer and no copy. Communication per step is one reduce-scatter and
one all-gather of ``Ψ`` elements, the ``2Ψ(N-1)/N`` bus volume of a plain all-reduce.
(``allgather_bucket_size`` is accepted for compatibility; the in-place gather needs no buffer
for it to bound.)

Where the reduced chunk goes is the group's :class:`ReducedGradients` mode:
:class:`InPlaceChunks` (stage 1: full-size gradient buffers, ``.grad`` views as in stage 0, each
rank reducing into its own chunk of them) or :class:`ChunkBuffers` (stage 2: each gradient is
staged into a short-lived bucket buffer during the reducing backward and ``.grad`` dropped, so
only the partition and the buckets in flight hold gradients).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

from shardspeed import comm
from shardspeed.checkpoint.layout import BucketLayout, layouts_match
from shardspeed.ops.muon.layout import ShardedMatrices
from shardspeed.runtime.precision.master_weights import MasterWeights
from shardspeed.runtime.precision.overflow import has_inf_or_nan, unscale_
from shardspeed.runtime.zero.buckets import GradBucket, GradientBuckets
from shardspeed.runtime.zero.flat_params import FlatParams
from shardspeed.runtime.zero.grad_norm import GradSquares, partitioned_squares
from shardspeed.runtime.zero.grad_storage import StagedStorage
from shardspeed.runtime.zero.matrix_layout import partitioned_matrix_layouts
from shardspeed.runtime.zero.partition import FlatPartition, Piece
from shardspeed.runtime.zero.records import ParamRecord
from shardspeed.runtime.zero.reduce_options import accumulation_dtype, comm_source
from shardspeed.runtime.zero.shard_group import ParamFragment, ShardGroup


def master_dtype_copies(
    masters: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """Each of ``grads`` in its master's dtype on its master's device: the gradient itself
    where it is already, else a copy. The copies on one device share one flat buffer, filled
    by one multi-tensor copy: a step with a bucket per ZeRO-3 unit would otherwise allocate and
    launch once per bucket (the values are the same casts either way)."""
    result: list[torch.Tensor | None] = [None] * len(grads)
    pending: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for index, (master, grad) in enumerate(zip(masters, grads, strict=True)):
        if grad.device == master.device and grad.dtype == master.dtype:
            result[index] = grad
        elif grad.device == master.device:
            pending.setdefault((master.device, master.dtype), []).append(index)
        else:  # (offloaded masters: a copy across devices, one each)
            result[index] = grad.to(master.device, master.dtype)
    for (device, dtype), indices in pending.items():
        flat = torch.empty(sum(grads[i].numel() for i in indices), dtype=dtype, device=device)
        views = list(flat.split([grads[i].numel() for i in indices]))
        torch._foreach_copy_(views, [grads[i].view(-1) for i in indices])
        for index, view in zip(indices, views, strict=True):
            result[index] = view.view_as(grads[index])
    return [grad for grad in result if grad is not None]


class ReducedGradients(ABC):
    """Where a partitioned group keeps this rank's reduced gradient chunks."""

    #: whether the buckets stage gradients into short-lived buffers (else: persistent ones)
    staged: bool

    @abstractmethod
    def initial_chunks(self, group: PartitionedGroup) -> list[torch.Tensor | None]:
        """Each bucket's chunk before any reduction."""

    def before_reducing_backward(self, group: PartitionedGroup) -> None:
        """A reducing backward is about to start."""
        del group

    @abstractmethod
    def target(self, group: PartitionedGroup, bucket: GradBucket) -> tuple[torch.Tensor, bool]:
        """The chunk the reduction of ``bucket`` lands in, and whether it replaces it (else it
        is added)."""

    def after_zero(self, group: PartitionedGroup) -> None:
        """The gradients were zeroed."""
        del group

    def adopt(self, group: PartitionedGroup, bucket: GradBucket, reduced: torch.Tensor) -> bool:
        """Make ``reduced`` (a tensor nobody else holds) ``bucket``'s chunk itself, instead
        of copying it in; whether it was taken."""
        del group, bucket, reduced
        return False


class InPlaceChunks(ReducedGradients):
    """Stage 1: the chunk is this rank's part of the bucket's full gradient buffer."""

    staged = False

    def initial_chunks(self, group: PartitionedGroup) -> list[torch.Tensor | None]:
        return [b.flat()[group.partition.chunk_slice(b.index)] for b in group.buckets.buckets]

    @torch.no_grad()
    def before_reducing_backward(self, group: PartitionedGroup) -> None:
        """Prepare the buffers for a second reducing backward before the step.

        After a reduction this rank's chunk holds the averaged sum over ranks (``S/N``) and the
        rest of its buffers the local gradients already sent to their owners. Clearing the rest
        and scaling the chunk back to the plain sum ``S`` makes the next reduce-scatter, which
        averages again, give ``(S + S')/N``: the same as one reduction of everything."""
        if not group.reduced:
            return
        for bucket in group.buckets.buckets:
            flat, own = bucket.flat(), group.partition.chunk_slice(bucket.index)
            flat[: own.start].zero_()
            flat[own.stop :].zero_()
            flat[own].mul_(group.options.reduce.unscale_factor(group.comm.divisor))

    def target(self, group: PartitionedGroup, bucket: GradBucket) -> tuple[torch.Tensor, bool]:
        # the buffers hold the running sum (see before_reducing_backward): replace, in place
        chunk = group.grad_chunks[bucket.index]
        assert chunk is not None
        return chunk, True


class ChunkBuffers(ReducedGradients):
    """Stage 2: a chunk-sized buffer per bucket, from its first reduction to the next zero_grad
    (``None`` outside), so it holds no memory while the forward stores activations (DeepSpeed
    frees its gradient partitions after the step too)."""

    staged = True

    def initial_chunks(self, group: PartitionedGroup) -> list[torch.Tensor | None]:
        return [None] * len(group.buckets.buckets)

    def target(self, group: PartitionedGroup, bucket: GradBucket) -> tuple[torch.Tensor, bool]:
        chunk = group.grad_chunks[bucket.index]
        if chunk is not None:
            # only this backward's gradients were staged: add to what an earlier reducing
            # backward before the step left
            return chunk, False
        numel = group.partition.chunk_numel[bucket.index]
        chunk = torch.empty(numel, dtype=bucket.dtype, device=bucket.device)
        group.grad_chunks[bucket.index] = chunk
        return chunk, True

    def after_zero(self, group: PartitionedGroup) -> None:
        group.grad_chunks = [None] * len(group.grad_chunks)

    def adopt(self, group: PartitionedGroup, bucket: GradBucket, reduced: torch.Tensor) -> bool:
        fits = (
            group.grad_chunks[bucket.index] is None
            and reduced.dtype == bucket.dtype
            and reduced.numel() == group.partition.chunk_numel[bucket.index]
            and reduced.is_contiguous()
        )
        if fits:
            group.grad_chunks[bucket.index] = reduced.view(-1)
        return fits


class PartitionedGroup(ShardGroup):
    """Partitioned masters, optimizer state and reduced gradients."""

    def __init__(self, *args: Any, mode: ReducedGradients, **kwargs: Any) -> None:
        self.mode = mode
        super().__init__(*args, **kwargs)
        #: this rank's reduced gradient of each bucket's chunk, in the bucket's dtype
        self.grad_chunks: list[torch.Tensor | None] = mode.initial_chunks(self)

    # -- construction -----------------------------------------------------------------------
    def inflight_limit(self) -> int | None:
        # one reduction in flight while the next bucket fills (overlap_comm), or none: each
        # holds memory until finished, so the bound keeps that to one bucket's worth
        return 1 if self.options.reduce.overlap_comm else 0

    def build_buckets(self) -> GradientBuckets:
        policy = self.options.precision
        buckets = GradientBuckets(
            list(reversed(self.records)),
            self.options.reduce.bucket_size,
            self._launch,
            pad_to=self.comm.world_size,
            split_key=lambda r: r.opt_group,
            staged=StagedStorage() if self.mode.staged else None,
            dtype=accumulation_dtype(policy, self.options.grad_accum_dtype, policy.param_dtype),
        )
        #: the model's parameters, now views of one flat buffer per bucket
        self.flat_params = FlatParams(buckets.buckets)
        self.partition = FlatPartition(
            buckets.buckets, self.records, self.comm.world_size, self.comm.rank
        )
        return buckets

    def _param_chunk(self, bucket: int) -> torch.Tensor:
        return self.flat_params.chunk(bucket, self.partition.chunk_slice(bucket))

    def build_masters(self) -> MasterWeights:
        """One stepped tensor per bucket: this rank's chunk of the parameters itself when they
        are in the master dtype on the master's device (the placement's), else an fp32 copy of
        it there (host memory under ZeRO-Offload)."""
        chunks = [self._param_chunk(b.index) for b in self.buckets.buckets]
        master_dtype = self.options.precision.master_dtype
        devices = self.placement.master_devices([chunk.numel() for chunk in chunks])
        copies = any(
            chunk.dtype != master_dtype or chunk.device != device
            for chunk, device in zip(chunks, devices, strict=True)
        )
        return MasterWeights(chunks, enabled=copies, master_dtype=master_dtype, devices=devices)

    @property
    def master_chunks(self) -> list[torch.Tensor]:
        return self.masters.master_params

    def rebind(self, params: list[torch.Tensor], opt_group: int) -> list[torch.Tensor]:
        mine = {id(r.param) for r in self.records}
        kept = [p for p in params if id(p) not in mine]
        return kept + [
            master
            for bucket, master in zip(self.buckets.buckets, self.master_chunks, strict=True)
            if self._opt_group(bucket) == opt_group
        ]

    @staticmethod
    def _opt_group(bucket: GradBucket) -> int:
        return int(bucket.key)  # type: ignore[call-overload]  # buckets split by opt group

    # -- backward ---------------------------------------------------------------------------
    def begin_backward(self, reduce: bool) -> None:
        if reduce:
            self.mode.before_reducing_backward(self)
        self.buckets.begin(reduce)

    def _launch(self, bucket: GradBucket) -> None:
        assert bucket.buffer is not None
        source = comm_source(bucket.buffer, bucket.comm_dtype, self.pre_scale)
        if self.comm.alone:
            self._keep_alone(bucket, source)
            return
        target, overwrite = self.mode.target(self, bucket)
        direct = overwrite and target.dtype == source.dtype
        output = target if direct else torch.empty_like(target, dtype=source.dtype)
        # the bucket's index names it across steps (ZeRO++ LoCo keeps error buffers by it)
        work = self.comm.reduce_scatter(output, source, async_op=True, key=bucket.index)
        self.inflight.add(work, partial(self._finish, bucket, output, target, overwrite))

    def _finish(
        self, bucket: GradBucket, output: torch.Tensor, target: torch.Tensor, overwrite: bool
    ) -> None:
        if self.post_scale != 1.0:
            output.mul_(self.post_scale)
        if output is not target:
            if overwrite:
                target.copy_(output)
            else:
                target.add_(output)
        self.buckets.release(bucket)

    def _keep_alone(self, bucket: GradBucket, source: torch.Tensor) -> None:
        """A group of one rank: the reduce-scatter would hand ``source`` back unchanged, so it
        is not issued (no collective, no receive buffer, no copy); ``source`` is scaled as the
        reduced result would be and becomes the bucket's chunk where the mode can take it."""
        if self.post_scale != 1.0:
            source.mul_(self.post_scale)
        storage = bucket.storage
        # the bucket's own buffer can be given away when it is all of its storage (a larger
        # reused one would stay pinned by the chunk); a cast copy or an adopted gradient can
        own = source is not bucket.buffer or storage is None or storage.numel() == source.numel()
        if own and self.mode.adopt(self, bucket, source):
            if source is bucket.buffer:
                bucket.storage = None  # the chunk keeps it: not back into the spares
        else:
            target, overwrite = self.mode.target(self, bucket)
            if target.data_ptr() != source.data_ptr():  # (stage 1: the chunk is the buffer)
                if overwrite:
                    target.copy_(source)
                else:
                    target.add_(source)
        self.buckets.release(bucket)

    def end_backward(self) -> None:
        reduced = bool(self.buckets.flush())
        self.reduced = self.reduced or reduced
        self.inflight.drain()
        self.buckets.drop_spares()
        if reduced and not self.options.ignore_unused_parameters:
            self._refuse_unused()

    def _refuse_unused(self) -> None:
        """``ignore_unused_parameters: false``: stop, on every rank, if any rank trained a
        parameter that got no gradient in the whole accumulation window (checked after the
        reductions, so no rank is left inside a collective)."""
        unused = [r.name for r in self.buckets.unused()]
        count = torch.tensor([float(len(unused))], device=self.placement.device)
        if self.comm.partitioned:
            self.comm.all_reduce(count, op=comm.ReduceOp.MAX)
        if count.item() > 0:
            where = f"{unused[:5]}" if unused else "on another rank"
            raise ValueError(
                f"parameters got no gradient in this accumulation window ({where}) and "
                "zero_optimization.ignore_unused_parameters is false; set it to true "
                "(DeepSpeed's default: unused parameters reduce as zeros) or make every "
                "trainable parameter take part in the loss"
            )

    # -- step -------------------------------------------------------------------------------
    def prepare_step(self, inv_loss_scale: float) -> None:
        if not self.reduced:
            raise RuntimeError(
                f"{self.options.label}: the optimizer step needs gradients reduced by a "
                "backward at the accumulation boundary outside engine.no_sync(); call "
                "engine.backward() outside no_sync() before engine.step()"
            )
        grads = [grad for grad in self.grad_chunks if grad is not None]
        assert len(grads) == len(self.grad_chunks)  # a reducing backward launched every bucket
        # the chunk itself, or an fp32 copy of it on the master's device (zero_grad drops
        # either)
        for master, grad in zip(
            self.master_chunks, master_dtype_copies(self.master_chunks, grads), strict=True
        ):
            master.grad = grad
        unscale_(self.step_grads(), inv_loss_scale)

    def grad_squares(self) -> GradSquares:
        return partitioned_squares(self.step_grads(), self.placement.device, self.comm)

    def local_overflow(self) -> torch.Tensor:
        return has_inf_or_nan(self.step_grads(), self.placement.device)

    @torch.no_grad()
    def after_step(self) -> None:
        """Bring every rank's updated chunks into the parameters: copy the fp32 masters into the
        chunks (fp16/bf16 models) and all-gather each bucket in place, every bucket in flight
        at once."""
        self.masters.copy_master_to_model()
        if self.comm.partitioned:
            self._gather_params()

    def _gather_params(self) -> None:
        """Make every rank's parameters whole again from the updated chunks."""
        works = [
            self.comm.all_gather(flat, self._param_chunk(bucket), async_op=True)
            for bucket, flat in enumerate(self.flat_params.buffers)
        ]
        for work in works:
            work.wait()

    def zero_grad(self) -> None:
        self.buckets.zero_()
        self.mode.after_zero(self)
        for master in self.master_chunks:
            master.grad = None
        self.reduced = False

    # -- inspection and state ---------------------------------------------------------------
    def fragment(self, record: ParamRecord) -> ParamFragment:
        assert record.bucket is not None
        # a rank owning none of the parameter still takes part in collectives with an empty piece
        piece = record.piece or Piece(record.bucket.index, 0, 0, 0)
        master = self.master_chunks[piece.bucket]
        chunk = self.grad_chunks[piece.bucket]
        grad = chunk[piece.chunk_slice] if self.reduced and chunk is not None else None
        # not reduced yet (no_sync, or before the boundary): the gradient accumulated here
        local = None if self.reduced else self.buckets.grad_of(record)
        return ParamFragment(
            param_slice=piece.param_slice,
            master=master.detach()[piece.chunk_slice],
            grad=grad,
            state_key=master,
            state_slice=piece.chunk_slice,
            partitioned=self.comm.partitioned,
            group=self.comm.group,
            local_grad=None if local is None else local.view(-1),
        )

    def matrix_layouts(self) -> dict[int, ShardedMatrices]:
        """Each bucket's chunk holds pieces of the bucket's parameters (also at stage 3,
        whose buckets are its gather units' flat shards)."""
        return partitioned_matrix_layouts(self)

    def aliased(self, bucket: int) -> bool:
        """Whether the optimizer steps bucket ``bucket``'s parameter chunk itself."""
        return self.master_chunks[bucket].data_ptr() == self._param_chunk(bucket).data_ptr()

    @torch.no_grad()
    def fill_masters_from_model(self) -> None:
        for bucket, master in enumerate(self.master_chunks):
            if not self.aliased(bucket):
                master.copy_(self._param_chunk(bucket))

    def bucket_layout(self, state_index: dict[int, int]) -> list[BucketLayout]:
        """Which parameter (by name) sits where in which bucket; ``state_index`` numbers the
        stepped tensors as torch's optimizer state_dict does."""
        by_bucket: dict[int, list[ParamRecord]] = {}
        for record in self.buckets.records:
            assert record.bucket is not None
            by_bucket.setdefault(record.bucket.index, []).append(record)
        return [
            {
                "group": self._opt_group(bucket),
                "size": bucket.size,
                "state_index": state_index[id(self.master_chunks[bucket.index])],
                "params": [[r.name, r.offset, r.numel] for r in by_bucket[bucket.index]],
            }
            for bucket in self.buckets.buckets
        ]

    def state_dict(self) -> dict[str, Any]:
        return {
            "dp_world_size": self.comm.world_size,
            "chunk_numel": list(self.partition.chunk_numel),
            # None where the optimizer steps the parameters themselves (the module weights
            # saved beside are the masters); else copies: a chunk of a flat buffer would save
            # it whole
            "fp32_chunks": [
                None if self.aliased(b) else m.detach().clone()
                for b, m in enumerate(self.master_chunks)
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.comm.zeropp is not None:
            # ZeRO++ LoCo's error buffers are not checkpointed (each rank's would hold the
            # whole model's size): after a load they restart at zero, as at a reset_T boundary
            self.comm.zeropp.errors.clear()
        saved = state.get("fp32_chunks")
        if saved is None:
            # no partitions saved (e.g. only the module was loaded): start from the model weights
            self.fill_masters_from_model()
            return
        with torch.no_grad():
            for master, value in zip(self.master_chunks, saved, strict=True):
                if value is not None:  # None: the master is the parameter chunk itself
                    master.copy_(value)
        self.after_step()

    def check_layout(self, state: dict[str, Any], layout: list[BucketLayout]) -> None:
        """Refuse one rank's saved partition that does not fit this run's partitioning."""
        if not layouts_match(state, layout, self.comm.world_size):
            raise ValueError(
                f"this optimizer state is one rank's partition for data-parallel size "
                f"{state.get('dp_world_size')} and chunk sizes {state.get('chunk_numel')}; this "
                f"run has {self.comm.world_size} and {self.partition.chunk_numel}. Load it "
                "with engine.load_checkpoint(), which re-partitions the saved shards"
            )
