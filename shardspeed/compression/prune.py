"""Pruning masks: keep the top ``dense_ratio`` fraction of scores.

``l1`` masks are computed once from the weights' magnitudes (per weight, per row, per head, per
channel); ``topk`` masks come from learned scores through :class:`TopKMask`, whose gradient
passes straight through to the scores (DeepSpeed's ``TopKBinarizer`` without the sigmoid).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

__all__ = ["TopKMask", "head_columns", "learned_scores", "magnitude_mask", "topk_mask"]


class TopKMask(torch.autograd.Function):
    """Forward: 1 for the ``ceil(ratio * n)`` largest scores, 0 elsewhere. Backward: identity."""

    @staticmethod
    def forward(ctx: Any, scores: torch.Tensor, ratio: float) -> torch.Tensor:
        keep = max(1, math.ceil(ratio * scores.numel()))
        mask = torch.zeros_like(scores)
        top = torch.topk(scores.detach().flatten(), keep).indices
        mask.view(-1)[top] = 1.0
        return mask

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def topk_mask(scores: torch.Tensor, ratio: float) -> torch.Tensor:
    """The 0/1 mask of the top ``ratio`` of ``scores`` (straight-through gradient)."""
    out: torch.Tensor = TopKMask.apply(scores, ratio)
    return out


def magnitude_mask(norms: torch.Tensor, ratio: float) -> torch.Tensor:
    """The fixed 0/1 mask of the top ``ratio`` of ``norms`` (no gradient)."""
    with torch.no_grad():
        return TopKMask.apply(norms.detach(), ratio)  # type: ignore[no-any-return]


def learned_scores(shape: tuple[int, ...], like: torch.Tensor) -> nn.Parameter:
    """Mask scores initialised as DeepSpeed does (Kaiming-uniform, ``a = sqrt(5)``)."""
    scores = nn.Parameter(torch.empty(shape, device=like.device, dtype=like.dtype))
    nn.init.kaiming_uniform_(scores, a=math.sqrt(5))
    return scores


def head_columns(head_mask: torch.Tensor, width: int) -> torch.Tensor:
    """A per-head mask (any shape with ``num_heads`` values) spread over ``width`` columns."""
    heads = head_mask.reshape(-1)
    if width % heads.numel() != 0:
        raise ValueError(
            f"num_heads={heads.numel()} does not divide the layer's {width} input features: "
            "give head_pruning.shared_parameters.num_heads of the attention output projection"
        )
    return heads.repeat_interleave(width // heads.numel())
