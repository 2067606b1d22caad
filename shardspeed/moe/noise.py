"""Random perturbations the gates use: multiplicative input jitter and Gumbel noise."""

from __future__ import annotations

import torch
from torch import Tensor


def multiplicative_jitter(x: Tensor, device: torch.device, epsilon: float = 1e-2) -> Tensor:
    """Scale every element of ``x`` by a uniform factor in ``[1 - epsilon, 1 + epsilon]``."""
    if epsilon == 0:
        return x
    factor = torch.empty(x.shape, device=device, dtype=x.dtype).uniform_(
        1.0 - epsilon, 1.0 + epsilon
    )
    return x * factor


def gumbel_rsample(shape: tuple[int, ...] | torch.Size, device: torch.device) -> Tensor:
    """Samples of the standard Gumbel distribution (location 0, scale 1)."""
    gumbel = torch.distributions.gumbel.Gumbel(
        torch.tensor(0.0, device=device), torch.tensor(1.0, device=device)
    )
    return gumbel.rsample(torch.Size(shape))
