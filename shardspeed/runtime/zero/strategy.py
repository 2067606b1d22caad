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

Debugging and state-editing utilities (``shardspeed.utils.safe_get_full_fp32_param`` ...) find a
parameter's strategy through :func:`strategy_of` (a weak map filled when a strategy is built) and
its pieces through :meth:`ZeroStrategy.param_fragment`; nothing is stored on the parameters.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

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
    #: the ``zero_allow_untested_optimizer`` flag
    allow_untested_optimizer: bool = False
    #: ``data_types.grad_accum_dtype`` (None: the strategy's default)
    grad_accum_dtype: torch.dtype | None = None


@dataclass(frozen=True)
class ParamFragment:
    """This rank's piece of one model parameter: elements ``param_slice`` of
    ``param.view(-1)``, with their fp32 master values, reduced gradient and optimizer state.

    ``master`` and ``grad`` are 1-D views of exactly the piece; the optimizer state of the piece is
    ``optimizer.state[state_key][name].view(-1)[state_slice]``. ``partitioned`` says whether
    other ranks of ``group`` hold the rest (then assembling the full tensor is a collective).
    """

    param_slice: slice
    master: torch.Tensor
    grad: torch.Tensor | None
    state_key: torch.Tensor
    state_slice: slice
    partitioned: bool
    group: ProcessGroup | None


# parameter -> the strategy that manages it; weak so that a dropped engine frees its model
_STRATEGY_OF: WeakIdKeyDictionary = WeakIdKeyDictionary()


def register_params(params: Iterable[torch.Tensor], strategy: ZeroStrategy) -> None:
    """Record that ``strategy`` manages ``params`` (the latest registration wins)."""
    for param in params:
        _STRATEGY_OF[param] = strategy


def strategy_of(param: torch.Tensor) -> ZeroStrategy | None:
    """The strategy managing ``param``, or None if no live engine trains it."""
    return _STRATEGY_OF.get(param)


class ZeroStrategy(ABC):
    """Splits training state across data-parallel ranks; one subclass per ZeRO stage."""

    stage: ClassVar[int]
    #: whether ``engine.no_sync()`` may suppress gradient reduction under this strategy
    supports_no_sync: ClassVar[bool] = True

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, ctx: StrategyContext):
        self.module = module
        self.optimizer = optimizer
        self.ctx = ctx
        register_params(module.parameters(), self)

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

    @abstractmethod
    def param_fragment(self, param: nn.Parameter) -> ParamFragment | None:
        """This rank's piece of ``param``; None if the optimizer does not train it."""

    def checkpoint_shard_name(self, dp_rank: int | None = None) -> str | None:
        """File name of data-parallel rank ``dp_rank``'s (default: this rank's) optimizer
        checkpoint, or None if the optimizer state is replicated (then it is saved once, with
        the model states)."""
        del dp_rank
        return None

    def sharded_state(
        self,
        load_shard: Callable[[int], dict[str, Any]],
        count: int,
        module_state: dict[str, torch.Tensor],
    ) -> dict[str, Any]:
        """This rank's optimizer-wrapper state from a checkpoint whose ``count`` ranks each
        saved a shard (``load_shard(r)`` reads rank ``r``'s) beside the module state
        ``module_state``, whatever stage, world size and buckets saved it."""
        raise NotImplementedError(f"ZeRO stage {self.stage} keeps no optimizer shards")

    def param_names(self) -> dict[int, str]:
        """Each module parameter's name, by ``id`` (a tied parameter under its first name): how
        checkpoint layouts and error messages name parameters."""
        return {id(p): name for name, p in self.module.named_parameters()}

    def master_params(self) -> list[torch.Tensor]:
        """The tensors the wrapped optimizer updates (for state inspection and checkpoints)."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def state_dict(self) -> dict[str, Any]:
        return {"stage": self.stage}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state

    def destroy(self) -> None:
        """Remove hooks this strategy installed on the module and forget its parameters."""
        for param in self.module.parameters():
            if _STRATEGY_OF.get(param) is self:
                del _STRATEGY_OF[param]
