"""DeepSpeedCPULion's blocked CPU update (``shardspeed.ops.cpu_blocks``): the same result as the
whole-tensor update; blocks cover every element once; worker errors and thread counts."""

from __future__ import annotations

import pytest
import torch

from shardspeed.ops import cpu_blocks
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


def test_blocks_cover_every_element_once() -> None:
    rows = [(p, torch.zeros_like(p)) for p in params_like(torch.float32)]
    blocks = cpu_blocks.flat_blocks(rows, limit=100)
    assert all(sum(piece[0].numel() for piece in block) <= 100 for block in blocks)
    assert sum(piece[0].numel() for block in blocks for piece in block) == sum(
        p.numel() for p, _ in rows
    )
    assert all(a.numel() == b.numel() for block in blocks for a, b in block)


def test_run_blocks_runs_all_restores_threads_and_raises() -> None:
    before = torch.get_num_threads()
    seen: list[int] = []
    blocks = [[(torch.full((3,), float(i)),)] for i in range(50)]
    cpu_blocks.run_blocks(blocks, lambda block: seen.append(int(block[0][0][0])))
    assert sorted(seen) == list(range(50))
    assert torch.get_num_threads() == before

    def boom(block: cpu_blocks.Block) -> None:
        raise RuntimeError("bad block")

    with pytest.raises(RuntimeError, match="bad block"):
        cpu_blocks.run_blocks(blocks, boom)
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocked_update_matches_whole_tensor_update(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    kw = dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    blocked, whole = params_like(dtype), params_like(dtype)
    monkeypatch.setattr(cpu_blocks, "BLOCK_NUMEL", 64)  # many blocks, ragged ends
    opt_blocked = DeepSpeedCPULion(blocked, **kw)
    train(opt_blocked, blocked)
    monkeypatch.setattr(lion, "blockable", lambda *tensors: False)
    opt_whole = DeepSpeedCPULion(whole, **kw)
    train(opt_whole, whole)
    for a, b in zip(blocked, whole, strict=True):
        assert a.dtype == dtype
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(
            opt_blocked.state[a]["exp_avg"], opt_whole.state[b]["exp_avg"], rtol=1e-6, atol=1e-7
        )
        assert opt_blocked.state[a]["exp_avg"].dtype == torch.float32
