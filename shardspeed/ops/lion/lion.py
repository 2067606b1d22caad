"""Lion (https://arxiv.org/abs/2302.06675): :class:`FusedLion` and :class:`DeepSpeedCPULion`.

Per parameter ``p`` with gradient ``g``::

    c = beta1 * m + (1 - beta1) * g
    p <- p * (1 - lr * weight_decay)          (decoupled weight decay)
    p <- p - lr * sign(c)
    m <- beta2 * m + (1 - beta2) * g

The state is one momentum buffer, ``exp_avg``, next to a ``step`` counter.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

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
        if all(_blockable(p, m) for p, m in zip(params, exp_avgs, strict=True)):
            for p_block, g_block, m_block in cache_blocks(params, exp_avgs):
                self._update_tensors(group, p_block, g_block, m_block)
        else:
            self._update_tensors(group, params, grads_in(params), exp_avgs)

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


#: elements per cache block: the five passes of a CPU Lion update then run over a few MB that
#: stay in cache, so memory sees about one read of p, g, m and one write of p, m (3x faster)
CACHE_BLOCK_NUMEL = 1 << 20


def _blockable(param: torch.Tensor, exp_avg: torch.Tensor) -> bool:
    grad = param.grad
    return (
        grad is not None
        and not grad.is_sparse
        and all(t.device.type == "cpu" and t.is_contiguous() for t in (param, grad, exp_avg))
    )


Block = tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]


def cache_blocks(params: list[torch.Tensor], exp_avgs: list[torch.Tensor]) -> Iterator[Block]:
    """Parameters, their gradients and ``exp_avgs`` as batches of flat views of at most
    :data:`CACHE_BLOCK_NUMEL` elements in all."""
    p_block: list[torch.Tensor] = []
    g_block: list[torch.Tensor] = []
    m_block: list[torch.Tensor] = []
    size = 0
    for param, exp_avg in zip(params, exp_avgs, strict=True):
        assert param.grad is not None  # _blockable checked it
        pieces = zip(
            param.detach().view(-1).split(CACHE_BLOCK_NUMEL),
            param.grad.view(-1).split(CACHE_BLOCK_NUMEL),
            exp_avg.view(-1).split(CACHE_BLOCK_NUMEL),
            strict=True,
        )
        for p_view, g_view, m_view in pieces:
            if size + p_view.numel() > CACHE_BLOCK_NUMEL and p_block:
                yield p_block, g_block, m_block
                p_block, g_block, m_block, size = [], [], [], 0
            p_block.append(p_view)
            g_block.append(g_view)
            m_block.append(m_view)
            size += p_view.numel()
    if p_block:
        yield p_block, g_block, m_block


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
