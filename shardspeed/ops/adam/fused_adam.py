"""``FusedAdam``: DeepSpeed's multi-tensor Adam/AdamW, on PyTorch's fused and foreach kernels."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from shardspeed.ops.adam.adam_base import AdamBase


class FusedAdam(AdamBase):
    """Adam (``adam_w_mode=False``) or AdamW (``adam_w_mode=True``, default) over whole groups.

    A drop-in for ``torch.optim.AdamW``, or for ``torch.optim.Adam`` with ``adam_w_mode=False``;
    with ``bias_correction=True`` the update is theirs exactly (see
    :mod:`shardspeed.ops.adam.adam_base` for the formula). On CUDA, groups whose parameters,
    gradients and state share a dtype use torch's fused Adam kernel (``fused=True``); everything
    else uses ``torch._foreach_*`` kernels, so unlike DeepSpeed's it also runs on CPU.

    Args:
        params: iterable of parameters or dicts defining parameter groups.
        lr: learning rate. (default: 1e-3)
        bias_correction: divide the moments by ``1 - beta^t``. (default: True)
        betas: coefficients of the running averages of the gradient and its square.
        eps: term added to the denominator for numerical stability. (default: 1e-8)
        adam_w_mode: True for decoupled weight decay (AdamW), False for an L2 penalty added to
            the gradient (Adam). (default: True)
        weight_decay: weight decay coefficient. (default: 0)
        amsgrad: not supported; True raises ``ValueError``.
        set_grad_none: ``zero_grad()`` sets gradients to None instead of zeroing them.

    Optimizer state follows the parameter dtype (as DeepSpeed's kernel does); fp16/bf16 values
    are computed in fp32 and rounded on store.
    """

    _name = "FusedAdam"

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ) -> None:
        super().__init__(
            params,
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            adam_w_mode=adam_w_mode,
        )
        self.set_grad_none = set_grad_none
