"""Lion (https://arxiv.org/abs/2302.06675): :class:`FusedLion` and :class:`DeepSpeedCPULion`.

Per parameter ``p`` with gradient ``g``::

    c = beta1 * m + (1 - beta1) * g
    p <- p * (1 - lr * weight_decay)          (decoupled weight decay)
    p <- p - lr * sign(c)
    m <- beta2 * m + (1 - beta2) * g

The state is one momentum buffer, ``exp_avg``, next to a ``step`` counter.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from shardspeed.ops.cpu_blocks import blockable, flat_blocks, run_blocks
from shardspeed.ops.multi_tensor import (
    MultiTensorOptimizer,
    WorkList,
    check_betas,
    check_non_negative,
    compute_dtype,
    grads_in,
    step_tensor,
)


def lion_update(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
) -> None:
    """One Lion update of same-dtype tensor lists with ``torch._foreach_*`` kernels, in place."""
    direction = torch._foreach_lerp(exp_avgs, grads, 1.0 - beta1)
    torch._foreach_sign_(direction)
    if weight_decay != 0.0:
        torch._foreach_mul_(params, 1.0 - lr * weight_decay)
    torch._foreach_add_(params, direction, alpha=-lr)
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta2)


class _LionBase(MultiTensorOptimizer):
    _name = "Lion"
    fp32_optimizer_states = False

    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        betas: tuple[float, float],
        weight_decay: float,
    ) -> None:
        betas = check_betas(self._name, betas)
        check_non_negative(self._name, lr=lr, weight_decay=weight_decay)
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    def _init_state(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        dtype = compute_dtype(param.dtype) if self.fp32_optimizer_states else param.dtype
        return {
            "step": step_tensor(),
            "exp_avg": torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format),
        }

    def _update_group(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        states = [self.state[p] for p in params]
        for state in states:
            state["step"] += 1
        exp_avgs = [s["exp_avg"] for s in states]
        if all(blockable(p, p.grad, m) for p, m in zip(params, exp_avgs, strict=True)):
            rows = [(p, g, m) for p, g, m in zip(params, grads_in(params), exp_avgs, strict=True)]
            run_blocks(flat_blocks(rows), lambda block: self._update_block(group, block))
        else:
            self._update_tensors(group, params, grads_in(params), exp_avgs)

    def _update_block(self, group: dict[str, Any], block: list[tuple[torch.Tensor, ...]]) -> None:
        p, g, m = (list(column) for column in zip(*block, strict=True))
        self._update_tensors(group, p, g, m)

    def _update_tensors(
        self,
        group: dict[str, Any],
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        exp_avgs: list[torch.Tensor],
    ) -> None:
        p_work = WorkList(params)
        m_work = WorkList(exp_avgs, like=params)
        beta1, beta2 = group["betas"]
        lion_update(
            p_work.work,
            [g.to(w.dtype) for g, w in zip(grads, p_work.work, strict=True)],
            m_work.work,
            lr=float(group["lr"]),
            beta1=beta1,
            beta2=beta2,
            weight_decay=group["weight_decay"],
        )
        p_work.write_back()
        m_work.write_back()


class FusedLion(_LionBase):
    """Lion over whole parameter groups with ``torch._foreach_*`` kernels (any device).

    Args:
        params: iterable of parameters or dicts defining parameter groups.
        lr: learning rate. (default: 1e-3)
        betas: ``beta1`` interpolates the update direction, ``beta2`` the momentum.
            (default: (0.9, 0.999), as DeepSpeed's)
        weight_decay: decoupled weight decay coefficient. (default: 0)
        set_grad_none: ``zero_grad()`` sets gradients to None instead of zeroing them.

    The momentum is kept in the parameter dtype, computed in fp32 for fp16/bf16 parameters.
    """

    _name = "FusedLion"

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        set_grad_none: bool = True,
    ) -> None:
        super().__init__(params, lr, betas, weight_decay)
        self.set_grad_none = set_grad_none


class DeepSpeedCPULion(_LionBase):
    """Lion for the CPU copy of the master parameters (ZeRO-Offload); runs on any device.

    Args:
        params: iterable of parameters or dicts defining parameter groups.
        lr: learning rate. (default: 1e-3)
        betas: ``beta1`` interpolates the update direction, ``beta2`` the momentum.
            (default: (0.9, 0.999), as DeepSpeed's)
        weight_decay: decoupled weight decay coefficient. (default: 0)
        fp32_optimizer_states: keep the momentum in fp32 even for fp16/bf16 parameters.
            (default: True)
    """

    _name = "DeepSpeedCPULion"

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0,
        fp32_optimizer_states: bool = True,
    ) -> None:
        super().__init__(params, lr, betas, weight_decay)
        self.fp32_optimizer_states = fp32_optimizer_states
