"""Loss scalers: a static scale, and DeepSpeed's dynamic scale with hysteresis.

The scaler only holds the scale and its update rule. Deciding whether a step overflowed (and
agreeing on it across ranks) is the engine's job; it then calls :meth:`update_scale`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from shardspeed.runtime.precision.overflow import has_inf_or_nan, unscale_
from shardspeed.runtime.precision.policy import PrecisionPolicy
from shardspeed.utils.logging import current_rank, logger

__all__ = [
    "CreateLossScaler",
    "DynamicLossScaler",
    "LossScaler",
    "LossScalerBase",
    "StaticLossScaler",
    "grad_scaler_like",
    "has_inf_or_nan",
    "loss_scaler_for_policy",
    "loss_scaler_from_config",
    "unscale_",
]


class LossScalerBase:
    """A loss scale that the engine multiplies into the loss and divides out of the gradients."""

    dynamic: bool = False

    def __init__(self, cur_scale: float) -> None:
        self.cur_scale = float(cur_scale)

    @property
    def loss_scale(self) -> float:
        """The current scale."""
        return self.cur_scale

    @property
    def inv_scale(self) -> float:
        """``1 / loss_scale``, the factor that unscales gradients."""
        return 1.0 / self.cur_scale

    def scale_loss(self, loss: Tensor) -> Tensor:
        """Return ``loss * loss_scale`` (the loss itself when the scale is 1)."""
        if self.cur_scale == 1.0:
            return loss
        return loss * self.cur_scale

    def backward(self, loss: Tensor, retain_graph: bool = False) -> None:
        """Scale ``loss`` and run autograd on it (DeepSpeed's ``LossScaler.backward``)."""
        self.scale_loss(loss).backward(retain_graph=retain_graph)

    def scale_gradient(self, module: Any, grad_in: tuple, grad_out: tuple) -> tuple:
        """Backward-hook helper kept from DeepSpeed: multiply incoming gradients by the scale."""
        return tuple(None if g is None else self.cur_scale * g for g in grad_in)

    def has_overflow(self, params: Iterable[torch.nn.Parameter]) -> bool:
        """Whether any ``param.grad`` is non-finite (reads the flag on the host, so it syncs)."""
        grads = [p.grad for p in params if p.grad is not None]
        return bool(has_inf_or_nan(grads).item())

    def update_scale(self, overflow: bool) -> None:
        """Adjust the scale after a step; ``overflow`` must already be agreed across ranks."""

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state, for checkpoints."""
        return {"cur_scale": self.cur_scale}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the state saved by :meth:`state_dict`."""
        self.cur_scale = float(state_dict["cur_scale"])


class StaticLossScaler(LossScalerBase):
    """A fixed loss scale; ``scale=1.0`` means no scaling at all."""

    def __init__(self, scale: float = 1.0) -> None:
        if scale <= 0:
            raise ValueError(f"loss_scale={scale} must be > 0 for a static loss scaler")
        super().__init__(scale)


# DeepSpeed's name for the static scaler.
LossScaler = StaticLossScaler


class DynamicLossScaler(LossScalerBase):
    """DeepSpeed's dynamic loss scaler (spec §5, "Dynamic loss scaler semantics").

    On overflow: with hysteresis left (``cur_hysteresis > 1``) only the hysteresis drops by one;
    otherwise the scale becomes ``max(scale / scale_factor, min_scale)``, or, if it already sits at
    ``min_scale`` and ``raise_error_at_min_scale``, an exception ends the run. On a clean step:
    ``consecutive_hysteresis`` refills the hysteresis; and when
    ``stable_interval = (cur_iter - last_overflow_iter) - 1`` is positive and a multiple of
    ``scale_window`` the scale is multiplied by ``scale_factor`` (and the hysteresis refilled).

    With ``last_overflow_iter`` starting at -1, the first doubling happens on the update with
    ``cur_iter == scale_window``, i.e. the ``scale_window + 1``-th clean step; after an overflow at
    iteration ``j``, on iteration ``j + scale_window + 1``.
    """

    dynamic = True

    def __init__(
        self,
        init_scale: float = 2**16,
        scale_factor: float = 2.0,
        scale_window: int = 1000,
        min_scale: float = 1,
        delayed_shift: int = 1,
        consecutive_hysteresis: bool = False,
        raise_error_at_min_scale: bool = True,
        dtype: torch.dtype = torch.half,
    ) -> None:
        if init_scale <= 0 or min_scale <= 0:
            raise ValueError(f"init_scale={init_scale} and min_scale={min_scale} must be > 0")
        if scale_factor <= 1:
            raise ValueError(f"scale_factor={scale_factor} must be > 1")
        if scale_window < 1:
            raise ValueError(f"loss_scale_window={scale_window} must be >= 1")
        if delayed_shift < 1:
            raise ValueError(f"hysteresis={delayed_shift} must be >= 1")
        super().__init__(init_scale)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = float(scale_factor)
        self.scale_window = int(scale_window)
        self.min_scale = float(min_scale)
        self.delayed_shift = int(delayed_shift)
        self.cur_hysteresis = int(delayed_shift)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.raise_error_at_min_scale = bool(raise_error_at_min_scale)
        self.dtype = dtype

    def update_scale(self, overflow: bool) -> None:
        """Apply one step of the update rule described on the class."""
        if overflow:
            self._on_overflow()
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable_interval = (self.cur_iter - self.last_overflow_iter) - 1
            if stable_interval > 0 and stable_interval % self.scale_window == 0:
                self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    def _on_overflow(self) -> None:
        if self.delayed_shift == 1 or self.cur_hysteresis == 1:
            if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
                raise Exception(
                    "Current loss scale already at minimum - cannot decrease scale anymore. "
                    "Exiting run."
                )
            next_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            self._log_overflow(f"reducing to {int(next_scale)}")
            self.cur_scale = next_scale
        else:
            self._log_overflow(
                f"but hysteresis is {self.cur_hysteresis}. "
                f"Reducing hysteresis to {self.cur_hysteresis - 1}"
            )
            self.cur_hysteresis -= 1

    def _log_overflow(self, detail: str) -> None:
        rank = current_rank()
        if rank != 0:
            return
        # The "[deepspeed]" prefix is kept verbatim so log scrapers written for DeepSpeed still match.
        message = f"[deepspeed] OVERFLOW! Rank {rank} Skipping step."
        if self.dtype == torch.half:
            # Only fp16 scales are meaningful to print; DeepSpeed omits them for other dtypes.
            message += f" Attempted loss scale: {int(self.cur_scale)}, {detail}"
        logger.info(message)

    def state_dict(self) -> dict[str, Any]:
        """The scale, the counters and the update-rule settings."""
        return {
            "cur_scale": self.cur_scale,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
            "cur_hysteresis": self.cur_hysteresis,
            "scale_factor": self.scale_factor,
            "scale_window": self.scale_window,
            "min_scale": self.min_scale,
            "delayed_shift": self.delayed_shift,
            "consecutive_hysteresis": self.consecutive_hysteresis,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; keys absent from older checkpoints keep their value."""
        super().load_state_dict(state_dict)
        for key in (
            "cur_iter",
            "last_overflow_iter",
            "cur_hysteresis",
            "scale_factor",
            "scale_window",
            "min_scale",
            "delayed_shift",
            "consecutive_hysteresis",
        ):
            if key in state_dict:
                setattr(self, key, type(getattr(self, key))(state_dict[key]))


def loss_scaler_from_config(fp16: Any) -> LossScalerBase:
    """Build the scaler for an ``fp16`` config section (duck-typed, DeepSpeed attribute names).

    ``loss_scale == 0`` selects dynamic scaling starting at ``2**initial_scale_power``; any
    positive value is a static scale.
    """
    loss_scale = float(getattr(fp16, "loss_scale", 0))
    if loss_scale < 0:
        raise ValueError(
            f"fp16.loss_scale={loss_scale} must be >= 0 (0 = dynamic, > 0 = static scale)"
        )
    if loss_scale > 0:
        return StaticLossScaler(loss_scale)
    return DynamicLossScaler(
        init_scale=2 ** int(getattr(fp16, "initial_scale_power", 16)),
        scale_window=int(getattr(fp16, "loss_scale_window", 1000)),
        min_scale=float(getattr(fp16, "min_loss_scale", 1)),
        delayed_shift=int(getattr(fp16, "hysteresis", 2)),
        consecutive_hysteresis=bool(getattr(fp16, "consecutive_hysteresis", False)),
        dtype=torch.half,
    )


def grad_scaler_like() -> DynamicLossScaler:
    """A scaler with ``torch.amp.GradScaler``'s defaults, for torch_autocast with fp16.

    GradScaler starts at 2**16, halves on every overflow, grows x2 after about 2000 clean
    steps (the window rule above) and never raises, so no hysteresis and a tiny floor.
    """
    return DynamicLossScaler(
        init_scale=2**16,
        scale_window=2000,
        min_scale=2**-24,
        delayed_shift=1,
        raise_error_at_min_scale=False,
    )


def loss_scaler_for_policy(policy: PrecisionPolicy, fp16: Any = None) -> LossScalerBase:
    """The scaler a run needs: the fp16 section's, GradScaler-like, or a no-op scale of 1."""
    if not policy.needs_loss_scaling:
        return StaticLossScaler(1.0)
    if policy.autocast_enabled:
        return grad_scaler_like()
    return loss_scaler_from_config(fp16)


def CreateLossScaler(
    dtype: torch.dtype,
    static_loss_scale: float,
    dynamic_scaling: bool,
    dynamic_loss_args: dict[str, Any] | None,
) -> LossScalerBase:
    """DeepSpeed's factory (and its spelling): dynamic for fp16 when asked, else static (1.0 unless fp16)."""
    if dtype == torch.half and dynamic_scaling:
        return DynamicLossScaler(dtype=dtype, **(dynamic_loss_args or {}))
    return StaticLossScaler(static_loss_scale if dtype == torch.half else 1.0)
