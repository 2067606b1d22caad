"""``DeepSpeedOptimizer``: the base of optimizer wrappers (ZeRO stages, mixed precision).

A wrapper holds an inner ``torch.optim.Optimizer`` and exposes the optimizer interface around
it. This base delegates everything to the inner optimizer, so a subclass overrides only what
it changes (usually ``step``, ``zero_grad``, ``state_dict`` and ``load_state_dict``). It is a
``torch.optim.Optimizer`` by type, so torch's LR schedulers and shardspeed's accept a wrapper
directly; ``param_groups`` and ``state`` are the inner optimizer's own objects, so a schedule
that writes ``group["lr"]`` reaches the optimizer that reads it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any, TypeAlias

from torch.nn import Parameter
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

#: Builds the optimizer from the model parameters (``deepspeed.initialize(optimizer=callable)``).
DeepSpeedOptimizerCallable: TypeAlias = Callable[
    [Iterable[Parameter] | dict[str, Iterable[Parameter]]], Optimizer
]
#: Builds the LR scheduler from the optimizer (``deepspeed.initialize(lr_scheduler=callable)``).
DeepSpeedSchedulerCallable: TypeAlias = Callable[[Optimizer], LRScheduler]


class DeepSpeedOptimizer(Optimizer):
    """An optimizer that wraps ``optimizer``; every method delegates to it unless overridden.

    ``torch.optim.Optimizer.__init__`` is deliberately not called: it would copy the param
    groups into a second list, and a schedule writing one list would not reach the other.
    """

    def __init__(self, optimizer: Optimizer) -> None:
        self.optimizer = optimizer
        # the hook registries torch.optim.Optimizer's methods expect on every instance
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The inner optimizer's parameter groups (the same list object)."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        """The inner optimizer's per-parameter state (the same mapping)."""
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        """The inner optimizer's default hyperparameters."""
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Run the inner optimizer's step."""
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of the wrapped parameters."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The inner optimizer's state dict."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load ``state_dict`` into the inner optimizer."""
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group to the inner optimizer."""
        self.optimizer.add_param_group(param_group)

    def __getstate__(self) -> dict[str, Any]:
        # Optimizer.__getstate__ would pickle only defaults/state/param_groups
        return self.__dict__.copy()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optimizer!r})"


def unwrap_optimizer(optimizer: Any) -> Any:
    """The innermost ``torch.optim.Optimizer`` inside (possibly nested) wrappers."""
    while isinstance(optimizer, DeepSpeedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


__all__ = [
    "DeepSpeedOptimizer",
    "DeepSpeedOptimizerCallable",
    "DeepSpeedSchedulerCallable",
    "unwrap_optimizer",
]
