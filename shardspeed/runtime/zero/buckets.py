"""Gradient buckets: runs of parameters whose gradients share one flat buffer, launched for
reduction as soon as they are complete.

A bucket's flat size may be padded to a multiple of ``pad_to`` (the world size), so a
reduce-scatter of the bucket gives every rank an equal contiguous chunk. Buckets are filled in
reverse parameter order (roughly the order backward produces gradients), never mix
``split_key`` values (parameter groups), and are always launched in bucket order: every rank must
issue the same collectives in the same order, whatever order its gradients arrive in.

Where a bucket keeps its gradients (views of a persistent buffer, a wider accumulation buffer, or
short-lived staged buffers) is the bucket's storage mode, an object of
:mod:`~shardspeed.runtime.zero.grad_storage`. Per-parameter facts (bucket, position, offset,
whether its gradient arrived) live on the parameter's
:class:`~shardspeed.runtime.zero.records.ParamRecord`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn

from shardspeed.runtime.zero.grad_storage import GradStorage, persistent_storage
from shardspeed.runtime.zero.records import ParamRecord


@dataclass(eq=False)
class GradBucket:
    """A run of parameters whose gradients share one flat buffer."""

    index: int
    params: list[nn.Parameter]
    #: start of each parameter in the bucket's flat layout
    offsets: list[int]
    #: flat size including the padding to a multiple of ``pad_to``
    size: int
    dtype: torch.dtype
    device: torch.device
    #: the flat gradient buffer; ``None`` for a staged bucket that is not in use
    buffer: torch.Tensor | None = None
    views: list[torch.Tensor] = field(default_factory=list)
    pending: int = 0
    #: the reusable tensor a staged bucket's buffer is carved from while the bucket is in use
    storage: torch.Tensor | None = field(default=None, repr=False)
    #: how the bucket holds gradients (set by :class:`GradientBuckets`)
    mode: GradStorage | None = field(default=None, repr=False)
    #: the ``split_key`` its parameters share (their optimizer parameter group)
    key: Hashable = None
    #: the dtype its gradients are communicated in (None: ``dtype``)
    comm_dtype: torch.dtype | None = None

    def flat(self) -> torch.Tensor:
        """The flat buffer, which must be allocated (always so in persistent modes)."""
        assert self.buffer is not None, f"bucket {self.index} has no buffer allocated"
        return self.buffer

    def allocate(self, storage: torch.Tensor | None = None) -> None:
        """Give the bucket a zeroed flat buffer (the front of ``storage`` if given, else a new
        tensor) and the per-parameter views into it."""
        if storage is None:
            self.buffer = torch.zeros(self.size, dtype=self.dtype, device=self.device)
        else:
            self.buffer = storage[: self.size]
            self.buffer.zero_()
        self.views = [
            self.buffer[offset : offset + param.numel()].view_as(param)
            for param, offset in zip(self.params, self.offsets, strict=True)
        ]


def _partition_into_buckets(
    records: Sequence[ParamRecord],
    bucket_size: int,
    split_key: Callable[[ParamRecord], Hashable] | None = None,
) -> list[list[ParamRecord]]:
    """Runs of at most ``bucket_size`` elements (a single larger parameter gets a run of its own).

    A change of dtype, device or ``split_key`` ends every run. Within a stretch where those stay
    the same, parameters with different communication dtypes (torch_autocast interleaves Linear
    and LayerNorm parameters) fill one open run per comm dtype, as DeepSpeed keeps one bucket
    per dtype, instead of cutting a small run at every change. Runs are ordered by their last
    parameter, about when backward completes them."""

    def key(record: ParamRecord) -> tuple[Any, ...]:
        param = record.param
        return (param.dtype, param.device, None if split_key is None else split_key(record))

    runs: list[list[ParamRecord]] = []
    stretch: list[ParamRecord] = []
    for record in records:
        if stretch and key(record) != key(stretch[0]):
            runs.extend(_fill_runs(stretch, bucket_size))
            stretch = []
        stretch.append(record)
    if stretch:
        runs.extend(_fill_runs(stretch, bucket_size))
    return runs


def _fill_runs(records: list[ParamRecord], bucket_size: int) -> list[list[ParamRecord]]:
    """Size-bounded runs of ``records``, one open run per communication dtype."""
    position = {id(record): index for index, record in enumerate(records)}
    closed: list[list[ParamRecord]] = []
    open_runs: dict[torch.dtype | None, tuple[list[ParamRecord], int]] = {}
    for record in records:
        run, size = open_runs.get(record.comm_dtype, ([], 0))
        if run and size + record.numel > bucket_size:
            closed.append(run)
            run, size = [], 0
        run.append(record)
        open_runs[record.comm_dtype] = (run, size + record.numel)
    closed.extend(run for run, _ in open_runs.values())
    return sorted(closed, key=lambda run: position[id(run[-1])])


class GradientBuckets:
    """Owns the gradient buckets of ``records`` and tells ``launch`` when a bucket is ready.

    ``records`` should be given in the order backward is expected to produce their gradients.
    ``staged``: the storage every bucket uses (stage 2's :class:`StagedStorage`); None gives
    each bucket a persistent buffer (viewed, or accumulated into when ``dtype`` is wider).
    """

    def __init__(
        self,
        records: Sequence[ParamRecord],
        bucket_size: int,
        launch: Callable[[GradBucket], None],
        *,
        pad_to: int = 1,
        split_key: Callable[[ParamRecord], Hashable] | None = None,
        staged: GradStorage | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        """``dtype``: the buffers' dtype (default: the parameters')."""
        self._launch = launch
        self.staged = staged
        self.buckets: list[GradBucket] = []
        self.records = list(records)
        for index, run in enumerate(
            _partition_into_buckets(records, max(bucket_size, 1), split_key)
        ):
            offsets, total = [], 0
            for position, record in enumerate(run):
                record.position, record.offset = position, total
                offsets.append(total)
                total += record.numel
            size = -(-total // pad_to) * pad_to
            first = run[0].param
            bucket = GradBucket(
                index, [r.param for r in run], offsets, size, dtype or first.dtype, first.device
            )
            for record in run:
                record.bucket = bucket
            bucket.key = None if split_key is None else split_key(run[0])
            bucket.comm_dtype = run[0].comm_dtype
            bucket.mode = staged if staged is not None else persistent_storage(bucket)
            self.buckets.append(bucket)
        self._next_launch = 0
        self._reducing = False
        #: counts reducing backwards (a record remembers the one its gradient arrived in)
        self._epoch = 0
        self._handles = [
            r.param.register_post_accumulate_grad_hook(partial(self._on_grad_accumulated, r))
            for r in self.records
        ]
        for bucket in self.buckets:
            self._mode(bucket).setup(bucket)

    @staticmethod
    def _mode(bucket: GradBucket) -> GradStorage:
        assert bucket.mode is not None
        return bucket.mode

    def begin(self, reduce: bool) -> None:
        """Start a backward pass; buckets are launched during it only if ``reduce``."""
        self._reducing = reduce
        self._next_launch = 0
        self._epoch += 1
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)

    def flush(self) -> list[GradBucket]:
        """Launch every bucket not yet launched (parameters unused in this backward contribute
        zeros, as every rank must take part) and return all buckets of this backward."""
        if not self._reducing:
            return []
        for bucket in self.buckets[self._next_launch :]:
            self._mode(bucket).complete(bucket)
            bucket.pending = 0
        self._launch_ready()
        self._reducing = False
        return self.buckets

    def zero_(self) -> None:
        """Forget every gradient (each bucket's mode decides how)."""
        for record in self.records:
            record.used = False
        for bucket in self.buckets:
            self._mode(bucket).zero(bucket)

    def release(self, bucket: GradBucket) -> None:
        """The bucket's reduction has been consumed: a staged buffer is freed."""
        self._mode(bucket).release(bucket)

    def drop_spares(self) -> None:
        """Free buffers kept for reuse once a reducing backward is over."""
        if self.staged is not None:
            self.staged.drop_spares()

    def spare_numel(self) -> int:
        """Elements held by released staged-bucket buffers kept for reuse."""
        return 0 if self.staged is None else self.staged.spare_numel()

    def grad_of(self, record: ParamRecord) -> torch.Tensor | None:
        """The parameter's locally accumulated gradient: its buffer view in the persistent
        modes, autograd's ``.grad`` in staged mode."""
        assert record.bucket is not None
        return self._mode(record.bucket).grad_of(record.bucket, record)

    def unused(self) -> list[ParamRecord]:
        """Parameters that got no gradient since the last :meth:`zero_` (in bucket order)."""
        return [r for r in self.records if not r.used]

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _on_grad_accumulated(self, record: ParamRecord, param: torch.Tensor) -> None:
        del param
        bucket = record.bucket
        assert bucket is not None
        record.used = True
        mode = self._mode(bucket)
        if not self._reducing:
            mode.accumulate(bucket, record)
            return
        if record.arrived_in == self._epoch:
            # Reentrant activation checkpointing runs a nested backward per checkpoint, so a
            # parameter used inside a checkpoint and outside it (or in two) gets one gradient
            # per backward. Its bucket may be reduced already, and staging would overwrite the
            # first part: the reduced gradient would be silently wrong.
            raise RuntimeError(
                f"a parameter of shape {tuple(record.param.shape)} received its gradient twice "
                "in one reducing backward: it is shared between a reentrant activation "
                "checkpoint (shardspeed.checkpointing.checkpoint) and code outside it or another "
                "checkpoint. Gradients are reduced as soon as they are ready, so this is not "
                "supported (DeepSpeed: 'Gradient computed twice for this partition'); checkpoint "
                "blocks that share parameters with shardspeed.checkpointing.non_reentrant_checkpoint."
            )
        record.arrived_in = self._epoch
        mode.collect(bucket, record)
        bucket.pending -= 1
        if bucket.pending == 0 and bucket.index == self._next_launch:
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if bucket.pending > 0:
                return
            self._launch(bucket)
            self._next_launch += 1
