"""DeepSpeedCPUAdam's fast path (torch's fused CPU kernel): parity with torch and with the
multi-tensor path, chunked upcasting of low-precision parameters, and untouched gradients."""

from __future__ import annotations

import copy

import pytest
import torch

from shardspeed.ops import cpu_blocks
from shardspeed.ops.adam import DeepSpeedCPUAdam, adam_base

SHAPES = [(64, 33), (1000,), (5, 7, 3), (1,)]


def params_like(dtype: torch.dtype = torch.float32, seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]


def set_grads(params: list[torch.nn.Parameter], step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    grads = [torch.randn(p.shape, generator=gen).to(p.dtype) for p in params]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    return grads


def train(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: int = 10) -> None:
    for step in range(steps):
        set_grads(params, step)
        opt.step()


@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
@pytest.mark.parametrize("adamw_mode", [True, False])
def test_parity_with_torch_adamw_and_adam(adamw_mode: bool, weight_decay: float) -> None:
    kw = dict(lr=3e-3, betas=(0.85, 0.99), eps=1e-7, weight_decay=weight_decay)
    ours, theirs = params_like(), params_like()
    opt = DeepSpeedCPUAdam(ours, adamw_mode=adamw_mode, **kw)
    ref_cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    ref = ref_cls(theirs, foreach=False, **kw)
    train(opt, ours)
    train(ref, theirs)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        for key in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[a][key], ref.state[b][key], rtol=1e-6, atol=1e-8)
    assert set(opt.state[ours[0]]) == {"step", "exp_avg", "exp_avg_sq"}


def test_fp32_cpu_parameters_take_the_fused_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = torch._fused_adamw_

    def spy(params, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(len(params))
        return real(params, *args, **kwargs)

    monkeypatch.setattr(torch, "_fused_adamw_", spy)
    params = params_like()
    train(DeepSpeedCPUAdam(params), params, steps=2)
    assert calls == [len(SHAPES)] * 2  # one kernel call per step for the whole group


@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_path_matches_the_multi_tensor_path(
    monkeypatch: pytest.MonkeyPatch, adamw_mode: bool, bias_correction: bool, dtype: torch.dtype
) -> None:
    """Same update as the ``torch._foreach_*`` path, including bias_correction=False (a step
    of +inf in the kernel) and bf16 parameters with fp32 moments (chunked upcasting)."""
    kw = dict(lr=1e-2, weight_decay=0.1, adamw_mode=adamw_mode, bias_correction=bias_correction)
    fast, slow = params_like(dtype), params_like(dtype)
    fast_opt = DeepSpeedCPUAdam(fast, **kw)
    train(fast_opt, fast)
    monkeypatch.setattr(adam_base, "cpu_fusable", lambda *tensors: False)
    slow_opt = DeepSpeedCPUAdam(slow, **kw)
    train(slow_opt, slow)
    bf16_ulp = 2**-7  # the two paths may round an fp32 result to neighbouring bf16 values
    tol = dict(rtol=1e-6, atol=1e-7) if dtype == torch.float32 else dict(rtol=bf16_ulp, atol=1e-3)
    for a, b in zip(fast, slow, strict=True):
        assert a.dtype == dtype
        torch.testing.assert_close(a, b, **tol)
        for key in ("exp_avg", "exp_avg_sq"):
            assert fast_opt.state[a][key].dtype == torch.float32
            torch.testing.assert_close(
                fast_opt.state[a][key], slow_opt.state[b][key], rtol=1e-5, atol=1e-7
            )


def test_bias_correction_false_is_the_hand_formula() -> None:
    lr, b1, b2, eps = 1e-2, 0.9, 0.99, 1e-8
    params = params_like()
    ref = [p.detach().clone() for p in params]
    m = [torch.zeros_like(r) for r in ref]
    v = [torch.zeros_like(r) for r in ref]
    opt = DeepSpeedCPUAdam(params, lr=lr, betas=(b1, b2), eps=eps, bias_correction=False)
    for step in range(5):
        grads = set_grads(params, step)
        opt.step()
        for i, g in enumerate(grads):
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            ref[i] = ref[i] - lr * m[i] / (v[i].sqrt() + eps)
    for p, r in zip(params, ref, strict=True):
        torch.testing.assert_close(p.detach(), r, rtol=1e-5, atol=1e-6)
    assert float(opt.state[params[0]]["step"]) == 5  # the real step is kept, not the +inf


def test_chunked_upcast_does_not_depend_on_chunk_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Elementwise, so any chunking gives the same update (to the rounding of the kernel's
    vector body against its scalar tail, which chunk edges move)."""
    whole, chunked = params_like(torch.bfloat16), params_like(torch.bfloat16)
    opt_whole = DeepSpeedCPUAdam(whole, lr=1e-2, weight_decay=0.1)
    train(opt_whole, whole, steps=3)
    monkeypatch.setattr(cpu_blocks, "BLOCK_NUMEL", 7)  # ragged blocks in every tensor
    opt_chunked = DeepSpeedCPUAdam(chunked, lr=1e-2, weight_decay=0.1)
    train(opt_chunked, chunked, steps=3)
    for a, b in zip(whole, chunked, strict=True):
        torch.testing.assert_close(a, b, rtol=2**-7, atol=1e-3)  # one bf16 ulp at most
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(
                opt_whole.state[a][key], opt_chunked.state[b][key], rtol=1e-6, atol=1e-8
            )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_are_left_untouched(dtype: torch.dtype) -> None:
    params = params_like(dtype)
    grads = set_grads(params, 0)
    DeepSpeedCPUAdam(params, adamw_mode=False, weight_decay=0.5).step()  # L2 mode adds wd * p
    for p, g in zip(params, grads, strict=True):
        assert p.grad is not None and torch.equal(p.grad, g)


def test_int_step_from_a_deepspeed_checkpoint_continues() -> None:
    a, b = params_like(), params_like()
    opt_a, opt_b = DeepSpeedCPUAdam(a, lr=1e-2), DeepSpeedCPUAdam(b, lr=1e-2)
    train(opt_a, a, steps=3)
    saved = copy.deepcopy(opt_a.state_dict())  # state_dict() shares the live tensors
    for state in saved["state"].values():
        state["step"] = int(state["step"])  # DeepSpeed's CPU Adam stores a plain int
    with torch.no_grad():
        for pa, pb in zip(a, b, strict=True):
            pb.copy_(pa)
    opt_b.load_state_dict(saved)
    set_grads(a, 9)
    set_grads(b, 9)
    opt_a.step()
    opt_b.step()
    for pa, pb in zip(a, b, strict=True):
        assert torch.equal(pa, pb)
