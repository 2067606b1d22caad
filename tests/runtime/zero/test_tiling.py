"""zero.TiledLinear: a grid of small linears equal to the one big layer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardspeed.runtime.zero.tiling import split_sizes
from shardspeed.zero import TiledLinear, TiledLinearReturnBias


@pytest.mark.parametrize(("in_splits", "out_splits"), [(1, 1), (3, 2), (4, 5)])
@pytest.mark.parametrize("bias", [True, False])
def test_tiles_equal_the_layer_they_copy(in_splits, out_splits, bias):
    torch.manual_seed(0)
    big = nn.Linear(10, 7, bias=bias)
    tiled = TiledLinear(10, 7, bias, in_splits, out_splits, init_linear=big)
    assert len(tiled.linears) == out_splits and all(len(r) == in_splits for r in tiled.linears)
    x = torch.randn(3, 2, 10, requires_grad=True)
    torch.testing.assert_close(tiled(x), big(x))
    grad_tiled = torch.autograd.grad(tiled(x).square().sum(), x)[0]
    grad_big = torch.autograd.grad(big(x).square().sum(), x)[0]
    torch.testing.assert_close(grad_tiled, grad_big)
    assert sum(p.numel() for p in tiled.parameters()) == sum(p.numel() for p in big.parameters())


def test_split_input_and_separate_outputs():
    torch.manual_seed(0)
    big = nn.Linear(6, 4)
    tiled = TiledLinear(
        6,
        4,
        in_splits=2,
        out_splits=2,
        input_is_already_split=True,
        combine_out_splits=False,
        init_linear=big,
    )
    x = torch.randn(5, 6)
    outputs = tiled(list(x.split([3, 3], dim=-1)))
    assert [o.shape[-1] for o in outputs] == [2, 2]
    torch.testing.assert_close(torch.cat(outputs, dim=-1), big(x))
    with pytest.raises(ValueError, match="needs 2 input parts"):
        tiled([x])


class ReturnsBias(nn.Linear):
    """A linear that adds no bias itself and hands it back (Megatron's style)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return nn.functional.linear(x, self.weight), self.bias


def test_return_bias_variant():
    torch.manual_seed(0)
    big = nn.Linear(6, 4)
    tiled = TiledLinearReturnBias(6, 4, in_splits=3, out_splits=2, linear_cls=ReturnsBias)
    tiled.copy_params_from(big)
    x = torch.randn(5, 6)
    output, bias = tiled(x)
    torch.testing.assert_close(output + bias, big(x))


def test_split_sizes_and_refusals():
    assert split_sizes(10, 3) == [4, 3, 3]
    with pytest.raises(ValueError, match="cannot split 3 features into 4 parts"):
        split_sizes(3, 4)
    with pytest.raises(ValueError, match="init_linear's weight is"):
        TiledLinear(6, 4, init_linear=nn.Linear(4, 6))
