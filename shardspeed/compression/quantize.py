"""Fake quantization for compression-aware training: values rounded to a ``bits``-bit grid and
back to float, with a straight-through gradient (the rounding passes gradients unchanged).

* symmetric: one scale per group, ``max|x| / (2^(bits-1) - 1)``, zero at zero;
* asymmetric: a scale and a zero point per group from the group's min and max;
* 2 bits: ternary (``{-a, 0, a}`` with DeepSpeed's 0.7 * mean|x| threshold), 1 bit: binary
  (``a * sign(x)``, ``a = mean|x|``), symmetric only as in DeepSpeed.

The bits follow DeepSpeed's MoQ schedule (:func:`scheduled_bits`): ``start_bits`` when
quantization turns on, one bit less after ``quantization_period`` steps, the period doubling
after every reduction, until ``target_bits``.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

__all__ = ["StaticRange", "fake_quantize", "quantize", "scheduled_bits"]

QuantizationType = Literal["symmetric", "asymmetric"]
Rounding = Literal["nearest", "stochastic"]

_TINY = 1e-12  # an all-zero group keeps a usable scale


def scheduled_bits(steps_on: int, start_bits: int, target_bits: int, period: int) -> int:
    """Bits after quantization has been on for ``steps_on`` optimizer steps (MoQ: reductions at
    ``period``, ``2 * period``, ``4 * period``, ... steps)."""
    bits, due = start_bits, period
    while bits > target_bits and steps_on >= due:
        bits -= 1
        due = max(due * 2, 1)
    return bits


def _round(x: torch.Tensor, rounding: Rounding) -> torch.Tensor:
    if rounding == "stochastic":
        return torch.floor(x + torch.rand_like(x))
    return torch.round(x)


def _grouped(x: torch.Tensor, groups: int) -> torch.Tensor:
    if x.numel() % groups != 0:
        raise ValueError(
            f"quantize_groups={groups} does not divide the tensor of shape {tuple(x.shape)} "
            f"({x.numel()} values): pick a group count that divides it"
        )
    return x.reshape(groups, -1)


def quantize(
    x: torch.Tensor,
    bits: int,
    kind: QuantizationType = "symmetric",
    groups: int = 1,
    rounding: Rounding = "nearest",
    value_range: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``x`` on a ``bits``-bit grid (no gradient handling); ``value_range`` (min, max) replaces
    the per-group range (static activation calibration)."""
    if bits >= 32:
        return x
    flat = _grouped(x.detach(), groups)
    if bits <= 2:
        if kind != "symmetric":
            raise ValueError(
                f"{bits}-bit weight quantization is symmetric only (ternary/binary): set "
                "quantization_type to 'symmetric'"
            )
        return (_ternary(flat) if bits == 2 else _binary(flat)).reshape(x.shape)
    if value_range is not None:
        low = value_range[0].reshape(1, 1).expand(flat.shape[0], 1)
        high = value_range[1].reshape(1, 1).expand(flat.shape[0], 1)
    else:
        low, high = flat.amin(dim=1, keepdim=True), flat.amax(dim=1, keepdim=True)
    if kind == "symmetric":
        levels = 2 ** (bits - 1) - 1
        scale = torch.maximum(low.abs(), high.abs()).clamp_min(_TINY) / levels
        q = _round(flat / scale, rounding).clamp(-levels, levels)
        return (q * scale).reshape(x.shape)
    levels = 2**bits - 1
    scale = (high - low).clamp_min(_TINY) / levels
    zero = torch.round(-low / scale)
    q = (_round(flat / scale, rounding) + zero).clamp(0, levels)
    return ((q - zero) * scale).reshape(x.shape)


def _ternary(flat: torch.Tensor) -> torch.Tensor:
    threshold = 0.7 * flat.abs().mean(dim=1, keepdim=True)
    keep = (flat.abs() > threshold).to(flat.dtype)
    alpha = (flat.abs() * keep).sum(dim=1, keepdim=True) / keep.sum(dim=1, keepdim=True).clamp_min(
        1
    )
    return alpha * torch.sign(flat) * keep


def _binary(flat: torch.Tensor) -> torch.Tensor:
    return flat.abs().mean(dim=1, keepdim=True) * torch.sign(flat)


def fake_quantize(
    x: torch.Tensor,
    bits: int,
    kind: QuantizationType = "symmetric",
    groups: int = 1,
    rounding: Rounding = "nearest",
    value_range: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """:func:`quantize` in the forward, the identity in the backward (straight-through)."""
    q = quantize(x, bits, kind, groups, rounding, value_range)
    return x + (q - x).detach()


class StaticRange(nn.Module):
    """Static activation range (``range_calibration: static``): a running min/max, updated in
    training with momentum 0.95 (DeepSpeed's ``QuantAct``), frozen in eval."""

    x_min_max: torch.Tensor

    def __init__(self, momentum: float = 0.95) -> None:
        super().__init__()
        self.momentum = momentum
        self.register_buffer("x_min_max", torch.zeros(2))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The range to quantize ``x`` with (updated first when training)."""
        if self.training:
            low, high = x.detach().min(), x.detach().max()
            if bool(self.x_min_max[0] == self.x_min_max[1]):  # first batch: start from it
                self.x_min_max[0], self.x_min_max[1] = low, high
            m = self.momentum
            self.x_min_max[0] = self.x_min_max[0] * m + low * (1 - m)
            self.x_min_max[1] = self.x_min_max[1] * m + high * (1 - m)
        return self.x_min_max[0], self.x_min_max[1]
