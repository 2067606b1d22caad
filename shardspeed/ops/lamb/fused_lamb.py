"""``FusedLamb``: DeepSpeed's LAMB optimizer on PyTorch's multi-tensor kernels."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from shardspeed.ops.multi_tensor import (
    MultiTensorOptimizer,
    WorkList,
    check_betas,
    check_non_negative,
    grads_in,
    reject_amsgrad,
    step_tensor,
)


class FusedLamb(MultiTensorOptimizer):
    """LAMB (https://arxiv.org/abs/1904.00962) with DeepSpeed's trust-ratio clamp.

    Per step, first the global gradient norm over every parameter with a gradient (all groups)::

        N = sqrt(sum_p ||g_p||^2)
        if max_grad_norm > 0 and (N + 1e-6) / max_grad_norm > 1:   g <- g / ((N + 1e-6) / max_grad_norm)

    then, per parameter tensor ``p`` at step ``t`` (bias corrections are 1 when
    ``bias_correction=False``)::

        m <- beta1 * m + (1 - beta1) * g
        v <- beta2 * v + (1 - beta2) * g * g
        m_hat = m / (1 - beta1^t),   v_hat = v / (1 - beta2^t)
        u = m_hat / sqrt(v_hat + eps)      if eps_inside_sqrt
        u = m_hat / (sqrt(v_hat) + eps)    otherwise
        u <- u + weight_decay * p
        r = clamp(||p|| / ||u||, min_coeff, max_coeff)   if ||p|| > 0 and ||u|| > 0, else r = 1
        p <- p - lr * r * u

    The trust ratios ``r`` of the last step are available from :meth:`get_lamb_coeffs`.

    Args:
        params: iterable of parameters or dicts defining parameter groups.
        lr: learning rate. (default: 1e-3)
        bias_correction: bias-correct the moments. (default: True)
        betas: coefficients of the running averages of the gradient and its square.
        eps: term added to the denominator for numerical stability. (default: 1e-8)
        eps_inside_sqrt: add ``eps`` to ``v_hat`` before the square root. (default: False)
        weight_decay: weight decay coefficient, added to the update. (default: 0)
        max_grad_norm: clip the global gradient norm to this value; 0 disables. (default: 0)
        max_coeff: upper bound of the trust ratio. (default: 10.0)
        min_coeff: lower bound of the trust ratio. (default: 0.01)
        amsgrad: not supported; True raises ``ValueError``.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
    ) -> None:
        reject_amsgrad("FusedLamb", amsgrad)
        betas = check_betas("FusedLamb", betas)
        check_non_negative(
            "FusedLamb",
            lr=lr,
            eps=eps,
            weight_decay=weight_decay,
            max_grad_norm=max_grad_norm,
            min_coeff=min_coeff,
        )
        if max_coeff < min_coeff:
            raise ValueError(
                f"FusedLamb: max_coeff ({max_coeff}) must be >= min_coeff ({min_coeff})"
            )
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            max_grad_norm=max_grad_norm,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
        )
        super().__init__(params, defaults)
        self.eps_mode = 0 if eps_inside_sqrt else 1  # DeepSpeed's attribute: 0 = eps under sqrt
        self.lamb_coeffs: list[float] = []

    def _init_state(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        return {
            "step": step_tensor(),
            "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
        }

    def get_lamb_coeffs(self) -> list[float]:
        """The trust ratios applied in the last step, one per updated parameter tensor."""
        return list(self.lamb_coeffs)

    def _step_all_groups(self) -> None:
        self.lamb_coeffs = []
        grouped = [(group, self._params_with_grad(group)) for group in self.param_groups]
        all_params = [p for _, params in grouped for p in params]
        if not all_params:
            return
        self._global_norm = self._grad_norm(all_params)
        for group, params in grouped:
            if params:
                self._update_group(group, params)

    @staticmethod
    def _grad_norm(params: list[torch.Tensor]) -> float:
        norms = torch._foreach_norm(grads_in(params))
        # one host sync per step, needed anyway to decide whether to clip
        return float(torch.linalg.vector_norm(torch.stack([n.float().cpu() for n in norms])))

    def _update_group(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        states = [self.state[p] for p in params]
        for state in states:
            state["step"] += 1
        beta1, beta2 = group["betas"]
        lr, eps, decay = float(group["lr"]), group["eps"], group["weight_decay"]

        grads = grads_in(params)
        max_norm = group["max_grad_norm"]
        if max_norm > 0:
            clip = (self._global_norm + 1e-6) / max_norm
            if clip > 1.0:
                grads = list(torch._foreach_div(grads, clip))

        p_work = WorkList(params)
        m_work = WorkList([s["exp_avg"] for s in states], like=params)
        v_work = WorkList([s["exp_avg_sq"] for s in states], like=params)
        w, m, v = p_work.work, m_work.work, v_work.work
        torch._foreach_lerp_(m, grads, 1.0 - beta1)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, grads, grads, 1.0 - beta2)

        steps = [float(s["step"]) for s in states]
        if group["bias_correction"]:
            m_hat = list(torch._foreach_div(m, [1.0 - beta1**t for t in steps]))
            v_hat = list(torch._foreach_div(v, [1.0 - beta2**t for t in steps]))
        else:
            m_hat, v_hat = m, v
        if self.eps_mode == 0:
            denom = torch._foreach_sqrt(torch._foreach_add(v_hat, eps))
        else:
            denom = torch._foreach_add(torch._foreach_sqrt(v_hat), eps)
        update = list(torch._foreach_div(m_hat, denom))
        if decay != 0.0:
            torch._foreach_add_(update, w, alpha=decay)

        coeffs = self._trust_ratios(w, update, group["min_coeff"], group["max_coeff"])
        self.lamb_coeffs.extend(coeffs)
        torch._foreach_mul_(update, [-lr * c for c in coeffs])
        torch._foreach_add_(w, update)
        for work in (p_work, m_work, v_work):
            work.write_back()

    @staticmethod
    def _trust_ratios(
        weights: list[torch.Tensor], updates: list[torch.Tensor], lo: float, hi: float
    ) -> list[float]:
        w_norm = torch.stack([n.cpu() for n in torch._foreach_norm(weights)]).double()
        u_norm = torch.stack([n.cpu() for n in torch._foreach_norm(updates)]).double()
        ratio = (w_norm / u_norm).clamp(lo, hi)
        both = (w_norm > 0) & (u_norm > 0)
        return torch.where(both, ratio, torch.ones_like(ratio)).tolist()
