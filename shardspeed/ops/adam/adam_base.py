"""The Adam/AdamW update shared by :class:`FusedAdam` and :class:`DeepSpeedCPUAdam`.

Per parameter ``p`` with gradient ``g``, at step ``t`` (1-based)::

    Adam  (adam_w_mode=False):  g <- g + weight_decay * p            (L2 penalty in the gradient)
    AdamW (adam_w_mode=True):   p <- p * (1 - lr * weight_decay)     (decoupled decay)
    m <- beta1 * m + (1 - beta1) * g
    v <- beta2 * v + (1 - beta2) * g * g
    bias_correction=True:   p <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
    bias_correction=False:  p <- p - lr * m / (sqrt(v) + eps)

With ``bias_correction=True`` this is, operation for operation, what ``torch.optim.Adam`` and
``torch.optim.AdamW`` compute, so the two agree to the last bit up to kernel choice. State is kept
under torch's keys (``step``, ``exp_avg``, ``exp_avg_sq``), so a ``state_dict`` loads into either.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from shardspeed.ops.adam.cpu_fused import cpu_fusable, fused_adam_cpu
from shardspeed.ops.multi_tensor import (
    MultiTensorOptimizer,
    WorkList,
    batches_by_numel,
    check_betas,
    check_non_negative,
    grads_in,
    reject_amsgrad,
    step_tensor,
)


def adam_update(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: Sequence[float],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adam_w_mode: bool,
    bias_correction: bool,
) -> None:
    """One Adam(W) update of same-dtype tensor lists with ``torch._foreach_*`` kernels, in place.

    ``steps`` holds each parameter's step number after this update was counted (1 on the first).
    """
    if weight_decay != 0.0:
        if adam_w_mode:
            torch._foreach_mul_(params, 1.0 - lr * weight_decay)
        else:
            # a new list: the caller's gradients must not absorb the penalty
            grads = list(torch._foreach_add(grads, params, alpha=weight_decay))
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1.0 - beta2)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    if bias_correction:
        torch._foreach_div_(denom, [(1.0 - beta2**t) ** 0.5 for t in steps])
        step_sizes = [-lr / (1.0 - beta1**t) for t in steps]
    else:
        step_sizes = [-lr] * len(params)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, step_sizes)


class AdamBase(MultiTensorOptimizer):
    """Adam/AdamW over whole parameter groups; subclasses choose the optimizer-state dtype."""

    _name = "Adam"

    def __init__(
        self,
        params: Iterable[Any],
        *,
        lr: float,
        bias_correction: bool,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        amsgrad: bool,
        adam_w_mode: bool,
    ) -> None:
        reject_amsgrad(self._name, amsgrad)
        betas = check_betas(self._name, betas)
        check_non_negative(self._name, lr=lr, eps=eps, weight_decay=weight_decay)
        defaults = dict(
            lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay
        )
        super().__init__(params, defaults)
        self.adam_w_mode = adam_w_mode

    def _state_dtype(self, param: torch.Tensor) -> torch.dtype:
        return param.dtype

    def _init_state(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        dtype = self._state_dtype(param)
        return {
            # on the parameter's device when that is CUDA, as torch's fused kernels require
            "step": step_tensor(param.device if param.is_cuda else None),
            "exp_avg": torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format),
        }

    def _fusable(self, param: torch.Tensor, group: dict[str, Any]) -> bool:
        # torch's fused CUDA kernels always bias-correct and want one dtype per parameter
        state = self.state[param]
        return (
            param.is_cuda
            and bool(group["bias_correction"])
            and param.grad is not None
            and param.grad.dtype == param.dtype
            and state["exp_avg"].dtype == param.dtype
            and torch.is_tensor(state["step"])
            and state["step"].device == param.device
        )

    def _update_group(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        for p in params:
            state = self.state[p]
            if not torch.is_tensor(state["step"]):  # a DeepSpeed checkpoint stores an int
                state["step"] = step_tensor() + float(state["step"])
            state["step"].add_(1)
        fused = [p for p in params if self._fusable(p, group)]
        if fused:
            self._fused_update(group, fused)
        rest = [p for p in params if not self._fusable(p, group)] if fused else params
        on_cpu = [p for p in rest if self._cpu_fusable(p)]
        if on_cpu:
            self._cpu_fused_update(group, on_cpu)
            rest = [p for p in rest if not self._cpu_fusable(p)]
        if rest:
            self._foreach_update(group, rest)

    def _cpu_fusable(self, param: torch.Tensor) -> bool:
        state = self.state[param]
        step = state["step"]
        return (
            torch.is_tensor(step)
            and step.device.type == "cpu"
            and step.dtype == torch.float32
            and cpu_fusable(param, state["exp_avg"], state["exp_avg_sq"])
        )

    def _hyperparameters(self, group: dict[str, Any]) -> dict[str, Any]:
        """The keyword arguments of :func:`adam_update` / :func:`fused_adam_cpu` for ``group``."""
        beta1, beta2 = group["betas"]
        return dict(
            lr=float(group["lr"]),
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            adam_w_mode=self.adam_w_mode,
            bias_correction=bool(group["bias_correction"]),
        )

    def _cpu_fused_update(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        states = [self.state[p] for p in params]
        fused_adam_cpu(
            params,
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [s["step"] for s in states],
            **self._hyperparameters(group),
        )

    def _foreach_update(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        for batch in batches_by_numel(params):
            self._foreach_update_batch(group, batch)

    def _foreach_update_batch(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        states = [self.state[p] for p in params]
        p_work = WorkList(params)
        m_work = WorkList([s["exp_avg"] for s in states], like=params)
        v_work = WorkList([s["exp_avg_sq"] for s in states], like=params)
        adam_update(
            p_work.work,
            grads_in(params),
            m_work.work,
            v_work.work,
            [float(s["step"]) for s in states],
            **self._hyperparameters(group),
        )
        for work in (p_work, m_work, v_work):
            work.write_back()

    def _fused_update(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        kernel = torch._fused_adamw_ if self.adam_w_mode else torch._fused_adam_
        buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for p in params:
            buckets.setdefault((p.device, p.dtype), []).append(p)
        beta1, beta2 = group["betas"]
        for bucket in buckets.values():
            states = [self.state[p] for p in bucket]
            kernel(
                bucket,
                [p.grad for p in bucket if p.grad is not None],  # all have one (_fusable)
                [s["exp_avg"] for s in states],
                [s["exp_avg_sq"] for s in states],
                [],
                [s["step"] for s in states],
                lr=float(group["lr"]),
                beta1=beta1,
                beta2=beta2,
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                amsgrad=False,
                maximize=False,
            )
