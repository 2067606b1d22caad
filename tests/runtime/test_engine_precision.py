"""fp16 loss scaling and bf16 master weights through the engine, on 2 real ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist

import shardspeed
from tests.runtime.parity import MLP


def _fp16_engine(hysteresis: int, window: int):
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "fp16": {
            "enabled": True,
            "initial_scale_power": 8,
            "hysteresis": hysteresis,
            "loss_scale_window": window,
            "min_loss_scale": 1,
        },
    }
    engine, *_ = shardspeed.initialize(model=MLP(width=8), config=config)
    return engine


def _train_step(engine, poison: bool) -> None:
    x = torch.randn(2, 8, dtype=torch.float16)
    y = torch.randn(2, 1, dtype=torch.float16)
    engine.backward(engine(x, y))
    if poison and dist.get_rank() == 1:
        # only rank 1 sees the overflow: every rank must still skip the step
        next(engine.module.parameters()).grad.view(-1)[0] = float("inf")
    engine.step()


def fp16_overflow_sequence() -> dict[str, list]:
    engine = _fp16_engine(hysteresis=2, window=3)
    scales, skipped, changed = [], [], []
    poison_at = {0, 1}
    for step in range(6):
        before = [p.detach().clone() for p in engine.module.parameters()]
        _train_step(engine, poison=step in poison_at)
        scales.append(engine.optimizer.loss_scale)
        skipped.append(engine.skipped_steps)
        changed.append(
            any(
                not torch.equal(b, p)
                for b, p in zip(before, engine.module.parameters(), strict=True)
            )
        )
    assert all(p.dtype == torch.float16 for p in engine.module.parameters())
    engine.destroy()
    return {"scales": scales, "skipped": skipped, "changed": changed}


def test_fp16_overflow_halves_after_hysteresis_and_skips_on_every_rank(dist_pool):
    results = dist_pool(2).run(fp16_overflow_sequence)
    assert results[0] == results[1]
    r = results[0]
    # step 0: overflow, hysteresis 2 -> 1, scale kept; step 1: overflow -> halve 256 -> 128;
    assert r["scales"][:2] == [256.0, 128.0]
    assert r["skipped"] == [1, 2, 2, 2, 2, 2]
    assert r["changed"] == [False, False, True, True, True, True]
    # last overflow at iteration 1, window 3: the scale doubles on iteration 1 + 3 + 1 = 5
    assert r["scales"][2:] == [128.0, 128.0, 128.0, 256.0]


def bf16_masters_follow() -> None:
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "bf16": {"enabled": True},
    }
    engine, *_ = shardspeed.initialize(model=MLP(width=8), config=config)
    masters = engine.optimizer.strategy.master_params()
    assert all(m.dtype == torch.float32 for m in masters)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(3):
        x = torch.randn(2, 8, generator=gen).bfloat16()
        y = torch.randn(2, 1, generator=gen).bfloat16()
        engine.backward(engine(x, y))
        engine.step()
    params = list(engine.module.parameters())
    assert all(p.dtype == torch.bfloat16 for p in params)
    for master, param in zip(masters, params, strict=True):
        assert torch.equal(master.to(torch.bfloat16), param)
    # masters hold more than bf16 can: small updates are kept in fp32
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in masters)
    # and the masters are identical on every rank
    flat = torch.cat([m.flatten() for m in masters])
    other = flat.clone()
    dist.broadcast(other, src=0)
    assert torch.equal(flat, other)
    engine.destroy()


def test_bf16_master_weights_are_fp32_and_model_follows(dist_pool):
    dist_pool(2).run(bf16_masters_follow)


def bf16_gradients_accumulate_in_fp32(grad_accum_dtype: str | None) -> dict[str, object]:
    """Stage 0, bf16, 4 micro-batches: the reduced gradient equals the fp32 sum of each
    micro-batch's bf16 gradient (DeepSpeed's bf16 default), or the bf16 running sum when
    ``data_types.grad_accum_dtype`` is "bf16"."""
    from shardspeed.utils import safe_get_full_grad

    torch.manual_seed(0)
    model = MLP(width=8)
    twin = MLP(width=8).bfloat16()
    twin.load_state_dict(model.state_dict())
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "bf16": {"enabled": True},
    }
    if grad_accum_dtype is not None:
        config["data_types"] = {"grad_accum_dtype": grad_accum_dtype}
    engine, *_ = shardspeed.initialize(model=model, config=config)
    gen = torch.Generator().manual_seed(dist.get_rank())
    expected = [torch.zeros_like(p, dtype=torch.float32) for p in twin.parameters()]
    for micro in range(4):
        x = torch.randn(2, 8, generator=gen).bfloat16()
        y = torch.randn(2, 1, generator=gen).bfloat16()
        twin.zero_grad()
        (twin(x, y) / 4).backward()
        for acc, p in zip(expected, twin.parameters(), strict=True):
            acc += p.grad.float()
        engine.backward(engine(x, y))
        bf16_grads_kept = [p.grad is not None for p in engine.module.parameters()]
        if micro < 3:
            engine.step()
    grads = [safe_get_full_grad(p) for p in engine.module.parameters()]
    for acc in expected:
        dist.all_reduce(acc)
        acc /= dist.get_world_size()
    engine.step()
    engine.destroy()
    return {
        "dtypes": sorted({str(g.dtype) for g in grads}),
        "kept": bf16_grads_kept,
        "max_err": max(
            (g.float() - e).abs().max().item() for g, e in zip(grads, expected, strict=True)
        ),
    }


def test_bf16_stage0_accumulates_gradients_in_fp32(dist_pool):
    pool = dist_pool(2)
    fp32 = pool.run(bf16_gradients_accumulate_in_fp32, None)[0]
    assert fp32["dtypes"] == ["torch.float32"]
    assert not any(fp32["kept"])  # each micro-batch's bf16 gradient is folded in and dropped
    assert fp32["max_err"] < 1e-6  # equals the fp32 sum of the bf16 micro-batch gradients
    bf16 = pool.run(bf16_gradients_accumulate_in_fp32, "bf16")[0]
    assert bf16["dtypes"] == ["torch.bfloat16"] and all(bf16["kept"])


def bad_grad_accum_dtype() -> str:
    try:
        shardspeed.initialize(
            model=MLP(width=8),
            config={
                "train_batch_size": 4,
                "optimizer": {"type": "AdamW", "params": {}},
                "data_types": {"grad_accum_dtype": "fp16"},
            },
        )
    except ValueError as err:
        return str(err)
    return ""


def test_unsupported_grad_accum_dtype_is_a_clear_error(dist_pool):
    message = dist_pool(2).run(bad_grad_accum_dtype)[0]
    assert "data_types.grad_accum_dtype=float16" in message and "float32" in message
