"""Rank side of the tensor-parallel layer tests: column- and row-parallel linears cut from the
same whole layers, compared with the whole layers in every rank's process."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from shardspeed.runtime.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from shardspeed.runtime.zero.comm_group import CommGroup


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def _piece(full: torch.Tensor, dim: int, widths: tuple[int, ...], rank: int) -> torch.Tensor:
    return full.narrow(dim, sum(widths[:rank]), widths[rank])


def _copy(linear: nn.Linear) -> nn.Linear:
    return copy.deepcopy(linear)


def layers_equal_the_whole_layers() -> dict[str, Any]:
    """An MLP (column, gelu, row), a gathered column and a row on a whole input: outputs and
    every gradient equal the whole layers' (this rank's piece of them)."""
    group = CommGroup.of(None)
    torch.manual_seed(0)
    fc1, fc2, head = nn.Linear(8, 6), nn.Linear(6, 5), nn.Linear(8, 6)
    # the parallel layers adopt the whole layers' parameters (split in place): cut copies
    col, row = ColumnParallelLinear(_copy(fc1), group), RowParallelLinear(_copy(fc2), group)
    gathered = ColumnParallelLinear(_copy(head), group, gather_output=True)
    whole_in = RowParallelLinear(_copy(fc2), group, input_is_parallel=False)
    x = torch.randn(3, 8, requires_grad=True)
    mine = x.detach().clone().requires_grad_(True)

    want = fc2(nn.functional.gelu(fc1(x)))
    want_head = head(x)
    want_row = fc2(want_head)
    (want.square().sum() + want_head.sin().sum() + want_row.sum()).backward()

    got = row(nn.functional.gelu(col(mine)))
    got_head = gathered(mine)
    got_row = whole_in(got_head)
    (got.square().sum() + got_head.sin().sum() + got_row.sum()).backward()

    _close(got, want, "mlp output")
    _close(got_head, want_head, "gathered output")
    _close(got_row, want_row, "row on a whole input")
    _close(mine.grad, x.grad, "input gradient")
    r = group.rank
    _close(col.weight.grad, _piece(fc1.weight.grad, 0, col.widths, r), "column weight grad")
    _close(col.bias.grad, _piece(fc1.bias.grad, 0, col.widths, r), "column bias grad")
    _close(gathered.weight.grad, _piece(head.weight.grad, 0, gathered.widths, r), "head grad")
    # fc2 is used twice in the whole model: by the MLP and on the head's output
    _close(row.weight.grad + whole_in.weight.grad, _piece(fc2.weight.grad, 1, row.widths, r), "row")
    _close(row.bias.grad + whole_in.bias.grad, fc2.bias.grad, "row bias grad")
    return {
        "widths": col.widths,
        "marks": [
            getattr(p, "tensor_model_parallel", None)
            for p in (col.weight, col.bias, row.weight, row.bias)
        ],
    }
