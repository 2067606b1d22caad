"""Blockwise quantization of communicated tensors: round trip error, payload layout, non-finite
values kept visible."""

from __future__ import annotations

import pytest
import torch

from shardspeed.runtime.comm.quantize import INT4, INT8, QuantSpec, dequantize, quantize


@pytest.mark.parametrize("spec", [INT8, INT4, QuantSpec(8, 64), QuantSpec(4, 32)])
@pytest.mark.parametrize("numel", [1, 255, 256, 1000])
def test_round_trip_error_is_within_half_a_step(spec: QuantSpec, numel: int) -> None:
    torch.manual_seed(0)
    values = torch.randn(numel) * torch.linspace(0.01, 10.0, numel)
    payload = quantize(values, spec)
    assert payload.dtype == torch.uint8
    assert payload.numel() == spec.payload_nbytes(numel)
    assert payload.numel() % 4 == 0
    back = dequantize(payload, numel, spec)
    padded = torch.zeros(spec.blocks(numel) * spec.block)
    padded[:numel] = values
    step = padded.view(-1, spec.block).abs().amax(dim=1) / spec.qmax
    bound = (step / 2).repeat_interleave(spec.block)[:numel] + 1e-6
    assert torch.all((back - values).abs() <= bound)
    # the largest magnitude of each block is exact (its code is +-qmax)
    top = values.abs().argmax()
    assert back[top] == pytest.approx(values[top].item(), rel=1e-6)


def test_payload_sizes() -> None:
    # int8: a byte per element + 4 bytes per 256; int4: half a byte + 4 per 256
    assert INT8.payload_nbytes(1024) == 1024 + 16
    assert INT4.payload_nbytes(1024) == 512 + 16
    assert INT8.payload_nbytes(1) == 256 + 4  # padded to one whole block


def test_zeros_and_cast_into_bf16() -> None:
    payload = quantize(torch.zeros(300), INT8)
    out = torch.full((300,), 7.0, dtype=torch.bfloat16)
    dequantize(payload, 300, INT8, out=out)
    assert torch.all(out == 0)


@pytest.mark.parametrize("spec", [INT8, INT4])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_non_finite_block_stays_non_finite(spec: QuantSpec, bad: float) -> None:
    values = torch.ones(2 * spec.block)
    values[3] = bad
    back = dequantize(quantize(values, spec), values.numel(), spec)
    assert not torch.isfinite(back[: spec.block]).any()
    assert torch.equal(back[spec.block :], values[spec.block :])


def test_bad_spec() -> None:
    with pytest.raises(ValueError, match="8 or 4 bits"):
        QuantSpec(2)
