"""Muon's orthogonalisation: a quintic Newton-Schulz iteration, and the learning-rate scale.

The arithmetic is the one ``torch.optim.Muon`` performs (torch 2.13: normalise by the Frobenius
norm clamped at ``eps``, iterate in bfloat16 on the wide orientation of the matrix), so an update
computed here equals torch's bit for bit on the same input.
"""

from __future__ import annotations

import math

import torch

#: the quintic's coefficients (Keller Jordan's, torch's and DeepSpeed's defaults)
NS_COEFFICIENTS: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
#: Newton-Schulz iterations per step
NS_STEPS = 5
#: the floor of the norm the matrix is divided by
NS_EPS = 1e-7
#: torch refuses this many iterations or more; so does the config check
MAX_NS_STEPS = 100


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
