"""``DeepSpeedCPUAdam``: Adam/AdamW for fp32 master weights held in CPU memory (ZeRO-Offload)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from shardspeed.ops.adam.adam_base import AdamBase
from shardspeed.ops.multi_tensor import compute_dtype


class DeepSpeedCPUAdam(AdamBase):
    """Vectorised Adam (``adamw_mode=False``) or AdamW (``adamw_mode=True``, default).

    DeepSpeed ships a hand-written SIMD kernel for this; shardspeed runs the same update (see
    :mod:`shardspeed.ops.adam.adam_base`) on CPU tensors with PyTorch's fused CPU Adam kernel,
    one vectorised, multi-threaded pass over memory (:mod:`shardspeed.ops.adam.cpu_fused`;
    fp16/bf16 parameters with fp32 moments go through it chunk by chunk), and elsewhere with
    ``torch._foreach_*`` kernels. ZeRO-Offload uses it on the CPU copy of the fp32 master
    parameters.

    Args:
        model_params: iterable of parameters or dicts defining parameter groups.
        lr: learning rate. (default: 1e-3)
        bias_correction: divide the moments by ``1 - beta^t``. (default: True)
        betas: coefficients of the running averages of the gradient and its square.
        eps: term added to the denominator for numerical stability. (default: 1e-8)
        weight_decay: weight decay coefficient (decoupled in AdamW mode, L2 in Adam mode).
        amsgrad: not supported; True raises ``ValueError``.
        adamw_mode: select AdamW (True, default) or Adam (False).
        fp32_optimizer_states: keep momentum and variance in fp32 even for fp16/bf16 parameters
            (default). False keeps them in the parameter dtype, halving their memory.
    """

    _name = "DeepSpeedCPUAdam"

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
    ) -> None:
        super().__init__(
            model_params,
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            adam_w_mode=adamw_mode,
        )
        self.fp32_optimizer_states = fp32_optimizer_states

    @property
    def adamw_mode(self) -> bool:
        """DeepSpeed's name for this class's ``adam_w_mode`` (one flag, two spellings)."""
        return self.adam_w_mode

    @adamw_mode.setter
    def adamw_mode(self, value: bool) -> None:
        self.adam_w_mode = value

    def _state_dtype(self, param: torch.Tensor) -> torch.dtype:
        # "fp32" means at least fp32: fp64 parameters keep fp64 state
        return compute_dtype(param.dtype) if self.fp32_optimizer_states else param.dtype
