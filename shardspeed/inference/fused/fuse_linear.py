"""Concatenate linears that read the same input into one (rows stacked), so one matmul replaces
several; the originals become views into the fused storage, costing no extra memory."""

from __future__ import annotations

import torch
from torch import nn

from shardspeed.inference.quantization import Int8Linear

__all__ = ["fuse_linears"]


def fuse_linears(parts: list[nn.Module]) -> nn.Module:
    """One linear computing ``cat([p(x) for p in parts], -1)``; ``parts`` are ``nn.Linear`` or
    :class:`Int8Linear` (all the same kind) and afterwards share the fused tensors."""
    if all(isinstance(p, Int8Linear) for p in parts):
        return _fuse_int8([p for p in parts if isinstance(p, Int8Linear)])
    if all(type(p) is nn.Linear for p in parts):
        return _fuse_float([p for p in parts if isinstance(p, nn.Linear)])
    raise TypeError(f"cannot fuse {[type(p).__name__ for p in parts]}")


def _bias(parts: list[nn.Linear] | list[Int8Linear], widths: list[int]) -> torch.Tensor | None:
    biases: list[torch.Tensor | None] = [
        p.bias.detach() if isinstance(p.bias, torch.Tensor) else None for p in parts
    ]
    given = [b for b in biases if b is not None]
    if not given:
        return None
    filled = [
        given[0].new_zeros(w) if b is None else b for b, w in zip(biases, widths, strict=True)
    ]
    return torch.cat(filled)


def _rows(parts: list[torch.Tensor]) -> list[tuple[int, int]]:
    bounds, start = [], 0
    for part in parts:
        bounds.append((start, start + part.shape[0]))
        start += part.shape[0]
    return bounds


def _fuse_float(parts: list[nn.Linear]) -> nn.Linear:
    weight = torch.cat([p.weight.detach() for p in parts])
    bias = _bias(parts, [p.out_features for p in parts])
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        fused.bias = nn.Parameter(bias, requires_grad=False)
    for part, (start, stop) in zip(parts, _rows([p.weight for p in parts]), strict=True):
        part.weight = nn.Parameter(weight[start:stop], requires_grad=False)
        if part.bias is not None and bias is not None:
            part.bias = nn.Parameter(bias[start:stop], requires_grad=False)
    return fused


def _fuse_int8(parts: list[Int8Linear]) -> Int8Linear:
    qweight = torch.cat([p.qweight for p in parts])
    scales = torch.cat([p.scales for p in parts])
    fused = Int8Linear(qweight, scales, _bias(parts, [p.out_features for p in parts]))
    for part, (start, stop) in zip(parts, _rows([p.qweight for p in parts]), strict=True):
        part.qweight = qweight[start:stop]
        part.scales = scales[start:stop]
        if part.bias is not None and fused.bias is not None:
            part.bias = nn.Parameter(fused.bias[start:stop], requires_grad=False)
    return fused
