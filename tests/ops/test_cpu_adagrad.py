"""DeepSpeedCPUAdagrad's fast path (torch's fused CPU kernel) against torch and its own
multi-tensor path; gradients are left as they were."""

from __future__ import annotations

import pytest
import torch

from shardspeed.ops.adagrad import DeepSpeedCPUAdagrad, cpu_adagrad

SHAPES = [(40, 9), (333,), (1,)]


def params_like(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]


def train(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: int = 8) -> None:
    for step in range(steps):
        gen = torch.Generator().manual_seed(50 + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_fused_path_is_taken_and_matches_torch_and_the_multi_tensor_path(
    monkeypatch: pytest.MonkeyPatch, weight_decay: float
) -> None:
    calls: list[int] = []
    real = torch._fused_adagrad_

    def spy(params, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(len(params))
        return real(params, *args, **kwargs)

    monkeypatch.setattr(torch, "_fused_adagrad_", spy)
    kw = dict(lr=1e-2, eps=1e-10, weight_decay=weight_decay)
    ours, theirs, slow = params_like(), params_like(), params_like()
    opt = DeepSpeedCPUAdagrad(ours, **kw)
    train(opt, ours)
    assert calls == [len(SHAPES)] * 8
    train(torch.optim.Adagrad(theirs, foreach=False, **kw), theirs)
    monkeypatch.setattr(cpu_adagrad.DeepSpeedCPUAdagrad, "_cpu_fusable", lambda self, p: False)
    train(DeepSpeedCPUAdagrad(slow, **kw), slow)
    for a, b, c in zip(ours, theirs, slow, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-7)
    assert set(opt.state[ours[0]]) == {"step", "exp_avg_sq"}


def test_gradients_are_left_untouched() -> None:
    params = params_like()
    grads = [torch.randn(p.shape) for p in params]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    DeepSpeedCPUAdagrad(params, weight_decay=0.5).step()
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads, strict=True))
