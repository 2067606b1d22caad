"""Muon's orthogonalisation: a quintic Newton-Schulz iteration, and the learning-rate scale.

The arithmetic is the one ``torch.optim.Muon`` performs (torch 2.13: normalise by the Frobenius
norm clamped at ``eps``, iterate in bfloat16 on the wide orientation of the matrix), so an update
computed here equals torch's bit for bit on the same input.

:func:`orthogonalize_many` runs the same iteration on a stack of same-shaped matrices with
batched matrix products: a transformer's layers repeat a few shapes, so one step launches a few
dozen kernels instead of fifteen per matrix (the step is launch-bound on a GPU otherwise).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

#: the quintic's coefficients (Keller Jordan's, torch's and DeepSpeed's defaults)
NS_COEFFICIENTS: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
#: Newton-Schulz iterations per step
NS_STEPS = 5
#: the floor of the norm the matrix is divided by
NS_EPS = 1e-7
#: torch refuses this many iterations or more; so does the config check
MAX_NS_STEPS = 100
#: the most elements one stack of same-shaped matrices holds (bounds the stack's extra memory)
STACK_ELEMENTS = 1 << 26


def as_matrix(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` viewed as the matrix Muon orthogonalises: rows are the first dimension (a
    convolution's filters), columns everything else, as DeepSpeed flattens 4-D kernels."""
    return tensor.reshape(tensor.shape[0], -1)


def matrix_shape(shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
    """The (rows, columns) :func:`as_matrix` gives a tensor of ``shape``."""
    rows = int(shape[0])
    return rows, math.prod(int(d) for d in shape[1:])


def orthogonalize(
    matrix: torch.Tensor,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    steps: int = NS_STEPS,
    eps: float = NS_EPS,
) -> torch.Tensor:
    """The approximate orthogonal factor ``U V^T`` of 2-D ``matrix`` (bfloat16, its shape)."""
    if matrix.dim() != 2:
        raise ValueError(f"Newton-Schulz needs a 2-D matrix, got shape {tuple(matrix.shape)}")
    a, b, c = coefficients
    tall = matrix.size(0) > matrix.size(1)
    # iterate on the wide orientation: the Gram matrix is then the smaller square
    x = matrix.bfloat16()
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, shape: tuple[int, int]) -> float:
    """torch's default ("original") scale: ``lr * sqrt(max(1, rows / cols))``, which gives tall
    matrices' updates the RMS of square ones."""
    rows, cols = shape
    return lr * math.sqrt(max(1.0, rows / cols))


def _orthogonalize_stack(
    stack: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> torch.Tensor:
    """:func:`orthogonalize` of each matrix of a ``(batch, rows, cols)`` stack, batched."""
    a, b, c = coefficients
    tall = stack.size(1) > stack.size(2)
    x = stack.bfloat16()
    if tall:
        x = x.mT
    x = x / x.norm(dim=(1, 2), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a)
    return x.mT if tall else x


def orthogonalize_many(
    matrices: Sequence[torch.Tensor],
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    steps: int = NS_STEPS,
    eps: float = NS_EPS,
) -> list[torch.Tensor]:
    """:func:`orthogonalize` of every 2-D matrix of ``matrices`` (same order), matrices of one
    shape and device stacked (at most :data:`STACK_ELEMENTS` elements a stack) and iterated
    together; a shape seen once goes alone."""
    out: list[torch.Tensor | None] = [None] * len(matrices)
    by_kind: dict[tuple[tuple[int, ...], torch.device], list[int]] = {}
    for index, matrix in enumerate(matrices):
        if matrix.dim() != 2:
            raise ValueError(f"Newton-Schulz needs a 2-D matrix, got shape {tuple(matrix.shape)}")
        by_kind.setdefault((tuple(matrix.shape), matrix.device), []).append(index)
    for (shape, _), indices in by_kind.items():
        if len(indices) == 1:
            out[indices[0]] = orthogonalize(matrices[indices[0]], coefficients, steps, eps)
            continue
        per_stack = max(1, STACK_ELEMENTS // math.prod(shape))
        for lo in range(0, len(indices), per_stack):
            part = indices[lo : lo + per_stack]
            stack = torch.stack([matrices[i] for i in part])
            results = _orthogonalize_stack(stack, coefficients, steps, eps)
            for i, result in zip(part, results, strict=True):
                out[i] = result
    return [m for m in out if m is not None]
