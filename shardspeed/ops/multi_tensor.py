"""Shared machinery of shardspeed's optimizers: a ``torch.optim.Optimizer`` base and fp32 work lists.

Every optimizer in ``shardspeed.ops`` updates a whole parameter group at once with PyTorch's
multi-tensor (``torch._foreach_*``) kernels, or with PyTorch's own fused kernels where those
compute exactly the same update. Low-precision tensors (fp16/bf16 parameters, or optimizer
state kept in the parameter dtype) are upcast to fp32 for the arithmetic and written back, which
is what DeepSpeed's native kernels do in registers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the update is computed in for tensors stored as ``dtype`` (fp32 for fp16/bf16)."""
    return torch.float32 if dtype in _LOW_PRECISION else dtype


class WorkList:
    """Tensors as the update arithmetic sees them: in their compute dtype, upcast where needed.

    The compute dtype of ``stored[i]`` is that of ``like[i]`` (its parameter; default: itself).
    ``work[i]`` is ``stored[i]`` itself when the dtypes agree (updated in place), otherwise an
    fp32 copy; :meth:`write_back` copies the changed copies into the stored tensors.
    """

    def __init__(
        self, stored: Sequence[torch.Tensor], like: Sequence[torch.Tensor] | None = None
    ) -> None:
        self.stored = list(stored)
        targets = [compute_dtype(t.dtype) for t in (self.stored if like is None else like)]
        self.work = [
            t if t.dtype == want else t.to(want)
            for t, want in zip(self.stored, targets, strict=True)
        ]

    def write_back(self) -> None:
        """Copy upcast working tensors back into their (lower precision) storage."""
        for stored, work in zip(self.stored, self.work, strict=True):
            if stored is not work:
                stored.copy_(work)


#: elements per multi-tensor batch: bounds the temporaries of an update (the denominator, fp32
#: copies of low-precision tensors) to ~64 MB of fp32, however large the group
FOREACH_BATCH_NUMEL = 1 << 24


def batches_by_numel(
    tensors: Sequence[torch.Tensor], limit: int = FOREACH_BATCH_NUMEL
) -> list[list[torch.Tensor]]:
    """``tensors`` in order, cut into runs of at most ``limit`` elements (a larger tensor is a
    run of its own). An elementwise update run batch by batch computes exactly what it computes
    over the whole list, with temporaries the size of one batch."""
    batches: list[list[torch.Tensor]] = []
    size = 0
    for tensor in tensors:
        if not batches or size + tensor.numel() > limit:
            batches.append([])
            size = 0
        batches[-1].append(tensor)
        size += tensor.numel()
    return batches


def grads_in(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients of ``params`` in the dtype each parameter's update is computed in."""
    out = []
    for p in params:
        assert p.grad is not None  # callers pass only parameters that have gradients
        grad = p.grad
        if grad.is_sparse:
            raise ValueError(
                f"sparse gradients are not supported by this optimizer (param shape "
                f"{tuple(p.shape)}); use DeepSpeedCPUAdagrad or torch.optim.SparseAdam"
            )
        want = compute_dtype(p.dtype)
        out.append(grad if grad.dtype == want else grad.to(want))
    return out


def check_betas(name: str, betas: Sequence[float]) -> tuple[float, float]:
    """Validate ``betas`` as two coefficients in [0, 1) and return them as a tuple."""
    if len(betas) != 2 or not all(0.0 <= float(b) < 1.0 for b in betas):
        raise ValueError(f"{name}: betas must be two values in [0, 1), got {tuple(betas)}")
    return float(betas[0]), float(betas[1])


def check_non_negative(name: str, **values: float) -> None:
    """Raise ``ValueError`` naming the first negative hyperparameter in ``values``."""
    for key, value in values.items():
        if value < 0.0:
            raise ValueError(f"{name}: {key} must be >= 0, got {value}")


def reject_amsgrad(name: str, amsgrad: bool) -> None:
    """DeepSpeed's fused and CPU optimizers have no AMSGrad variant; say so instead of ignoring it."""
    if amsgrad:
        raise ValueError(
            f"{name}: amsgrad=True is not supported (DeepSpeed's {name} has no AMSGrad variant); "
            "use torch.optim.Adam(amsgrad=True) as a client optimizer instead"
        )


def step_tensor(device: torch.device | None = None) -> torch.Tensor:
    """A fresh step counter, stored as torch's own optimizers store it (0-d float32 tensor)."""
    return torch.zeros((), dtype=torch.float32, device=device)


class MultiTensorOptimizer(torch.optim.Optimizer):
    """Base of shardspeed's optimizers: closure handling, grad selection and ``zero_grad``.

    Subclasses implement :meth:`_init_state` (one parameter's empty state) and
    :meth:`_update_group` (one group's update over the parameters that have gradients).
    """

    set_grad_none: bool = True

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any]) -> None:
        super().__init__(params, defaults)

    def _init_state(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def _update_group(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        raise NotImplementedError

    def _params_with_grad(self, group: dict[str, Any]) -> list[torch.Tensor]:
        """Parameters of ``group`` that have a gradient, their state created on first sight."""
        params = [p for p in group["params"] if p.grad is not None]
        for p in params:
            if len(self.state[p]) == 0:
                self.state[p].update(self._init_state(p, group))
        return params

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Apply one update to every parameter that has a gradient; returns ``closure()``'s loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step_all_groups()
        return loss

    def _step_all_groups(self) -> None:
        for group in self.param_groups:
            params = self._params_with_grad(group)
            if params:
                self._update_group(group, params)

    def __getstate__(self) -> dict[str, Any]:
        # torch.optim.Optimizer pickles only defaults/state/param_groups; keep the mode flags
        # (adam_w_mode, set_grad_none, fp32_optimizer_states, ...) across copy and pickle too
        public = {k: v for k, v in self.__dict__.items() if not k.startswith("_")}
        return {**public, **super().__getstate__()}

    def zero_grad(self, set_to_none: bool | None = None) -> None:  # type: ignore[override]
        """Clear gradients; ``set_to_none=None`` follows the optimizer's ``set_grad_none``."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)
