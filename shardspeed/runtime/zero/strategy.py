"""The ZeRO strategy interface: how parameters, gradients and optimizer state are split.

One implementation per stage (0 replicated, 1 optimizer-state partition, 2 + gradient partition,
3 + parameter partition). The engine and :class:`~shardspeed.runtime.zero.optimizer.ZeroOptimizer`
talk only to this interface, so no caller ever branches on the stage number.

The life of one optimizer step, as the engine drives it::

    for each micro-batch:
        strategy.begin_backward(reduce=is_boundary and not no_sync)
        loss.backward()                      # strategy hooks reduce gradients bucket by bucket
        strategy.end_backward()              # flush the last buckets, wait for them
    strategy.prepare_step(inv_loss_scale)    # gradients -> fp32 master gradients, unscaled
    strategy.local_overflow()                # non-finite check on this rank's gradients
    strategy.global_grad_norm()              # over the data-parallel group
    strategy.scale_gradients(clip_coef)
    strategy.optimizer_step()                # update masters, write back to the model
    strategy.zero_grad()
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from shardspeed.comm import ProcessGroup
from shardspeed.runtime.precision.policy import PrecisionPolicy


@dataclass(frozen=True)
class GradReduceOptions:
    """How gradients are averaged across the data-parallel group (DeepSpeed's knobs)."""

    prescale_gradients: bool = False
    gradient_predivide_factor: float = 1.0
    communication_data_type: torch.dtype | None = None
    bucket_size: int = 500_000_000
    overlap_comm: bool = True


@dataclass(frozen=True)
class StrategyContext:
    """Everything a strategy needs from the engine, handed over once at construction."""

    dp_group: ProcessGroup | None
    dp_world_size: int
    dp_rank: int
    precision: PrecisionPolicy
    reduce: GradReduceOptions
    zero_config: Any = None


class ZeroStrategy(ABC):
    """Splits training state across data-parallel ranks; one subclass per ZeRO stage."""

    stage: ClassVar[int]
    #: whether ``engine.no_sync()`` may suppress gradient reduction under this strategy
    supports_no_sync: ClassVar[bool] = True

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, ctx: StrategyContext):
        self.module = module
        self.optimizer = optimizer
        self.ctx = ctx

    @abstractmethod
    def begin_backward(self, reduce: bool) -> None:
        """Called before autograd runs; ``reduce`` says whether this backward reduces gradients."""

    @abstractmethod
    def end_backward(self) -> None:
        """Called after autograd returns: launch what is left and wait for every reduction."""

    @abstractmethod
    def prepare_step(self, inv_loss_scale: float) -> None:
        """Make this rank's gradients ready for the update (master dtype, unscaled)."""

    @abstractmethod
    def local_overflow(self) -> torch.Tensor:
        """A 0-dim float tensor, 1.0 if any gradient this rank holds is inf or nan."""

    @abstractmethod
    def global_grad_norm(self) -> torch.Tensor:
        """The L2 norm of the full gradient over all data-parallel ranks (0-dim tensor)."""

    @abstractmethod
    def scale_gradients(self, coef: torch.Tensor) -> None:
        """Multiply the gradients the optimizer will use by ``coef`` (clipping)."""

    @abstractmethod
    def optimizer_step(self) -> None:
        """Run the wrapped optimizer and bring the model parameters up to date."""

    @abstractmethod
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the accumulated gradients."""

    def master_params(self) -> list[torch.Tensor]:
        """The tensors the wrapped optimizer updates (for state inspection and checkpoints)."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def state_dict(self) -> dict[str, Any]:
        return {"stage": self.stage}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state

    def destroy(self) -> None:  # noqa: B027 - optional hook: most strategies have nothing to undo
        """Remove hooks this strategy installed on the module."""
