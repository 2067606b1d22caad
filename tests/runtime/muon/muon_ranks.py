"""Rank-side code of the Muon tests: the engine with ``"type": "Muon"`` against one process
stepping ``torch.optim.Muon`` (the tagged matrices) and ``torch.optim.AdamW`` (the rest) on the
whole global batch, and checkpoints moved between ZeRO stages."""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import shardspeed
from shardspeed.utils import safe_get_full_optimizer_state
from shardspeed.zero import GatheredParameters
from tests.runtime.parity import assert_close, make_task, rank_rows, reference_backward

MICRO = 2
MUON_LR, ADAM_LR, MOMENTUM, DECAY, EPS = 0.02, 1e-2, 0.9, 0.01, 1e-6
BETAS = (0.9, 0.95)


def muon_config(stage: int, placement: str = "round_robin", **extra: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "type": "Muon",
            "params": {
                "lr": ADAM_LR,
                "muon_lr": MUON_LR,
                "momentum": MOMENTUM,
                "weight_decay": DECAY,
                "betas": list(BETAS),
                "eps": EPS,
                "ns_placement": placement,
            },
        },
        "zero_optimization": {"stage": stage, **extra.pop("zero", {})},
        **extra,
    }


def is_hidden_matrix(name: str, param: torch.Tensor) -> bool:
    """DeepSpeed's tagging rule, written out independently of shardspeed's."""
    return param.dim() >= 2 and "embed" not in name.lower() and "lm_head" not in name.lower()


def reference_optimizers(model: nn.Module) -> tuple[torch.optim.Muon, torch.optim.AdamW]:
    named = list(model.named_parameters())
    matrices = [p for n, p in named if is_hidden_matrix(n, p)]
    rest = [p for n, p in named if not is_hidden_matrix(n, p)]
    muon = torch.optim.Muon(matrices, lr=MUON_LR, weight_decay=DECAY, momentum=MOMENTUM)
    adamw = torch.optim.AdamW(rest, lr=ADAM_LR, betas=BETAS, eps=EPS, weight_decay=DECAY)
    return muon, adamw


def _engine(model: nn.Module, stage: int, placement: str = "round_robin", **extra: Any) -> Any:
    engine, *_ = shardspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=muon_config(stage, placement, **extra),
    )
    return engine


def _train_step(engine: Any, x: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
    mine = rank_rows(step, 0, MICRO, 1)
    loss = engine(x[mine], y[mine])
    engine.backward(loss)
    engine.step()
    total = loss.detach().float().clone()
    dist.all_reduce(total)
    return total / dist.get_world_size()


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    with GatheredParameters(list(model.parameters())):  # stage 3 holds shards only
        return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def run_muon_parity(stage: int, steps: int = 10, placement: str = "round_robin") -> dict[str, Any]:
    """``steps`` steps of the engine at ZeRO ``stage`` against the torch reference; losses,
    every parameter and (matrices) the momentum buffers compared at every step."""
    world = dist.get_world_size()
    torch.manual_seed(0)
    task = make_task("gpt", rows=steps * MICRO * world)
    reference = task.build()
    model = copy.deepcopy(reference)
    engine = _engine(model, stage, placement)
    muon, adamw = reference_optimizers(reference)
    x, y = task.data
    tagged = {n: bool(p.use_muon) for n, p in model.named_parameters()}
    losses = []
    for step in range(steps):
        muon.zero_grad()
        adamw.zero_grad()
        ref_loss = reference_backward(reference, x, y, step, MICRO, 1, world)
        muon.step()
        adamw.step()
        loss = _train_step(engine, x, y, step)
        assert_close(loss, ref_loss.detach(), f"loss at step {step}", 1e-5, 1e-6)
        mine = _full_params(model)
        for name, q in reference.named_parameters():
            assert_close(mine[name], q.detach(), f"{name} at step {step}", 1e-5, 1e-6)
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            if tagged[name]:
                buf = safe_get_full_optimizer_state(p, "momentum_buffer")
                assert buf is not None, name
                expected = muon.state[q]["momentum_buffer"]
                assert_close(buf, expected, f"{name} momentum at step {step}", 1e-5, 1e-7)
        losses.append(loss.item())
    engine.destroy()
    return {"losses": losses, "tagged": tagged}


def run_resume_across_stages(folder: str, first: int, second: int, steps: int = 8) -> int:
    """Train ``steps`` steps at ``first`` saving a checkpoint half-way; a fresh engine at
    ``second`` loads it and its remaining steps equal the uninterrupted run's. Returns how
    many steps were compared."""
    world = dist.get_world_size()
    half = steps // 2
    torch.manual_seed(1)
    task = make_task("gpt", rows=steps * MICRO * world, seed=1)
    x, y = task.data
    start = task.build()
    uninterrupted = _engine(copy.deepcopy(start), first)
    expected: list[tuple[float, dict[str, torch.Tensor]]] = []
    for step in range(steps):
        if step == half:
            uninterrupted.save_checkpoint(folder, tag="half")
        loss = _train_step(uninterrupted, x, y, step)
        if step >= half:
            expected.append((loss.item(), _full_params(uninterrupted.module)))
    uninterrupted.destroy()

    torch.manual_seed(7)  # other initial weights: everything must come from the checkpoint
    resumed = _engine(task.build(), second)
    resumed.load_checkpoint(folder, tag="half")
    for step, (loss_then, params_then) in zip(range(half, steps), expected, strict=True):
        loss = _train_step(resumed, x, y, step)
        assert math.isclose(loss.item(), loss_then, rel_tol=1e-6), (step, loss.item(), loss_then)
        now = _full_params(resumed.module)
        for name, value in params_then.items():
            assert_close(now[name], value, f"{name} at step {step} after resume", 1e-6, 1e-7)
    resumed.destroy()
    return steps - half


def run_bf16_smoke(stage: int, steps: int = 12) -> list[float]:
    """bf16 training with Muon at ``stage``: finite losses that go down."""
    world = dist.get_world_size()
    torch.manual_seed(0)
    task = make_task("gpt", rows=steps * MICRO * world)
    engine = _engine(task.build(), stage, bf16={"enabled": True})
    x, y = task.data
    losses = [_train_step(engine, x, y, step).item() for step in range(steps)]
    engine.destroy()
    assert all(math.isfinite(v) for v in losses), losses
    return losses


def run_offload(stage: int, steps: int = 3) -> list[float]:
    """ZeRO-Offload (``offload_optimizer: cpu``) with Muon equals the run without it."""
    world = dist.get_world_size()
    results = []
    for offload in (False, True):
        torch.manual_seed(0)
        task = make_task("gpt", rows=steps * MICRO * world)
        zero = {"offload_optimizer": {"device": "cpu"}} if offload else {}
        engine = _engine(task.build(), stage, zero=zero)
        x, y = task.data
        for step in range(steps):
            _train_step(engine, x, y, step)
        results.append(_full_params(engine.module))
        engine.destroy()
    for name, value in results[0].items():
        assert_close(results[1][name], value, f"{name} with offload", 1e-6, 1e-7)
    return [float(len(results[0]))]


def run_nvme_offload(folder: str, in_memory: bool, steps: int = 3) -> list[str]:
    """ZeRO-3 with the optimizer state offloaded to NVMe (``folder``) and Muon: the same weights
    as without offload; returns the swap files' names (``save_muon_momentum_buffer_in_memory``
    decides whether the momentum buffers are among them)."""
    import os

    world = dist.get_world_size()
    results = []
    names: list[str] = []
    for offload in (False, True):
        torch.manual_seed(0)
        task = make_task("gpt", rows=steps * MICRO * world)
        zero: dict[str, Any] = {}
        if offload:
            zero = {
                "offload_optimizer": {"device": "nvme", "nvme_path": folder},
                "save_muon_momentum_buffer_in_memory": in_memory,
            }
        engine = _engine(task.build(), 3, zero=zero)
        x, y = task.data
        for step in range(steps):
            _train_step(engine, x, y, step)
        results.append(_full_params(engine.module))
        if offload:
            names = sorted(name for _, _, files in os.walk(folder) for name in files)
        engine.destroy()
    for name, value in results[0].items():
        assert_close(results[1][name], value, f"{name} with NVMe offload", 1e-6, 1e-7)
    return names
