"""Gradient communication honours communication_data_type: half the bytes on the wire."""

from __future__ import annotations

import copy

import torch

import shardspeed
from shardspeed import comm
from tests.runtime.parity import MLP, adamw_config


def allreduce_bytes_per_step(comm_dtype: str | None) -> tuple[int, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = MLP(width=32)
    extra = {} if comm_dtype is None else {"communication_data_type": comm_dtype}
    engine, *_ = shardspeed.initialize(
        model=copy.deepcopy(model), config=adamw_config(4, 1, 0.0, **extra)
    )
    gen = torch.Generator().manual_seed(comm.get_rank())
    x, y = torch.randn(4, 32, generator=gen), torch.randn(4, 1, generator=gen)
    comm.reset_comm_volume()
    engine.backward(engine(x, y))
    sent = comm.get_comm_volume()["all_reduce"]["bytes"]
    grads = [p.grad.detach().clone() for p in engine.module.parameters()]
    engine.step()
    engine.destroy()
    return sent, grads


def test_communication_data_type_halves_gradient_bytes(dist_pool):
    pool = dist_pool(2)
    fp32 = pool.run(allreduce_bytes_per_step, None)
    bf16 = pool.run(allreduce_bytes_per_step, "bf16")
    numel = sum(p.numel() for p in MLP(width=32).parameters())
    assert fp32[0][0] == 4 * numel
    assert bf16[0][0] == 2 * numel
    # the averaged gradients agree to bf16 precision (8 mantissa bits), and stay fp32 tensors
    for a, b in zip(fp32[0][1], bf16[0][1], strict=True):
        assert b.dtype == torch.float32
        scale = a.abs().max().item()
        torch.testing.assert_close(b, a, rtol=0, atol=scale * 2**-7)
        assert not torch.equal(a, b) or scale == 0.0
