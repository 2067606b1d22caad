"""Each shardspeed optimizer against torch's optimizer or a per-tensor reference written here."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import pytest
import torch

from shardspeed.ops.adagrad import DeepSpeedCPUAdagrad
from shardspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from shardspeed.ops.lamb import FusedLamb
from shardspeed.ops.lion import DeepSpeedCPULion, FusedLion

SHAPES = [(4, 5), (7,), (3, 2, 2)]
STEPS = 10


def make_params(dtype: torch.dtype = torch.float32, seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]


def grads_for(step: int, params: list[torch.Tensor]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=gen).to(p.device, p.dtype) for p in params]


def run(opt: torch.optim.Optimizer, params: list[torch.Tensor], steps: range) -> None:
    for step in steps:
        for p, g in zip(params, grads_for(step, params), strict=True):
            p.grad = g
        opt.step()


def assert_same_trajectory(
    ours: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    reference: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    rtol: float = 1e-6,
    atol: float = 1e-7,
) -> None:
    a, b = make_params(), make_params()
    run(ours(a), a, range(STEPS))
    run(reference(b), b, range(STEPS))
    for pa, pb in zip(a, b, strict=True):
        torch.testing.assert_close(pa, pb, rtol=rtol, atol=atol)


# --- Adam ------------------------------------------------------------------------------------


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_fused_adam_matches_torch(adam_w_mode: bool, weight_decay: float) -> None:
    torch_cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    kw = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=weight_decay)
    assert_same_trajectory(
        lambda ps: FusedAdam(ps, adam_w_mode=adam_w_mode, **kw),
        lambda ps: torch_cls(ps, **kw),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adam_batched_update_is_bitwise_the_whole_group_update(monkeypatch, dtype) -> None:
    """The update runs in batches of bounded size (bounded temporaries); elementwise, so any
    batching gives exactly the same parameters and state."""
    from shardspeed.ops.adam import adam_base
    from shardspeed.ops.multi_tensor import batches_by_numel

    assert [len(b) for b in batches_by_numel(make_params(), limit=20)] == [1, 2]  # 20 | 7+12
    assert [len(b) for b in batches_by_numel(make_params(), limit=10**9)] == [3]
    # the multi-tensor path: CPU tensors would otherwise take torch's fused CPU kernel
    monkeypatch.setattr(adam_base, "cpu_fusable", lambda *tensors: False)
    whole, batched = make_params(dtype), make_params(dtype)
    one = FusedAdam(whole, lr=1e-2, weight_decay=0.1)
    run(one, whole, range(3))
    monkeypatch.setattr(adam_base, "batches_by_numel", lambda ts: [[t] for t in ts])
    many = FusedAdam(batched, lr=1e-2, weight_decay=0.1)
    run(many, batched, range(3))
    for a, b in zip(whole, batched, strict=True):
        assert torch.equal(a, b)
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(one.state[a][key], many.state[b][key])


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_cpu_adam_matches_torch(adamw_mode: bool) -> None:
    torch_cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    kw = dict(lr=3e-3, weight_decay=0.05)
    assert_same_trajectory(
        lambda ps: DeepSpeedCPUAdam(ps, adamw_mode=adamw_mode, **kw),
        lambda ps: torch_cls(ps, **kw),
    )


def test_adam_bias_correction_false_matches_hand_formula() -> None:
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.99, 1e-8, 0.1
    params = make_params()
    ref = [p.detach().clone() for p in params]
    m = [torch.zeros_like(p) for p in ref]
    v = [torch.zeros_like(p) for p in ref]
    opt = FusedAdam(params, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, bias_correction=False)
    for step in range(STEPS):
        grads = grads_for(step, params)
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        opt.step()
        for i, g in enumerate(grads):
            ref[i] = ref[i] * (1 - lr * wd)
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            ref[i] = ref[i] - lr * m[i] / (v[i].sqrt() + eps)
    for p, r in zip(params, ref, strict=True):
        torch.testing.assert_close(p.detach(), r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls", [FusedAdam, DeepSpeedCPUAdam, FusedLamb])
def test_amsgrad_is_rejected(cls: type) -> None:
    with pytest.raises(ValueError, match="not supported"):
        cls(make_params(), amsgrad=True)


def test_adam_state_dict_loads_into_torch_adamw() -> None:
    a, b = make_params(), make_params()
    ours = FusedAdam(a, lr=1e-2, weight_decay=0.1)
    run(ours, a, range(4))
    theirs = torch.optim.AdamW(b, lr=1e-2, weight_decay=0.1)
    with torch.no_grad():
        for pa, pb in zip(a, b, strict=True):
            pb.copy_(pa)
    # the per-parameter state layout is torch's; group keys differ (torch adds its own flags)
    loaded = theirs.state_dict()
    loaded["state"] = copy.deepcopy(ours.state_dict()["state"])
    theirs.load_state_dict(loaded)
    run(ours, a, range(4, 8))
    run(theirs, b, range(4, 8))
    for pa, pb in zip(a, b, strict=True):
        torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-7)


def test_set_grad_none() -> None:
    params = make_params()
    for set_grad_none, expect_none in [(True, True), (False, False)]:
        opt = FusedAdam(params, set_grad_none=set_grad_none)
        for p in params:
            p.grad = torch.ones_like(p)
        opt.zero_grad()
        assert all((p.grad is None) == expect_none for p in params)
        if not expect_none:
            assert all(torch.count_nonzero(p.grad) == 0 for p in params)


# --- Adagrad ---------------------------------------------------------------------------------


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_cpu_adagrad_matches_torch(weight_decay: float) -> None:
    kw = dict(lr=5e-2, eps=1e-10, weight_decay=weight_decay)
    assert_same_trajectory(
        lambda ps: DeepSpeedCPUAdagrad(ps, **kw), lambda ps: torch.optim.Adagrad(ps, **kw)
    )


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
def test_cpu_adagrad_sparse_matches_torch() -> None:
    emb_a = torch.nn.Embedding(10, 3, sparse=True)
    emb_b = copy.deepcopy(emb_a)
    ours = DeepSpeedCPUAdagrad(emb_a.parameters(), lr=0.1)
    theirs = torch.optim.Adagrad(emb_b.parameters(), lr=0.1)
    for step in range(3):
        idx = torch.tensor([step, 2, 2, 7])  # duplicates must be summed
        for emb, opt in ((emb_a, ours), (emb_b, theirs)):
            opt.zero_grad()
            emb(idx).pow(2).sum().backward()
            opt.step()
    torch.testing.assert_close(emb_a.weight, emb_b.weight)


# --- Lion ------------------------------------------------------------------------------------


def lion_reference(params, lr, betas, wd):  # noqa: ANN001, ANN201 - test helper
    m = [torch.zeros_like(p) for p in params]
    out = [p.detach().clone() for p in params]
    for step in range(STEPS):
        for i, g in enumerate(grads_for(step, out)):
            c = betas[0] * m[i] + (1 - betas[0]) * g
            out[i] = out[i] * (1 - lr * wd) - lr * torch.sign(c)
            m[i] = betas[1] * m[i] + (1 - betas[1]) * g
    return out


@pytest.mark.parametrize("cls", [FusedLion, DeepSpeedCPULion])
def test_lion_matches_reference(cls: type) -> None:
    lr, betas, wd = 1e-2, (0.9, 0.99), 0.1
    params = make_params()
    expected = lion_reference(params, lr, betas, wd)
    run(cls(params, lr=lr, betas=betas, weight_decay=wd), params, range(STEPS))
    for p, e in zip(params, expected, strict=True):
        torch.testing.assert_close(p.detach(), e, rtol=1e-6, atol=1e-6)


def test_lion_default_betas_are_deepspeeds() -> None:
    assert FusedLion(make_params()).defaults["betas"] == (0.9, 0.999)
    assert DeepSpeedCPULion(make_params()).defaults["betas"] == (0.9, 0.999)


# --- LAMB ------------------------------------------------------------------------------------


def lamb_reference(
    params,
    *,
    lr,
    betas,
    eps,
    wd,
    eps_inside_sqrt,
    bias_correction,
    max_grad_norm,
    min_coeff,
    max_coeff,
):  # noqa: ANN001, ANN201 - test helper
    b1, b2 = betas
    w = [p.detach().clone() for p in params]
    m = [torch.zeros_like(p) for p in w]
    v = [torch.zeros_like(p) for p in w]
    for step in range(STEPS):
        t = step + 1
        grads = grads_for(step, w)
        norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads))
        if max_grad_norm > 0 and (norm + 1e-6) / max_grad_norm > 1:
            grads = [g / ((norm + 1e-6) / max_grad_norm) for g in grads]
        for i, g in enumerate(grads):
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            bc1, bc2 = (1 - b1**t, 1 - b2**t) if bias_correction else (1.0, 1.0)
            m_hat, v_hat = m[i] / bc1, v[i] / bc2
            denom = (v_hat + eps).sqrt() if eps_inside_sqrt else v_hat.sqrt() + eps
            u = m_hat / denom + wd * w[i]
            w_norm, u_norm = float(w[i].norm()), float(u.norm())
            ratio = 1.0
            if w_norm > 0 and u_norm > 0:
                ratio = min(max(w_norm / u_norm, min_coeff), max_coeff)
            w[i] = w[i] - lr * ratio * u
    return w


@pytest.mark.parametrize(
    "options",
    [
        dict(eps_inside_sqrt=False, bias_correction=True, max_grad_norm=0.0, wd=0.01),
        dict(eps_inside_sqrt=True, bias_correction=True, max_grad_norm=1.0, wd=0.0),
        dict(eps_inside_sqrt=False, bias_correction=False, max_grad_norm=0.5, wd=0.1),
    ],
)
def test_lamb_matches_reference(options: dict) -> None:
    hyper = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-6, min_coeff=0.01, max_coeff=0.3)
    params = make_params()
    expected = lamb_reference(params, **hyper, **options)
    opt = FusedLamb(
        params,
        lr=hyper["lr"],
        betas=hyper["betas"],
        eps=hyper["eps"],
        eps_inside_sqrt=options["eps_inside_sqrt"],
        bias_correction=options["bias_correction"],
        weight_decay=options["wd"],
        max_grad_norm=options["max_grad_norm"],
        min_coeff=hyper["min_coeff"],
        max_coeff=hyper["max_coeff"],
    )
    run(opt, params, range(STEPS))
    for p, e in zip(params, expected, strict=True):
        torch.testing.assert_close(p.detach(), e, rtol=1e-5, atol=1e-6)
    coeffs = opt.get_lamb_coeffs()
    assert len(coeffs) == len(SHAPES)
    assert all(hyper["min_coeff"] <= c <= hyper["max_coeff"] for c in coeffs)


# --- precision and state ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: DeepSpeedCPUAdam(ps, lr=1e-2, weight_decay=0.1),
        lambda ps: DeepSpeedCPULion(ps, lr=1e-2),
        lambda ps: DeepSpeedCPUAdagrad(ps, lr=1e-2),
    ],
)
def test_bf16_params_keep_fp32_state(make: Callable) -> None:
    params = make_params(torch.bfloat16)
    master = [torch.nn.Parameter(p.detach().float()) for p in params]
    opt, ref = make(params), make(master)
    for step in range(3):
        grads = grads_for(step, master)
        for p, q, g in zip(params, master, grads, strict=True):
            p.grad, q.grad = g.bfloat16(), g.bfloat16().float()
        opt.step()
        ref.step()
        with torch.no_grad():  # the reference also sees bf16-rounded weights
            for p, q in zip(params, master, strict=True):
                q.copy_(p.float())
    for p in params:
        assert p.dtype == torch.bfloat16
        for key, value in opt.state[p].items():
            if key != "step":
                assert value.dtype == torch.float32, key
    for p, q in zip(params, master, strict=True):
        state, ref_state = opt.state[p], ref.state[q]
        for key in state:
            torch.testing.assert_close(state[key], ref_state[key], rtol=1e-6, atol=1e-7)


def test_fp32_optimizer_states_false_keeps_param_dtype() -> None:
    params = make_params(torch.bfloat16)
    opt = DeepSpeedCPUAdam(params, fp32_optimizer_states=False)
    run(opt, params, range(2))
    assert opt.state[params[0]]["exp_avg"].dtype == torch.bfloat16
    fused = FusedAdam(make_params(torch.bfloat16))
    run(fused, fused.param_groups[0]["params"], range(2))
    assert all(s["exp_avg_sq"].dtype == torch.bfloat16 for s in fused.state.values())


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.1),
        lambda ps: DeepSpeedCPUAdam(ps, lr=1e-2, adamw_mode=False, weight_decay=0.1),
        lambda ps: FusedLamb(ps, lr=1e-2, weight_decay=0.01),
        lambda ps: FusedLion(ps, lr=1e-3),
        lambda ps: DeepSpeedCPUAdagrad(ps, lr=1e-2),
    ],
)
def test_state_dict_round_trip_continues_identically(make: Callable) -> None:
    a = make_params()
    opt_a = make(a)
    run(opt_a, a, range(4))
    saved_params = [p.detach().clone() for p in a]
    saved_state = copy.deepcopy(opt_a.state_dict())
    run(opt_a, a, range(4, 8))

    b = [torch.nn.Parameter(p.clone()) for p in saved_params]
    opt_b = make(b)
    opt_b.load_state_dict(saved_state)
    run(opt_b, b, range(4, 8))
    for pa, pb in zip(a, b, strict=True):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)


def test_param_groups_and_torch_scheduler() -> None:
    params = make_params()
    opt = FusedAdam([{"params": params[:1], "lr": 0.1}, {"params": params[1:]}], lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    run(opt, params, range(1))
    sched.step()
    assert [g["lr"] for g in opt.param_groups] == [0.05, 0.005]
    assert isinstance(opt, torch.optim.Optimizer)


def test_closure_and_params_without_grad() -> None:
    params = make_params()
    before = params[1].detach().clone()
    opt = FusedAdam(params, lr=0.1)
    params[0].grad = torch.ones_like(params[0])
    assert opt.step(closure=lambda: 3.0) == 3.0
    assert torch.equal(params[1].detach(), before)
    assert params[1] not in opt.state


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_fused_adam_cuda_matches_torch(adam_w_mode: bool) -> None:
    torch_cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    a = [torch.nn.Parameter(p.detach().cuda()) for p in make_params()]
    b = [torch.nn.Parameter(p.detach().cuda()) for p in make_params()]
    ours = FusedAdam(a, lr=1e-2, weight_decay=0.1, adam_w_mode=adam_w_mode)
    theirs = torch_cls(b, lr=1e-2, weight_decay=0.1, fused=True)
    run(ours, a, range(STEPS))
    run(theirs, b, range(STEPS))
    for pa, pb in zip(a, b, strict=True):
        torch.testing.assert_close(pa, pb)


def test_deepcopy_keeps_mode_flags() -> None:
    opt = DeepSpeedCPUAdam(make_params(), adamw_mode=False, fp32_optimizer_states=False)
    run(opt, opt.param_groups[0]["params"], range(1))
    clone = copy.deepcopy(opt)
    assert clone.adamw_mode is False and clone.fp32_optimizer_states is False
    lamb = copy.deepcopy(FusedLamb(make_params(), eps_inside_sqrt=True))
    assert lamb.eps_mode == 0
