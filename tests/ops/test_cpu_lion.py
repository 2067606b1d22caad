"""DeepSpeedCPULion's cache-blocked CPU update: the same result as the whole-tensor update."""

from __future__ import annotations

import pytest
import torch

from shardspeed.ops.lion import DeepSpeedCPULion, lion

SHAPES = [(30, 11), (257,), (1,), (4, 4)]


def params_like(dtype: torch.dtype, seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]


def train(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: int = 6) -> None:
    for step in range(steps):
        gen = torch.Generator().manual_seed(70 + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()


def test_cache_blocks_cover_every_element_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lion, "CACHE_BLOCK_NUMEL", 100)
    params = params_like(torch.float32)
    for p in params:
        p.grad = torch.zeros_like(p)
    blocks = list(lion.cache_blocks(params, [torch.zeros_like(p) for p in params]))
    assert all(sum(v.numel() for v in ps) <= 100 for ps, _, _ in blocks)
    assert sum(v.numel() for ps, _, _ in blocks for v in ps) == sum(p.numel() for p in params)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocked_update_matches_whole_tensor_update(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    kw = dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    blocked, whole = params_like(dtype), params_like(dtype)
    monkeypatch.setattr(lion, "CACHE_BLOCK_NUMEL", 64)  # many blocks, ragged ends
    opt_blocked = DeepSpeedCPULion(blocked, **kw)
    train(opt_blocked, blocked)
    monkeypatch.setattr(lion, "_blockable", lambda *tensors: False)
    opt_whole = DeepSpeedCPULion(whole, **kw)
    train(opt_whole, whole)
    for a, b in zip(blocked, whole, strict=True):
        assert a.dtype == dtype
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(
            opt_blocked.state[a]["exp_avg"], opt_whole.state[b]["exp_avg"], rtol=1e-6, atol=1e-7
        )
        assert opt_blocked.state[a]["exp_avg"].dtype == torch.float32
