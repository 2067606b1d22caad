"""Gradient buckets: gradients laid out as views of flat buffers, launched as they become ready.

Each trainable parameter's ``.grad`` is a view into one flat buffer per bucket, so autograd
accumulates straight into the buffer and a bucket is reduced in place with a single collective,
with no copy in or out. Buckets are filled in reverse parameter order (roughly the order backward
produces gradients) and are always launched in bucket order: every rank must issue the same
collectives in the same order, whatever order its gradients arrive in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass(eq=False)
class GradBucket:
    """A run of parameters whose gradients share one flat buffer."""

    index: int
    params: list[nn.Parameter]
    buffer: torch.Tensor
    views: list[torch.Tensor]
    pending: int = 0
    launched: bool = False
    #: whatever the launcher needs to finish the collective (work handle, staging tensor)
    inflight: Any = field(default=None, repr=False)

    @property
    def numel(self) -> int:
        return self.buffer.numel()


def _partition_into_buckets(
    params: Sequence[nn.Parameter], bucket_size: int
) -> list[list[nn.Parameter]]:
    """Consecutive runs of same-dtype, same-device parameters of at most ``bucket_size`` elements
    (a single larger parameter gets a bucket of its own)."""
    runs: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    size = 0
    for param in params:
        key_changed = bool(current) and (
            param.dtype != current[0].dtype or param.device != current[0].device
        )
        if current and (key_changed or size + param.numel() > bucket_size):
            runs.append(current)
            current, size = [], 0
        current.append(param)
        size += param.numel()
    if current:
        runs.append(current)
    return runs


class GradientBuckets:
    """Owns the flat gradient buffers of ``params`` and tells ``launch`` when a bucket is ready.

    ``params`` should be given in the order backward is expected to produce their gradients.
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        bucket_size: int,
        launch: Callable[[GradBucket], None],
    ) -> None:
        self._launch = launch
        self.buckets: list[GradBucket] = []
        self._slot: dict[nn.Parameter, tuple[GradBucket, torch.Tensor]] = {}
        for index, run in enumerate(_partition_into_buckets(params, max(bucket_size, 1))):
            buffer = torch.zeros(
                sum(p.numel() for p in run), dtype=run[0].dtype, device=run[0].device
            )
            views, offset = [], 0
            for param in run:
                view = buffer[offset : offset + param.numel()].view_as(param)
                offset += param.numel()
                views.append(view)
            bucket = GradBucket(index, run, buffer, views)
            self.buckets.append(bucket)
            for param, view in zip(run, views, strict=True):
                self._slot[param] = (bucket, view)
        self._next_launch = 0
        self._reducing = False
        self._handles = [
            p.register_post_accumulate_grad_hook(self._on_grad_accumulated) for p in self._slot
        ]
        for param, (_, view) in self._slot.items():
            self._attach(param, view)

    @property
    def numel(self) -> int:
        return sum(b.numel for b in self.buckets)

    def begin(self, reduce: bool) -> None:
        """Start a backward pass; buckets are launched during it only if ``reduce``."""
        self._reducing = reduce
        self._next_launch = 0
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
            bucket.launched = False

    def flush(self) -> list[GradBucket]:
        """Launch every bucket not yet launched (parameters unused in this backward contribute
        zeros, as every rank must take part) and return all buckets of this backward."""
        if not self._reducing:
            return []
        for bucket in self.buckets[self._next_launch :]:
            for param, view in zip(bucket.params, bucket.views, strict=True):
                self._attach(param, view)
            bucket.pending = 0
        self._launch_ready()
        self._reducing = False
        return self.buckets

    def zero_(self) -> None:
        """Zero every gradient buffer in place, keeping the ``.grad`` views attached."""
        for bucket in self.buckets:
            bucket.buffer.zero_()
        for param, (_, view) in self._slot.items():
            self._attach(param, view)

    def grads(self) -> list[torch.Tensor]:
        return [view for bucket in self.buckets for view in bucket.views]

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @staticmethod
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

    def _on_grad_accumulated(self, param: torch.Tensor) -> None:
        bucket, view = self._slot[param]  # type: ignore[index]
        self._attach(param, view)  # type: ignore[arg-type]
        if not self._reducing:
            return
        bucket.pending -= 1
        if bucket.pending == 0 and bucket.index == self._next_launch:
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if bucket.pending > 0:
                return
            bucket.launched = True
            self._launch(bucket)
            self._next_launch += 1
