"""1-bit Adam (https://arxiv.org/abs/2102.02888): Adam until ``freeze_step``, then the variance
is frozen and the momentum is averaged with error-compensated 1-bit compression."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from shardspeed.runtime.fp16.onebit.base import OnebitOptimizer, check_positive_int


def adam_update(
    param: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    group: dict[str, Any],
    step: int,
    var_steps: int,
    eps_inside_sqrt: bool,
) -> None:
    """``param -= lr * m_hat / (sqrt(v_hat) + eps)`` with decoupled weight decay (AdamW), in
    torch.optim.AdamW's operation order; ``v`` is bias-corrected for ``var_steps`` updates."""
    beta1, beta2 = group["betas"]
    lr, decay, eps = group["lr"], group["weight_decay"], group["eps"]
    if decay != 0.0:
        param.mul_(1.0 - lr * decay)
    correct = bool(group["bias_correction"])
    step_size = lr / (1.0 - beta1**step) if correct else lr
    bc2 = (1.0 - beta2**var_steps) if correct else 1.0
    param.addcdiv_(exp_avg, adam_denom(exp_avg_sq, bc2, eps, eps_inside_sqrt), value=-step_size)


def adam_denom(
    exp_avg_sq: torch.Tensor, bc2: float, eps: float, eps_inside_sqrt: bool
) -> torch.Tensor:
    """Adam's denominator, ``sqrt(v / bc2 + eps)`` or ``sqrt(v) / sqrt(bc2) + eps``."""
    if eps_inside_sqrt:
        return (exp_avg_sq / bc2).add_(eps).sqrt_()
    return (exp_avg_sq.sqrt() / bc2**0.5).add_(eps)


class OnebitAdam(OnebitOptimizer):
    """1-bit Adam. Before ``freeze_step`` steps: Adam on gradients the engine all-reduced
    (equal to ``torch.optim.AdamW`` step for step). From then on the engine leaves the
    gradients local; each rank updates its momentum with them and the momenta are averaged by
    :meth:`~shardspeed.runtime.comm.compressed.CompressedBackend.compressed_allreduce` (1 bit per
    element); the variance stays frozen. ``comm_backend_name`` ("nccl", "mpi", "compressed")
    and ``cuda_aware`` are accepted; all run the same torch collectives. A parameter group with
    ``"non_freeze": True`` keeps full-precision gradient averaging; ``"exp_avg_mask"`` zeroes
    momentum elements after each exchange (DeepSpeed's group keys)."""

    def __init__(
        self,
        params: Iterable[Any],
        deepspeed: Any = None,
        lr: float = 1e-3,
        freeze_step: int = 100000,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
    ) -> None:
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            max_grad_norm=max_grad_norm,
        )
        super().__init__(
            params,
            defaults,
            deepspeed=deepspeed,
            amsgrad=amsgrad,
            cuda_aware=cuda_aware,
            comm_backend_name=comm_backend_name,
            eps_inside_sqrt=eps_inside_sqrt,
        )
        self.freeze_step = check_positive_int(type(self).__name__, "freeze_step", freeze_step)
        #: DeepSpeed's flag: True once the compressed stage has begun
        self.adam_freeze_key = False

    @property
    def needs_gradient_allreduce(self) -> bool:
        return not self.adam_freeze_key

    def extra_state(self) -> dict[str, Any]:
        return {"adam_freeze_key": self.adam_freeze_key}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.adam_freeze_key = bool(state["adam_freeze_key"])

    def _update(self, group: dict[str, Any], param: torch.Tensor) -> None:
        state = self.state[param]
        adam_update(
            param,
            state["exp_avg"],
            state["exp_avg_sq"],
            group,
            state["step"],
            state["var_steps"],
            self.eps_mode == 0,
        )

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One update from the parameters' ``.grad`` (all-reduced before the freeze, local
        after it)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        frozen, last_step, numel = self.adam_freeze_key, 0, 0
        # compressed momenta wait for one batched exchange (4 collectives per step in all)
        pending: list[tuple[dict[str, Any], torch.Tensor, torch.Tensor]] = []
        for group, param in self.params_with_grads():
            grad = param.grad
            assert grad is not None
            if grad.is_sparse:
                raise TypeError("OnebitAdam does not support sparse gradients")
            state = self.state[param]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(param)
                state["exp_avg_sq"] = torch.zeros_like(param)
            state["step"] += 1
            exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
            beta1, beta2 = group["betas"]
            if not frozen or group.get("non_freeze", False):
                if frozen:  # the engine no longer averages gradients: do it here
                    grad = grad.clone()
                    self.average_grad(grad)
                exp_avg.lerp_(grad, 1.0 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
                state["var_steps"] = state["step"]
            else:
                exp_avg.lerp_(grad, 1.0 - beta1)
                pending.append((group, param, exp_avg))
                last_step, numel = state["step"], numel + param.numel()
                continue
            self._update(group, param)
            last_step, numel = state["step"], numel + param.numel()
        self.exchange(pending)
        for group, param, _ in pending:
            self._update(group, param)
        if not frozen and last_step >= self.freeze_step:
            self.adam_freeze_key = True
            self.announce_freeze(numel)
        return loss
