"""How gradients are averaged across a shard group: DeepSpeed's knobs and the arithmetic they
imply, shared by every kind of shard group."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardspeed.runtime.precision.policy import PrecisionPolicy


@dataclass(frozen=True)
class GradReduceOptions:
    """How gradients are averaged across the data-parallel group (DeepSpeed's knobs)."""

    #: ``gradient_allreduce_op``: "mean" averages over the ranks, "sum" keeps the plain sum
    allreduce_op: str = "mean"
    prescale_gradients: bool = False
    gradient_predivide_factor: float = 1.0
    communication_data_type: torch.dtype | None = None
    bucket_size: int = 500_000_000
    overlap_comm: bool = True

    def scale_factors(self, world: int) -> tuple[float, float]:
        """(factor before, factor after) the sum-reduction over ``world`` ranks: prescaling
        divides by the world size up front; otherwise divide by ``gradient_predivide_factor``
        before and by ``world / predivide`` after. With ``allreduce_op="sum"`` the two factors
        multiply to 1 (the predivide split, if any, still keeps fp16 sums in range)."""
        if self.allreduce_op == "sum":
            predivide = 1.0 if self.prescale_gradients else self.gradient_predivide_factor
            return 1.0 / predivide, predivide
        if self.prescale_gradients:
            return 1.0 / world, 1.0
        predivide = self.gradient_predivide_factor
        return 1.0 / predivide, predivide / world

    def unscale_factor(self, world: int) -> float:
        """What a reduced result over ``world`` ranks is multiplied by to give the plain sum
        again (the inverse of the product of :meth:`scale_factors`)."""
        return 1.0 if self.allreduce_op == "sum" else float(world)


def comm_source(
    buffer: torch.Tensor, comm_dtype: torch.dtype | None, pre_scale: float
) -> torch.Tensor:
    """What to send for ``buffer``: cast to ``comm_dtype`` if one is set (a copy), then
    multiplied by the pre-reduction factor in place."""
    if comm_dtype is not None and comm_dtype != buffer.dtype:
        buffer = buffer.to(comm_dtype)
    if pre_scale != 1.0:
        buffer.mul_(pre_scale)
    return buffer


def scale_grads_(grads: list[torch.Tensor], coef: torch.Tensor) -> None:
    """Multiply every gradient in ``grads`` by the 0-dim ``coef`` in place (clipping)."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for grad in grads:  # offloaded masters' gradients sit in host memory
        by_device.setdefault(grad.device, []).append(grad)
    for device, on_device in by_device.items():
        torch._foreach_mul_(on_device, coef.to(device))


def accumulation_dtype(
    policy: PrecisionPolicy, requested: torch.dtype | None, default: torch.dtype
) -> torch.dtype:
    """``data_types.grad_accum_dtype`` if given (``requested``), else ``default``; it must be
    the model's dtype or the fp32 master dtype."""
    chosen = requested or default
    allowed = {policy.param_dtype, policy.master_dtype}
    if chosen not in allowed:
        names = " or ".join(sorted(str(d).removeprefix("torch.") for d in allowed))
        raise ValueError(
            f"data_types.grad_accum_dtype={str(chosen).removeprefix('torch.')} is not "
            f"supported with this precision setup; use {names}"
        )
    return chosen
