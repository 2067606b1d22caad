"""``DeepSpeedCPUAdagrad``: Adagrad for the CPU copy of the master parameters (ZeRO-Offload).

Per parameter ``p`` with gradient ``g``::

    g <- g + weight_decay * p              (L2 penalty, as DeepSpeed's and torch's Adagrad)
    v <- v + g * g
    p <- p - lr * g / (sqrt(v) + eps)

This is ``torch.optim.Adagrad`` with ``lr_decay=0`` and ``initial_accumulator_value=0``. The
accumulated squares live under DeepSpeed's key ``exp_avg_sq`` next to a ``step`` counter.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from shardspeed.ops.multi_tensor import (
    MultiTensorOptimizer,
    WorkList,
    check_non_negative,
    compute_dtype,
    grads_in,
    reject_amsgrad,
    step_tensor,
)

#: dtypes torch's fused CPU Adagrad kernel updates (parameter, gradient and sum all alike)
_FUSED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def adagrad_update(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    sums: list[torch.Tensor],
    *,
    lr: float,
    eps: float,
    weight_decay: float,
) -> None:
    """One Adagrad update of same-dtype tensor lists with ``torch._foreach_*`` kernels, in place."""
    if weight_decay != 0.0:
        grads = list(torch._foreach_add(grads, params, alpha=weight_decay))
    torch._foreach_addcmul_(sums, grads, grads, 1.0)
    denom = torch._foreach_sqrt(sums)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, grads, denom, -lr)


class DeepSpeedCPUAdagrad(MultiTensorOptimizer):
    """Vectorised Adagrad (https://jmlr.org/papers/v12/duchi11a.html); runs on any device.

    Args:
        model_params: iterable of parameters or dicts defining parameter groups.
        lr: learning rate. (default: 1e-2)
        eps: term added to the denominator for numerical stability. (default: 1e-10)
        weight_decay: L2 penalty added to the gradient. (default: 0)
        amsgrad: not supported; True raises ``ValueError``.
        fp32_optimizer_states: keep the accumulator in fp32 even for fp16/bf16 parameters.
            (default: True)

    Sparse gradients (``nn.Embedding(sparse=True)``) update only the rows they touch, weight
    decay included, as DeepSpeed's does.
    """

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-2,
        eps: float = 1e-10,
        weight_decay: float = 0,
        amsgrad: bool = False,
        fp32_optimizer_states: bool = True,
    ) -> None:
        reject_amsgrad("DeepSpeedCPUAdagrad", amsgrad)
        check_non_negative("DeepSpeedCPUAdagrad", lr=lr, eps=eps, weight_decay=weight_decay)
        defaults = dict(lr=lr, eps=eps, weight_decay=weight_decay, amsgrad=False)
        super().__init__(model_params, defaults)
        self.fp32_optimizer_states = fp32_optimizer_states

    def _init_state(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        dtype = compute_dtype(param.dtype) if self.fp32_optimizer_states else param.dtype
        return {
            "step": step_tensor(),
            "exp_avg_sq": torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format),
        }

    def _update_group(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        for p in params:
            self.state[p]["step"] += 1
        hyper = dict(lr=float(group["lr"]), eps=group["eps"], weight_decay=group["weight_decay"])
        dense = [p for p in params if not p.grad.is_sparse]  # type: ignore[union-attr]
        fused = [p for p in dense if self._cpu_fusable(p)]
        if fused:
            self._fused_update(fused, hyper)
            dense = [p for p in dense if not self._cpu_fusable(p)]
        if dense:
            p_work = WorkList(dense)
            v_work = WorkList([self.state[p]["exp_avg_sq"] for p in dense], like=dense)
            adagrad_update(p_work.work, grads_in(dense), v_work.work, **hyper)
            p_work.write_back()
            v_work.write_back()
        for p in params:
            if p.grad.is_sparse:  # type: ignore[union-attr]
                self._sparse_update(p, hyper)

    def _cpu_fusable(self, param: torch.Tensor) -> bool:
        """Whether torch's fused CPU Adagrad kernel can update ``param`` (one memory pass)."""
        grad, state = param.grad, self.state[param]
        tensors = (param, grad, state["exp_avg_sq"])
        return (
            param.dtype in _FUSED_DTYPES
            and all(t is not None and t.device.type == "cpu" and t.is_contiguous() for t in tensors)
            and all(t is not None and t.dtype == param.dtype for t in tensors)
            and torch.is_tensor(state["step"])
            and state["step"].device.type == "cpu"
        )

    def _fused_update(self, params: list[torch.Tensor], hyper: dict[str, float]) -> None:
        # lr_decay=0 makes the kernel's lr / (1 + (step - 1) * lr_decay) exactly lr; the
        # kernel adds weight decay to a copy of the gradient, leaving p.grad as it was
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            by_dtype.setdefault(p.dtype, []).append(p)
        for group in by_dtype.values():
            torch._fused_adagrad_(
                group,
                [p.grad for p in group if p.grad is not None],  # all have one (_cpu_fusable)
                [self.state[p]["exp_avg_sq"] for p in group],
                [self.state[p]["step"] for p in group],
                lr=hyper["lr"],
                lr_decay=0.0,
                weight_decay=hyper["weight_decay"],
                eps=hyper["eps"],
                maximize=False,
            )

    def _sparse_update(self, param: torch.Tensor, hyper: dict[str, float]) -> None:
        # duplicate indices (e.g. a token seen twice in a batch) must be summed first
        grad = param.grad.coalesce()  # type: ignore[union-attr]
        index = tuple(grad.indices())
        want = compute_dtype(param.dtype)
        state = self.state[param]["exp_avg_sq"]
        rows_p = param[index].to(want)
        rows_v = state[index].to(want)
        adagrad_update([rows_p], [grad.values().to(want)], [rows_v], **hyper)
        param[index] = rows_p.to(param.dtype)
        state[index] = rows_v.to(state.dtype)
