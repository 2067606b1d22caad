"""1-bit LAMB (https://arxiv.org/abs/2104.06069): LAMB until ``freeze_step`` (recording a
running average of each parameter's trust ratio), then the variance and the trust ratios are
frozen and the momentum of all parameters, as one flat buffer, is averaged with
error-compensated 1-bit compression. The frozen trust ratio is rescaled each step by how far a
"fresh" variance, rebuilt from the reconstructed gradients, has drifted from the frozen one."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from shardspeed.runtime.fp16.onebit.base import (
    OnebitConfigError,
    OnebitOptimizer,
    check_positive_int,
    check_range,
)

_PER_PARAM = ("lamb_coeff_freeze", "last_factor", "scaling_coeff")


def _trust_ratio(weight: torch.Tensor, update: torch.Tensor, lo: float, hi: float) -> float:
    """``clamp(||w|| / ||u||, lo, hi)``, 1 when either norm is zero (as FusedLamb)."""
    w_norm = float(torch.linalg.vector_norm(weight).double())
    u_norm = float(torch.linalg.vector_norm(update).double())
    if w_norm > 0 and u_norm > 0:
        return min(max(w_norm / u_norm, lo), hi)
    return 1.0


class OnebitLamb(OnebitOptimizer):
    """1-bit LAMB. Before the freeze it equals :class:`~shardspeed.ops.lamb.FusedLamb` step for
    step (gradients all-reduced by the engine). ``coeff_beta`` is the running average's factor
    for the trust ratios; in the compressed stage the frozen ratio is scaled by a factor clamped
    to ``[factor_min, factor_max]`` and to ``1 +/- factor_threshold`` of the previous step's.
    ``comm_backend_name`` and ``cuda_aware`` are accepted; all run the same torch collectives."""

    rank_local_keys = ("worker_error", "server_error", *_PER_PARAM)

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
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
        coeff_beta: float = 0.9,
        factor_max: float = 4.0,
        factor_min: float = 0.5,
        factor_threshold: float = 0.1,
    ) -> None:
        owner = type(self).__name__
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
        check_range(owner, "min_coeff", min_coeff, 0.0, float("inf"))
        if check_range(owner, "max_coeff", max_coeff, 0.0, float("inf")) < min_coeff:
            raise OnebitConfigError(f"{owner}: max_coeff={max_coeff} must be >= min_coeff")
        self.coeff_beta = check_range(owner, "coeff_beta", coeff_beta, 0.0, 0.999999)
        self.factor_min = check_range(owner, "factor_min", factor_min, 0.0, float("inf"))
        self.factor_max = check_range(owner, "factor_max", factor_max, 0.0, float("inf"))
        if self.factor_max < self.factor_min:
            raise OnebitConfigError(f"{owner}: factor_max={factor_max} must be >= factor_min")
        self.factor_threshold = check_range(owner, "factor_threshold", factor_threshold, 0.0, 1.0)
        super().__init__(
            params,
            defaults,
            deepspeed=deepspeed,
            amsgrad=amsgrad,
            cuda_aware=cuda_aware,
            comm_backend_name=comm_backend_name,
            eps_inside_sqrt=eps_inside_sqrt,
        )
        self.freeze_step = check_positive_int(owner, "freeze_step", freeze_step)
        #: DeepSpeed's flag: True once the compressed stage has begun
        self.lamb_freeze_key = False
        self.lamb_coeffs: list[float] = []

    @property
    def needs_gradient_allreduce(self) -> bool:
        return not self.lamb_freeze_key

    def get_lamb_coeffs(self) -> list[float]:
        """The trust ratios of the last step."""
        return list(self.lamb_coeffs)

    def extra_state(self) -> dict[str, Any]:
        return {"lamb_freeze_key": self.lamb_freeze_key}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.lamb_freeze_key = bool(state["lamb_freeze_key"])

    def _denom(self, v: torch.Tensor, bc2: float, eps: float) -> torch.Tensor:
        v_hat = v / bc2
        if self.eps_mode == 0:
            return v_hat.add_(eps).sqrt_()
        return v_hat.sqrt_().add_(eps)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One update from the parameters' ``.grad`` (all-reduced before the freeze, local
        after it)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.lamb_coeffs = []
        items = self.params_with_grads()
        if not items:
            return loss
        for _, param in items:
            state = self.state[param]
            if "step" not in state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(param)
                state["exp_avg_sq"] = torch.zeros_like(param)
                state["lamb_coeff_freeze"] = 0.0
                state["last_factor"] = 1.0
            state["step"] += 1
        if self.lamb_freeze_key:
            self._compressed_step(items)
        else:
            for group, param in items:
                self._warmup_update(group, param)
            if self.state[items[-1][1]]["step"] >= self.freeze_step:
                self.lamb_freeze_key = True
                self.announce_freeze(sum(p.numel() for _, p in items))
        return loss

    def _warmup_update(self, group: dict[str, Any], param: torch.Tensor) -> None:
        state, grad = self.state[param], param.grad
        assert grad is not None
        beta1, beta2 = group["betas"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.lerp_(grad, 1.0 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        if state["step"] == self.freeze_step:
            state["exp_avg_sq_fresh"] = v.clone()
        update = self._update(group, param, m, v, state["step"], state["step"])
        coeff = _trust_ratio(param, update, group["min_coeff"], group["max_coeff"])
        if coeff != 1.0:
            state["lamb_coeff_freeze"] = (
                self.coeff_beta * state["lamb_coeff_freeze"] + (1.0 - self.coeff_beta) * coeff
            )
        self.lamb_coeffs.append(coeff)
        param.add_(update.mul_(-float(group["lr"]) * coeff))

    def _update(
        self,
        group: dict[str, Any],
        param: torch.Tensor,
        m: torch.Tensor,
        v: torch.Tensor,
        step: int,
        var_steps: int,
    ) -> torch.Tensor:
        """``m_hat / denom + weight_decay * p`` (bias corrections 1 without bias_correction)."""
        beta1, beta2 = group["betas"]
        correct = bool(group["bias_correction"])
        m_hat = m / (1.0 - beta1**step) if correct else m
        bc2 = (1.0 - beta2**var_steps) if correct else 1.0
        update = m_hat / self._denom(v, bc2, group["eps"])
        if group["weight_decay"] != 0.0:
            update.add_(param, alpha=group["weight_decay"])
        return update

    def _scaling_coeffs(self, items: list[tuple[dict[str, Any], torch.Tensor]]) -> None:
        """Per-parameter factors that bring every momentum to the same RMS before the flat
        exchange (one scale serves them all), fixed at the first compressed step."""
        rms = [
            float(torch.linalg.vector_norm(self.state[p]["exp_avg"])) / math.sqrt(p.numel())
            for _, p in items
        ]
        united = sum(rms) / len(rms)
        for (_, param), value in zip(items, rms, strict=True):
            self.state[param]["scaling_coeff"] = united / value if value > 0 else 1.0

    def _compressed_step(self, items: list[tuple[dict[str, Any], torch.Tensor]]) -> None:
        if "scaling_coeff" not in self.state[items[0][1]]:
            self._scaling_coeffs(items)
        last = []
        for group, param in items:
            state = self.state[param]
            last.append(state["exp_avg"].clone())
            state["exp_avg"].lerp_(param.grad, 1.0 - group["betas"][0])
            state["exp_avg"].mul_(state["scaling_coeff"])
        momenta = [self.state[p]["exp_avg"] for _, p in items]
        first = self.state[items[0][1]]
        if "worker_error" not in first:
            self.error_buffers(first, sum(m.numel() for m in momenta), momenta[0].device)
        if self.size > 1:
            flat = torch.cat([m.reshape(-1).float() for m in momenta])
            self.backend.compressed_allreduce(flat, first["worker_error"], first["server_error"])
            for m, piece in zip(momenta, flat.split([m.numel() for m in momenta]), strict=True):
                m.copy_(piece.view_as(m))
        for (group, param), m_last in zip(items, last, strict=True):
            self._frozen_update(group, param, m_last)

    def _frozen_update(
        self, group: dict[str, Any], param: torch.Tensor, m_last: torch.Tensor
    ) -> None:
        state = self.state[param]
        beta1, beta2 = group["betas"]
        m, v, fresh = state["exp_avg"], state["exp_avg_sq"], state["exp_avg_sq_fresh"]
        m.div_(state["scaling_coeff"])
        if "exp_avg_mask" in group:
            m.mul_(group["exp_avg_mask"].to(m.device))
        # the averaged gradient this momentum step implies, for the fresh variance
        grad = (m - m_last * beta1) / (1.0 - beta1)
        fresh.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        bc2 = (1.0 - beta2**self.freeze_step) if group["bias_correction"] else 1.0
        prelim = self._update(group, param, m, v, state["step"], self.freeze_step)
        update = prelim
        if group["weight_decay"] != 0.0:
            prelim = prelim - param * group["weight_decay"]
        eps = group["eps"]
        factor = float((self._denom(v, bc2, eps) / self._denom(fresh, bc2, eps)).max())
        if group["weight_decay"] != 0.0:
            norm = float(torch.linalg.vector_norm(update))
            ratio = min(1.0, float(torch.linalg.vector_norm(prelim)) / norm) if norm else 1.0
            factor = factor * ratio + (1.0 - ratio)
        factor = min(max(factor, self.factor_min), self.factor_max)
        last_factor = state["last_factor"]
        factor = min(factor, last_factor * (1.0 + self.factor_threshold))
        factor = max(factor, last_factor * (1.0 - self.factor_threshold))
        state["last_factor"] = factor
        coeff = state["lamb_coeff_freeze"] * factor
        self.lamb_coeffs.append(coeff)
        param.add_(update, alpha=-float(group["lr"]) * coeff)
