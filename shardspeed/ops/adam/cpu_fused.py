"""Adam(W) on CPU tensors with PyTorch's fused CPU kernel: one pass over memory per tensor.

``torch._fused_adam_`` / ``torch._fused_adamw_`` read the parameter, gradient and both moments
once and write the parameter and moments once (~28 bytes per fp32 parameter), vectorised and
split across the intra-op threads: the memory-bandwidth bound, where the ``torch._foreach_*``
update makes about ten passes. It computes the update of :mod:`shardspeed.ops.adam.adam_base`
(operation order may differ in the last bit) and leaves gradients untouched.

Two cases the kernel does not cover directly are mapped onto it exactly:

- ``bias_correction=False``: the kernel always divides by ``1 - beta^t``; a step of +inf makes
  ``beta^t`` exactly 0 for every beta in [0, 1), so both corrections are exactly 1.
- fp16/bf16 parameters with fp32 moments (``fp32_optimizer_states``): the kernel wants one
  dtype, so the parameter and gradient are upcast block by block into small per-thread fp32
  buffers that stay in cache, updated there with the fp32 moments, and the parameter block
  written back (blocks run on worker threads: :mod:`shardspeed.ops.cpu_blocks`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from shardspeed.ops import cpu_blocks
from shardspeed.ops.cpu_blocks import Block, flat_blocks, run_blocks

__all__ = ["cpu_fusable", "fused_adam_cpu"]

_FUSED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def cpu_fusable(param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> bool:
    """Whether the fused CPU kernel can update ``param`` (its ``.grad`` set) exactly."""
    grad = param.grad
    if grad is None or grad.is_sparse or param.dtype not in _FUSED_DTYPES:
        return False
    tensors = (param, grad, exp_avg, exp_avg_sq)
    if not all(t.device.type == "cpu" and t.is_contiguous() for t in tensors):
        return False
    if grad.dtype != param.dtype or exp_avg.dtype != exp_avg_sq.dtype:
        return False
    state_dtype = exp_avg.dtype
    return state_dtype == param.dtype or (
        param.dtype in _LOW_PRECISION and state_dtype == torch.float32
    )


def fused_adam_cpu(
    params: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adam_w_mode: bool,
    bias_correction: bool,
) -> None:
    """One Adam(W) update, in place, of CPU tensors that pass :func:`cpu_fusable`.

    ``steps`` are the 0-d float step tensors, already counting this update.
    """
    kernel = torch._fused_adamw_ if adam_w_mode else torch._fused_adam_
    if not bias_correction:
        steps = [torch.full((), float("inf"))] * len(params)

    def call(
        ps: list[torch.Tensor],
        gs: list[torch.Tensor],
        ms: list[torch.Tensor],
        vs: list[torch.Tensor],
        ts: list[torch.Tensor],
    ) -> None:
        kernel(
            ps,
            gs,
            ms,
            vs,
            [],
            ts,
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            weight_decay=weight_decay,
            eps=eps,
            amsgrad=False,
            maximize=False,
        )

    same = [i for i, (p, m) in enumerate(zip(params, exp_avgs, strict=True)) if p.dtype == m.dtype]
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i in same:
        by_dtype.setdefault(params[i].dtype, []).append(i)
    for index in by_dtype.values():
        call(
            [params[i] for i in index],
            [_grad(params[i]) for i in index],
            [exp_avgs[i] for i in index],
            [exp_avg_sqs[i] for i in index],
            [steps[i] for i in index],
        )
    upcast = [i for i in range(len(params)) if params[i].dtype != exp_avgs[i].dtype]
    if not upcast:
        return
    rows = [(params[i], _grad(params[i]), exp_avgs[i], exp_avg_sqs[i], steps[i]) for i in upcast]

    def update(block: Block) -> None:
        for p, g, m, v, step in block:
            work_p, work_g = _work_buffers(p.numel())
            work_p.copy_(p)
            work_g.copy_(g)
            call([work_p], [work_g], [m], [v], [step])
            p.copy_(work_p)

    run_blocks(flat_blocks(rows), update)


_scratch = threading.local()


def _work_buffers(numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This thread's two fp32 buffers, cut to ``numel`` elements (kept: no page faults)."""
    buffers: tuple[torch.Tensor, torch.Tensor] | None = getattr(_scratch, "buffers", None)
    if buffers is None or buffers[0].numel() < numel:
        size = max(numel, cpu_blocks.BLOCK_NUMEL)
        buffers = (torch.empty(size), torch.empty(size))
        _scratch.buffers = buffers
    return buffers[0][:numel], buffers[1][:numel]


def _grad(param: torch.Tensor) -> torch.Tensor:
    assert param.grad is not None  # cpu_fusable checked it
    return param.grad
