"""The optimizer the engine hands to the user: a ZeRO strategy plus loss scaling and clipping.

``step()`` is one optimizer step at the accumulation boundary: unscale, agree on overflow across
every rank, clip by the true global norm, update (or skip), update the loss scale, zero grads.
The strategy's shard groups report their local overflow flags and squared-norm parts; one
:class:`~shardspeed.runtime.zero.grad_norm.GradNormReducer` combines them over the right groups.
"""

from __future__ import annotations

from typing import Any

import torch

from shardspeed.runtime.base_optimizer import DeepSpeedOptimizer
from shardspeed.runtime.precision.loss_scaler import LossScalerBase
from shardspeed.runtime.zero.grad_norm import GradNormReducer
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
        reducer: GradNormReducer | None = None,
    ) -> None:
        if strategy.optimizer is None:
            raise ValueError("ZeroOptimizer needs a strategy with a bound optimizer")
        super().__init__(strategy.optimizer)
        self.strategy = strategy
        self.loss_scaler = loss_scaler
        self.gradient_clipping = gradient_clipping
        self.check_overflow = check_overflow
        self.track_grad_norm = track_grad_norm or gradient_clipping > 0.0
        self.reducer = reducer or GradNormReducer()
        self._global_grad_norm: torch.Tensor | None = None
        self.overflow = False

    @property
    def parameter_offload(self) -> Any:
        """ZeRO-3's module hooks under DeepSpeed's names
        (:class:`~shardspeed.runtime.zero.parameter_offload.DeepSpeedZeRoOffload`; TRL takes
        them off around ``generate()``). Below stage 3 there is none: AttributeError, so
        ``hasattr`` answers False as with DeepSpeed's stage 1-2 optimizer."""
        offload = getattr(self.strategy, "parameter_offload", None)
        if offload is None:
            raise AttributeError(
                f"parameter_offload exists at ZeRO stage 3 only (this optimizer is stage "
                f"{self.strategy.stage})"
            )
        return offload

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.loss_scale

    cur_scale = loss_scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.strategy.zero_grad(set_to_none)

    def _set_fp32_optimizer_param_groups(self) -> None:
        """DeepSpeed's ZeRO-3 optimizer puts this rank's fp32 partitions into the torch
        optimizer's parameter groups only around a step or a state dict, and code that reads
        ``optimizer.optimizer.param_groups`` or its ``state_dict()`` calls this first. Here the
        groups hold the stepped tensors at all times: there is nothing to put in."""

    def _clear_fp32_optimizer_param_groups(self) -> None:
        """The counterpart of :meth:`_set_fp32_optimizer_param_groups`: DeepSpeed empties the
        groups again; here they keep the tensors the next step updates."""

    @staticmethod
    def require(verb: str) -> None:
        """The engine's check that ``verb`` has an optimizer: this one is."""
        del verb

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.loss_scaler.scale_loss(loss)

    def step(self, closure: Any = None) -> bool:  # type: ignore[override]
        """One update from the reduced gradients; returns False if it was skipped (overflow)."""
        if closure is not None:
            raise ValueError("shardspeed's optimizer step does not take a closure")
        strategy = self.strategy
        device = strategy.placement.device
        strategy.prepare_step(1.0 / self.loss_scaler.loss_scale)
        if self.check_overflow:
            self.overflow = self.reducer.any_overflow(strategy.overflow_flags(), device)
            self.loss_scaler.update_scale(self.overflow)
            if self.overflow:
                strategy.zero_grad()
                return False
        if self.track_grad_norm:
            norm = self.reducer.global_norm(strategy.grad_squares(), device)
            self._global_grad_norm = norm
            if self.gradient_clipping > 0.0:
                coef = torch.clamp(self.gradient_clipping / (norm + 1e-6), max=1.0)
                strategy.scale_gradients(coef)
        strategy.optimizer_step()
        strategy.zero_grad()
        return True

    @property
    def global_grad_norm(self) -> float | None:
        norm = self._global_grad_norm
        return None if norm is None else float(norm)

    def state_dict(self) -> dict[str, Any]:
        with self.strategy.optimizer_state_resident():  # NVMe offload: read back, then copy
            optimizer = _copied(self.optimizer.state_dict()) if self.strategy.stepper.swap else None
            return {
                "optimizer": optimizer or self.optimizer.state_dict(),
                "loss_scaler": self.loss_scaler.state_dict(),
                "strategy": self.strategy.state_dict(),
                # DeepSpeed's keys: clients read the stage from a shard (Lightning's converter)
                "zero_stage": int(self.strategy.stage),
                "partition_count": self.strategy.checkpoint_world_size(),
            }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.strategy.optimizer_state_replaced()
        self.loss_scaler.load_state_dict(state_dict["loss_scaler"])
        self.strategy.load_state_dict(state_dict["strategy"])

    def __repr__(self) -> str:
        return f"ZeroOptimizer(stage={self.strategy.stage}, optimizer={self.optimizer!r})"


def _copied(state: dict[str, Any]) -> dict[str, Any]:
    """A torch optimizer state dict whose state tensors are copies (the originals give their
    memory back to the NVMe swap after the caller's block)."""
    return {
        **state,
        "state": {
            key: {
                name: value.clone() if isinstance(value, torch.Tensor) else value
                for name, value in entry.items()
            }
            for key, entry in state["state"].items()
        },
    }
