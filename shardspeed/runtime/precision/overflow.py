"""Vectorized overflow detection and in-place unscaling of gradient lists.

Both functions stay on the device: the engine all-reduces the overflow flag (MAX) across ranks
before anyone reads it on the host, so reading it here would cost one needless sync per step.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
from torch import Tensor


def _group_by_device_and_dtype(tensors: Iterable[Tensor]) -> dict[tuple, list[Tensor]]:
    # foreach kernels only take their fast path for same-device, same-dtype lists.
    groups: dict[tuple, list[Tensor]] = defaultdict(list)
    for t in tensors:
        groups[(t.device, t.dtype)].append(t)
    return groups


def has_inf_or_nan(tensors: Iterable[Tensor], device: torch.device | str | None = None) -> Tensor:
    """Return a 0-dim float32 tensor: 1.0 if any element of ``tensors`` is inf or NaN, else 0.0.

    The result lives on ``device`` if given, else on the first tensor's device (CPU if the list is
    empty), and is computed without a host sync.
    """
    # The inf-norm (max |x|) is NaN or inf exactly when a tensor holds a non-finite value, and unlike
    # a sum it cannot overflow on large finite values.
    flags: list[Tensor] = []
    for (_, dtype), group in _group_by_device_and_dtype(t for t in tensors if t.numel()).items():
        if not dtype.is_floating_point:
            continue  # integer tensors cannot hold inf or NaN
        norms = torch._foreach_norm(group, float("inf"))
        flags.append((~torch.isfinite(torch.stack(norms))).any().float())
    if device is None:
        device = flags[0].device if flags else torch.device("cpu")
    if not flags:
        return torch.zeros((), dtype=torch.float32, device=device)
    moved = [f.to(device, non_blocking=True) for f in flags]
    return torch.stack(moved).amax()


@torch.no_grad()
def unscale_(tensors: Iterable[Tensor], inv_scale: float | Tensor) -> None:
    """Multiply every tensor in ``tensors`` by ``inv_scale`` in place (a no-op for ``1.0``)."""
    if not isinstance(inv_scale, Tensor) and inv_scale == 1.0:
        return
    for group in _group_by_device_and_dtype(tensors).values():
        scale = inv_scale
        if isinstance(scale, Tensor):
            # A tensor scalar must sit on the list's device for the foreach kernel.
            scale = scale.to(group[0].device, non_blocking=True)
        torch._foreach_mul_(group, scale)
