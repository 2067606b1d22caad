"""``zero_optimization.ignore_unused_parameters`` under stages 1 and 2.

True (DeepSpeed's default): a trainable parameter the loss never touches reduces as zeros and
training goes on. False: the reducing backward stops with the parameter's name, on every rank,
also when only one rank left it unused (no rank is left waiting in a collective).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.runtime.parity import MLP
from tests.runtime.zero.ranks import _engine


class WithSpare(nn.Module):
    """An MLP plus a layer used only when asked (``use_spare``)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = MLP()
        self.spare = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor, use_spare: bool = False) -> torch.Tensor:
        loss = self.body(x, y)
        return loss + self.spare(x).mean() * 0.0 if use_spare else loss


def unused_parameters(stage: int) -> None:
    rank = dist.get_rank()
    x, y = torch.randn(2, 16), torch.randn(2, 1)
    torch.manual_seed(0)
    tolerant = _engine(WithSpare(), stage, gas=2)
    for _ in range(2):  # the spare layer unused: reduces as zeros, no error
        tolerant.backward(tolerant(x, y))
        tolerant.step()
    tolerant.destroy()
    torch.manual_seed(0)
    strict = _engine(WithSpare(), stage, gas=2, zero={"ignore_unused_parameters": False})
    # used in the window's first micro-step only: every parameter got a gradient, fine
    strict.backward(strict(x, y, use_spare=True))
    strict.step()
    strict.backward(strict(x, y))
    strict.step()
    # one rank never uses it: both ranks stop, the other one saying so
    strict.backward(strict(x, y, use_spare=rank == 0))
    strict.step()
    expected = "'spare.weight'" if rank == 1 else "on another rank"
    with pytest.raises(ValueError, match=expected):
        strict.backward(strict(x, y, use_spare=rank == 0))
    strict.destroy()


@pytest.mark.parametrize("stage", [1, 2], ids=["stage1", "stage2"])
def test_ignore_unused_parameters(dist_pool, stage):
    dist_pool(2).run(unused_parameters, stage)
