"""Weight-only int8: linears and embeddings store int8 weights and fp scales, dequantised on the
fly inside the matmul.

Symmetric quantization per output channel (``q_groups`` 1) or per group of input columns
(``q_groups`` > 1): ``w ≈ q * scale`` with ``q`` in [-127, 127] and fp16 scales. Per-channel
linears on CPU use torch's int8-weight kernel ``aten._weight_int8pack_mm`` (fp32/bf16
activations) for single-row inputs; everything else dequantises the weight to the activation
dtype and runs ``F.linear`` (a transient full-precision copy of one layer's weight). An output
head tied to the input embedding shares the embedding's int8 rows and scales."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardspeed.inference.config import QuantizationConfig, QuantTypeEnum

__all__ = ["Int8Embedding", "Int8Linear", "quantize_int8", "quantize_module"]

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
# aten._weight_int8pack_mm's CPU kernel costs grow linearly with the rows of x (measured on the
# 2-core dev machine, K=512, N=1408: 0.9 ms per row, vs 0.3-1.3 ms for dequantise + F.linear at
# 4-8 rows), so it is used for single-row (batch-1 decode) calls only
_KERNEL_MAX_ROWS = 1
_SMALLEST_SCALE = float(torch.finfo(torch.float16).tiny)  # smallest normal fp16


def quantize_int8(weight: torch.Tensor, groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scales)`` of a 2-D weight: ``q`` int8 (same shape), ``scales`` fp16, (rows,) or
    (rows, groups). Scales are rounded to fp16 before ``q`` is computed, so ``q * scale`` is
    exactly what dequantisation gives; fp16 scales keep the overhead at 2 bytes per row."""
    rows, cols = weight.shape
    if cols % groups:
        raise ValueError(
            f"quant.weight.q_groups={groups} does not divide the {cols} input columns of a "
            "weight; choose a q_groups that divides every hidden size."
        )
    grouped = weight.detach().float().reshape(rows, groups, cols // groups)
    scales = (grouped.abs().amax(dim=-1) / 127.0).clamp(min=_SMALLEST_SCALE).to(torch.float16)
    q = torch.round(grouped / scales.float().unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    return q.reshape(rows, cols), scales.squeeze(-1) if groups == 1 else scales


def _dequantize(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if scales.dim() == 1:
        return q.to(dtype) * scales.to(dtype).unsqueeze(-1)
    rows, cols = q.shape
    groups = scales.shape[1]
    grouped = q.to(dtype).reshape(rows, groups, cols // groups) * scales.to(dtype).unsqueeze(-1)
    return grouped.reshape(rows, cols)


class Int8Linear(nn.Module):
    """A linear whose weight is int8 (``qweight``) with per-channel or per-group ``scales``."""

    qweight: torch.Tensor
    scales: torch.Tensor

    def __init__(
        self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, groups: int = 1) -> Int8Linear:
        q, scales = quantize_int8(linear.weight, groups)
        return cls(q, scales, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qweight, scales = self.qweight, self.scales
        flat = x.reshape(-1, self.in_features)
        if (
            x.device.type == "cpu"
            and scales.dim() == 1
            and x.dtype in _KERNEL_DTYPES
            and flat.shape[0] <= _KERNEL_MAX_ROWS
        ):
            flat = flat.contiguous()
            out = torch.ops.aten._weight_int8pack_mm(flat, qweight, scales.to(x.dtype))
            out = out.reshape(*x.shape[:-1], self.out_features)
            return out if self.bias is None else out + self.bias
        return F.linear(x, _dequantize(qweight, scales, x.dtype), self.bias)

    def extra_repr(self) -> str:
        groups = 1 if self.scales.dim() == 1 else self.scales.shape[1]
        return f"in={self.in_features}, out={self.out_features}, int8, q_groups={groups}"


class Int8Embedding(nn.Module):
    """An embedding table stored as int8 rows with one scale per row."""

    qweight: torch.Tensor
    scales: torch.Tensor

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(ids, self.qweight).to(self.dtype)
        return rows * F.embedding(ids, self.scales.unsqueeze(-1)).to(self.dtype)


def quantize_module(model: nn.Module, config: QuantizationConfig) -> None:
    """Replace every ``nn.Linear`` and ``nn.Embedding`` under ``model`` with its int8 version."""
    weight = config.weight
    if weight.num_bits != 8:
        raise ValueError(
            f"quant.weight.num_bits={weight.num_bits}: only 8-bit weights are supported"
        )
    if weight.q_type != QuantTypeEnum.sym:
        raise ValueError("quant.weight.q_type='asymmetric' is not supported; use 'symmetric'")
    shared: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(weight) -> (q, scales)
    modules = list(model.named_modules())
    for name, module in modules:  # embeddings first, so a tied head finds their rows
        if isinstance(module, nn.Embedding):
            if id(module.weight) not in shared:
                shared[id(module.weight)] = quantize_int8(module.weight)
            _replace(model, name, Int8Embedding(*shared[id(module.weight)], module.weight.dtype))
    for name, module in modules:
        if isinstance(module, nn.Linear):
            tied = shared.get(id(module.weight))  # per-row scales serve both uses
            new = (
                Int8Linear(*tied, module.bias)
                if tied
                else Int8Linear.from_linear(module, weight.q_groups)
            )
            _replace(model, name, new)


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    if not leaf:
        raise ValueError("quantize_module needs a model, not a single layer")
    setattr(model.get_submodule(parent_name), leaf, new)
