"""has_inf_or_nan and unscale_ over tensor lists."""

from __future__ import annotations

import pytest
import torch

from shardspeed.runtime.precision.overflow import has_inf_or_nan, unscale_

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_finite_tensors_give_zero(dtype: torch.dtype) -> None:
    flag = has_inf_or_nan([torch.randn(5, dtype=dtype), torch.randn(2, 3, dtype=dtype)])
    assert flag.dim() == 0 and flag.dtype == torch.float32
    assert flag.item() == 0.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_value_gives_one(dtype: torch.dtype, bad: float) -> None:
    poisoned = torch.randn(4, dtype=dtype)
    poisoned[2] = bad
    assert has_inf_or_nan([torch.randn(3, dtype=dtype), poisoned]).item() == 1.0


def test_mixed_dtypes_and_empty_tensors() -> None:
    tensors = [
        torch.randn(3),
        torch.empty(0, dtype=torch.half),
        torch.ones(2, dtype=torch.bfloat16),
    ]
    assert has_inf_or_nan(tensors).item() == 0.0
    tensors.append(torch.tensor([float("nan")], dtype=torch.half))
    assert has_inf_or_nan(tensors).item() == 1.0


def test_large_finite_values_are_not_overflow() -> None:
    # A sum-based check would overflow here; the inf-norm does not.
    big = torch.full((1000,), torch.finfo(torch.float32).max / 2)
    assert has_inf_or_nan([big]).item() == 0.0


def test_empty_list_gives_zero_on_requested_device() -> None:
    flag = has_inf_or_nan([], device="cpu")
    assert flag.item() == 0.0 and flag.device.type == "cpu"


def test_integer_tensors_are_ignored() -> None:
    assert has_inf_or_nan([torch.arange(4)]).item() == 0.0


@pytest.mark.parametrize("inv_scale", [0.25, torch.tensor(0.25)])
def test_unscale_in_place(inv_scale: float | torch.Tensor) -> None:
    a = torch.full((3,), 8.0)
    b = torch.full((2,), 4.0, dtype=torch.bfloat16)
    unscale_([a, b], inv_scale)
    assert torch.equal(a, torch.full((3,), 2.0))
    assert torch.equal(b, torch.full((2,), 1.0, dtype=torch.bfloat16))


def test_unscale_by_one_is_a_no_op() -> None:
    a = torch.full((3,), 8.0)
    unscale_([a], 1.0)
    assert torch.equal(a, torch.full((3,), 8.0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_stay_on_device() -> None:
    grads = [torch.randn(8, device="cuda", dtype=d) for d in DTYPES]
    flag = has_inf_or_nan(grads)
    assert flag.device.type == "cuda" and flag.item() == 0.0
    grads[1][3] = float("inf")
    assert has_inf_or_nan([torch.zeros(2), *grads], device="cuda").item() == 1.0
    unscale_(grads, torch.tensor(0.5))
    assert torch.isinf(grads[1][3])
