"""Shared bookkeeping of the per-batch LR schedules in :mod:`shardspeed.runtime.lr_schedules`."""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Sequence
from typing import Any

import torch


def _param_group_owner(optimizer: Any) -> Any:
    """The object whose ``param_groups`` a schedule writes (the optimizer or its inner one)."""
    # DeepSpeed also accepts a wrapper whose .optimizer is the torch optimizer
    if isinstance(getattr(optimizer, "param_groups", None), list):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(getattr(inner, "param_groups", None), list):
        return inner
    raise TypeError(f"{type(optimizer).__name__} has no param_groups; pass a torch optimizer")


def per_group(optimizer: Any, value: Any, name: str) -> list[Any]:
    """``value`` for every param group: a list/tuple must have one entry per group."""
    count = len(optimizer.param_groups)
    if isinstance(value, list | tuple):
        if len(value) != count:
            raise ValueError(f"expected {count} values for {name} (one per group), got {value!r}")
        return list(value)
    return [value] * count


def set_lrs(param_groups: list[dict[str, Any]], lrs: Sequence[float]) -> list[float]:
    """Write ``lrs`` into the groups (one each) and return them."""
    for group, lr in zip(param_groups, lrs, strict=True):
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(lr)  # keep the tensor: a fused/capturable step holds on to it
        else:
            group["lr"] = lr
    return list(lrs)


class BatchSchedule:
    """Shared bookkeeping: the batch counter, applying LRs, ``state_dict``."""

    def __init__(self, optimizer: Any, last_batch_iteration: int) -> None:
        self.optimizer = _param_group_owner(optimizer)
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: list[float] = [float(g["lr"]) for g in self.optimizer.param_groups]

    def get_lr(self) -> list[float]:
        """The LR of every param group at ``last_batch_iteration``."""
        raise NotImplementedError

    def get_last_lr(self) -> list[float]:
        """The LRs this schedule last wrote into the optimizer."""
        return self._last_lr

    def _advance(self, batch_iteration: int | None) -> None:
        if batch_iteration is None:
            batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = batch_iteration
        self._apply()

    def _apply(self) -> None:
        self._last_lr = set_lrs(self.optimizer.param_groups, self.get_lr())

    def state_dict(self) -> dict[str, Any]:
        """The resumable state: the batch counter (DeepSpeed's checkpoint layout)."""
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Resume at ``sd["last_batch_iteration"]``; the next :meth:`step` applies the LR."""
        self.last_batch_iteration = sd["last_batch_iteration"]


def torch_schedulers() -> dict[str, type]:
    """Lower-cased name -> scheduler class exported by ``torch.optim.lr_scheduler``."""
    found = {}
    for name in dir(torch.optim.lr_scheduler):
        obj = getattr(torch.optim.lr_scheduler, name)
        base = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
        if inspect.isclass(obj) and issubclass(obj, base) and not name.startswith("_"):
            if obj is not torch.optim.lr_scheduler.LRScheduler:
                found[name.lower()] = obj
    return found


def check_scheduler_kwargs(cls: type, params: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming any key of ``params`` that ``cls`` does not take."""
    signature = list(inspect.signature(cls).parameters.values())[1:]  # past the optimizer
    valid = [p.name for p in signature if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    for key in params:
        if key not in valid:
            near = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
            hint = f" Did you mean {near[0]!r}?" if near else ""
            raise ValueError(
                f"scheduler {cls.__name__!r} got an unknown parameter {key!r}.{hint} "
                f"Valid parameters: {', '.join(valid)}"
            )
