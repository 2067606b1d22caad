"""The optimizer the engine hands to the user: a ZeRO strategy plus loss scaling and clipping.

``step()`` is one optimizer step at the accumulation boundary: unscale, agree on overflow across
every rank, clip by the true global norm, update (or skip), update the loss scale, zero grads.
"""

from __future__ import annotations

from typing import Any

import torch

from shardspeed import comm
from shardspeed.runtime.base_optimizer import DeepSpeedOptimizer
from shardspeed.runtime.precision.loss_scaler import LossScalerBase
from shardspeed.runtime.zero.strategy import ZeroStrategy


class ZeroOptimizer(DeepSpeedOptimizer):
    """Wraps the basic torch optimizer; ``param_groups`` and ``state`` are the wrapped ones."""

    def __init__(
        self,
        strategy: ZeroStrategy,
        loss_scaler: LossScalerBase,
        gradient_clipping: float = 0.0,
        check_overflow: bool = False,
        track_grad_norm: bool = False,
    ) -> None:
        super().__init__(strategy.optimizer)
        self.strategy = strategy
        self.loss_scaler = loss_scaler
        self.gradient_clipping = gradient_clipping
        self.check_overflow = check_overflow
        self.track_grad_norm = track_grad_norm or gradient_clipping > 0.0
        self._global_grad_norm: torch.Tensor | None = None
        self.overflow = False

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.loss_scale

    cur_scale = loss_scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.strategy.zero_grad(set_to_none)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.loss_scaler.scale_loss(loss)

    def step(self, closure: Any = None) -> bool:  # type: ignore[override]
        """One update from the reduced gradients; returns False if it was skipped (overflow)."""
        if closure is not None:
            raise ValueError("shardspeed's optimizer step does not take a closure")
        strategy = self.strategy
        strategy.prepare_step(1.0 / self.loss_scaler.loss_scale)
        if self.check_overflow:
            self.overflow = self._any_rank_overflowed()
            self.loss_scaler.update_scale(self.overflow)
            if self.overflow:
                strategy.zero_grad()
                return False
        if self.track_grad_norm:
            norm = strategy.global_grad_norm()
            self._global_grad_norm = norm
            if self.gradient_clipping > 0.0:
                coef = torch.clamp(self.gradient_clipping / (norm + 1e-6), max=1.0)
                strategy.scale_gradients(coef)
        strategy.optimizer_step()
        strategy.zero_grad()
        return True

    def _any_rank_overflowed(self) -> bool:
        flag = self.strategy.local_overflow().float()
        if comm.is_initialized() and comm.get_world_size() > 1:
            comm.all_reduce(flag, op=comm.ReduceOp.MAX)
        return bool(flag.item())

    @property
    def global_grad_norm(self) -> float | None:
        norm = self._global_grad_norm
        return None if norm is None else float(norm)

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer.state_dict(),
            "loss_scaler": self.loss_scaler.state_dict(),
            "strategy": self.strategy.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.loss_scaler.load_state_dict(state_dict["loss_scaler"])
        self.strategy.load_state_dict(state_dict["strategy"])

    def __repr__(self) -> str:
        return f"ZeroOptimizer(stage={self.strategy.stage}, optimizer={self.optimizer!r})"
