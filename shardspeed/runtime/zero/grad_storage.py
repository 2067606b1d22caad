"""How a gradient bucket holds its parameters' gradients: three modes, one small object each.

* :class:`ViewStorage` (stages 0 and 1): each parameter's ``.grad`` is a view into one
  persistent flat buffer per bucket, so autograd accumulates straight into the buffer and the
  bucket is reduced in place with a single collective, with no copy in or out.
* :class:`AccumulateStorage` (a bucket dtype wider than the parameters', e.g. fp32 for a bf16
  model, as DeepSpeed's bf16 optimizer accumulates): the persistent flat buffer is in the wider
  dtype; each micro-batch's gradient is added into it as soon as it is final and ``.grad`` is
  dropped.
* :class:`StagedStorage` (stage 2): ``.grad`` is autograd's own tensor while gradients
  accumulate locally; in a reducing backward each gradient is copied into its bucket's buffer as
  soon as it is final and ``.grad`` is dropped. A bucket's buffer exists only from its first
  gradient until it is :meth:`~GradStorage.release`\\ d, so at most the buckets in flight are ever
  allocated. A bucket of a single parameter (a large embedding, say) adopts that parameter's
  gradient as its buffer instead of copying it. Released buffers are kept (a few) and reused by
  the next buckets of the same backward.

:class:`~shardspeed.runtime.zero.buckets.GradientBuckets` decides *when* (hooks, launch order);
a storage decides *where* the gradient goes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from shardspeed.runtime.zero.buckets import GradBucket
    from shardspeed.runtime.zero.records import ParamRecord

#: released staged-bucket buffers kept for reuse within a backward: one filling while one is
#: reduced
_SPARE_BUFFERS = 2


class GradStorage(ABC):
    """Where a bucket's gradients live (see the module docstring)."""

    #: whether every bucket keeps one flat buffer for the whole run
    persistent: bool = True

    def setup(self, bucket: GradBucket) -> None:
        """Prepare a new bucket (persistent modes allocate its buffer)."""
        bucket.allocate()

    @abstractmethod
    def accumulate(self, bucket: GradBucket, record: ParamRecord) -> None:
        """A gradient became final in a backward that does not reduce."""

    @abstractmethod
    def collect(self, bucket: GradBucket, record: ParamRecord) -> None:
        """A gradient became final in a reducing backward: put it in the bucket's buffer."""

    @abstractmethod
    def complete(self, bucket: GradBucket) -> None:
        """Before launching a bucket whose gradients did not all arrive (unused parameters)."""

    @abstractmethod
    def zero(self, bucket: GradBucket) -> None:
        """Forget the bucket's gradients."""

    @abstractmethod
    def grad_of(self, bucket: GradBucket, record: ParamRecord) -> torch.Tensor | None:
        """The parameter's locally accumulated gradient."""

    def release(self, bucket: GradBucket) -> None:
        """The bucket's reduction has been consumed (only staged buffers are freed)."""
        del bucket

    def drop_spares(self) -> None:
        """A reducing backward is over: free what was kept for reuse within it."""
        return None  # only staged storage keeps spares

    def spare_numel(self) -> int:
        """Elements held by released buffers kept for reuse."""
        return 0


def _attach(param: nn.Parameter, view: torch.Tensor) -> None:
    """Make ``param.grad`` the bucket view, keeping whatever gradient it holds."""
    grad = param.grad
    if grad is None:
        view.zero_()
    elif grad.data_ptr() != view.data_ptr():
        # the user (or autograd, after grads were set to None) put a fresh tensor there
        view.copy_(grad)
    else:
        return
    param.grad = view


class ViewStorage(GradStorage):
    """``.grad`` is a view of the bucket's persistent buffer."""

    def setup(self, bucket: GradBucket) -> None:
        bucket.allocate()
        self.complete(bucket)

    def accumulate(self, bucket: GradBucket, record: ParamRecord) -> None:
        _attach(record.param, bucket.views[record.position])

    collect = accumulate

    def complete(self, bucket: GradBucket) -> None:
        for param, view in zip(bucket.params, bucket.views, strict=True):
            _attach(param, view)

    def zero(self, bucket: GradBucket) -> None:
        bucket.flat().zero_()
        self.complete(bucket)

    def grad_of(self, bucket: GradBucket, record: ParamRecord) -> torch.Tensor | None:
        return bucket.views[record.position]


class AccumulateStorage(GradStorage):
    """Gradients are added into a wider persistent buffer and ``.grad`` is dropped."""

    def accumulate(self, bucket: GradBucket, record: ParamRecord) -> None:
        grad = record.param.grad
        if grad is not None:
            bucket.views[record.position].add_(grad)
            record.param.grad = None

    collect = accumulate

    def complete(self, bucket: GradBucket) -> None:
        for position, param in enumerate(bucket.params):
            grad = param.grad
            if grad is not None:
                bucket.views[position].add_(grad)
                param.grad = None

    def zero(self, bucket: GradBucket) -> None:
        bucket.flat().zero_()
        for param in bucket.params:
            param.grad = None

    def grad_of(self, bucket: GradBucket, record: ParamRecord) -> torch.Tensor | None:
        return bucket.views[record.position]


class StagedStorage(GradStorage):
    """Gradients stay autograd's until the reducing backward stages them into short-lived
    bucket buffers, carved from a few reused tensors."""

    persistent = False

    def __init__(self) -> None:
        #: released buffers, reused best-fit
        self._spare: list[torch.Tensor] = []

    def setup(self, bucket: GradBucket) -> None:
        del bucket  # a buffer only from the bucket's first gradient of a reducing backward

    def accumulate(self, bucket: GradBucket, record: ParamRecord) -> None:
        del bucket, record  # autograd accumulates in .grad

    def collect(self, bucket: GradBucket, record: ParamRecord) -> None:
        if bucket.buffer is None and self._adopt(bucket, record.param):
            return
        if bucket.buffer is None:
            self._allocate(bucket)
        self._stage(bucket, record.position, record.param)

    def complete(self, bucket: GradBucket) -> None:
        if bucket.buffer is None:
            self._allocate(bucket)
        # gradients of earlier micro-batches whose parameter this one did not use
        for position, param in enumerate(bucket.params):
            self._stage(bucket, position, param)

    def zero(self, bucket: GradBucket) -> None:
        for param in bucket.params:
            param.grad = None

    def grad_of(self, bucket: GradBucket, record: ParamRecord) -> torch.Tensor | None:
        return record.param.grad

    def release(self, bucket: GradBucket) -> None:
        if bucket.storage is not None:
            self._spare.append(bucket.storage)
            # keep the largest: a later bucket fits in any buffer at least its size
            self._spare.sort(key=torch.Tensor.numel, reverse=True)
            del self._spare[_SPARE_BUFFERS:]
        bucket.buffer = None
        bucket.storage = None
        bucket.views = []

    def drop_spares(self) -> None:
        # between backwards they would only add to the memory held while the next forward
        # stores its activations
        self._spare = []

    def spare_numel(self) -> int:
        return sum(spare.numel() for spare in self._spare)

    def _allocate(self, bucket: GradBucket) -> None:
        """Give the bucket a buffer: the smallest spare one that fits, else a new one."""
        fits = [
            index
            for index, spare in enumerate(self._spare)
            if spare.numel() >= bucket.size
            and spare.dtype == bucket.dtype
            and spare.device == bucket.device
        ]
        if fits:
            storage = self._spare.pop(min(fits, key=lambda i: self._spare[i].numel()))
        else:
            storage = torch.empty(bucket.size, dtype=bucket.dtype, device=bucket.device)
        bucket.storage = storage
        bucket.allocate(storage)

    @staticmethod
    def _stage(bucket: GradBucket, position: int, param: nn.Parameter) -> None:
        """Move ``param``'s final gradient into the bucket and drop the ``.grad`` tensor."""
        grad = param.grad
        if grad is not None:
            bucket.views[position].copy_(grad)
            # dropping the reference frees the full-size gradient: only buckets stay allocated
            param.grad = None

    @staticmethod
    def _adopt(bucket: GradBucket, param: nn.Parameter) -> bool:
        """Make ``param``'s gradient itself the buffer of a bucket that holds only ``param``
        (e.g. a large embedding), instead of copying it into a new one: no second full-size
        gradient, no copy. Only for a dense, contiguous gradient of exactly the bucket's size
        and dtype that owns its memory."""
        grad = param.grad
        adoptable = (
            grad is not None
            and len(bucket.params) == 1
            and bucket.size == grad.numel()
            and grad.layout == torch.strided
            and grad.is_contiguous()
            and grad.dtype == bucket.dtype
            and grad.device == bucket.device
            and grad._base is None
            and grad.untyped_storage().nbytes() == grad.nbytes
        )
        if not adoptable:
            return False
        assert grad is not None
        bucket.buffer = grad.view(-1)
        bucket.views = [grad]
        param.grad = None
        return True


def persistent_storage(bucket: GradBucket) -> GradStorage:
    """The mode of a bucket that keeps its buffer: views of it, or accumulation into it when
    it is wider than the parameters."""
    return AccumulateStorage() if bucket.dtype != bucket.params[0].dtype else ViewStorage()
