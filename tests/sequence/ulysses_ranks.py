"""Rank side of the Ulysses test: attention over a sequence split across the ranks equals
attention over the whole sequence in one process, forward and backward."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardspeed.sequence.layer import DistributedAttention
from tests.runtime.parity import assert_close

SEQ, BATCH, HEADS, DIM = 16, 2, 4, 8


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """Attention on ``[sequence, batch, heads, dim]`` tensors."""
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return out.permute(2, 0, 1, 3)


def split_sequence_equals_whole(causal: bool) -> float:
    world, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(SEQ, BATCH, HEADS, DIM, generator=gen, requires_grad=True) for _ in "qkv"]
    expected = _attention(*full, causal)
    weight = torch.randn(expected.shape, generator=gen)
    (expected * weight).sum().backward()

    rows = slice(rank * SEQ // world, (rank + 1) * SEQ // world)
    mine = [t.detach()[rows].clone().requires_grad_(True) for t in full]
    layer = DistributedAttention(lambda q, k, v: _attention(q, k, v, causal), dist.group.WORLD)
    out = layer(*mine)
    assert out.shape == (SEQ // world, BATCH, HEADS, DIM)
    assert_close(out, expected[rows], "output", 1e-5, 1e-6)
    (out * weight[rows]).sum().backward()
    for name, local, whole in zip("qkv", mine, full, strict=True):
        assert local.grad is not None and whole.grad is not None
        assert_close(local.grad, whole.grad[rows], f"d{name}", 1e-5, 1e-6)
    return (out - expected[rows]).abs().max().item()


def indivisible_heads_refused() -> str:
    world = dist.get_world_size()
    x = torch.randn(4, 1, world + 1, 2)
    layer = DistributedAttention(lambda q, k, v: q, dist.group.WORLD)
    try:
        layer(x, x, x)
    except ValueError as error:
        return str(error)
    raise AssertionError("accepted heads not divisible by the sequence-parallel size")
