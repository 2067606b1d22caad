"""Rank-side code for the ZeRO stage 1/2 tests (run on every rank of a ``dist_pool``)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import shardspeed
from examples.gpt_model import GPT
from shardspeed import comm
from shardspeed.utils import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
    safe_set_local_grad,
    safe_update_full_grad_vectorized,
)
from shardspeed.zero import GatheredParameters
from tests.runtime.parity import MLP, TINY_GPT, adamw_config, assert_close, make_task, rank_rows

#: ZeRO-3 partitions every parameter (DeepSpeed's default keeps small ones gathered); the
#: key means nothing to the other stages
SHARD_ALL = {"stage3_param_persistence_threshold": 0}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def _precision(dtype: str) -> dict[str, Any]:
    if dtype == "fp16":
        return {"fp16": {"enabled": True, "initial_scale_power": 8}}
    if dtype == "bf16":
        # stage 0 accumulates bf16 gradients in fp32 by default (as DeepSpeed's bf16
        # optimizer); stages 1/2 default to the model dtype: compare like with like
        return {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}
    return {}


def _engine(
    model: nn.Module,
    stage: int,
    micro: int = 2,
    gas: int = 1,
    clip: float = 1.0,
    model_parameters: Any = None,
    **extra: Any,
) -> Any:
    zero = {"stage": stage, **extra.pop("zero", {})}
    config = adamw_config(micro, gas, clip, zero_optimization=zero, **extra)
    engine, *_ = shardspeed.initialize(
        model=model, model_parameters=model_parameters, config=config
    )
    return engine


def stage_vs_stage0_low_precision(stage: int, dtype: str, steps: int = 12) -> None:
    """fp16/bf16: stage ``stage`` and stage 0 (two engines side by side on the same data) agree
    within the dtype's tolerance at every step."""
    torch.manual_seed(0)
    task = make_task("gpt", rows=steps * 2 * dist.get_world_size())
    base = task.build()
    # no clipping: a partitioned norm rounds differently, and Adam turns one ulp of the clip
    # coefficient into a visible difference on near-zero gradients (tests/runtime/parity.py)
    engines = [
        _engine(
            copy.deepcopy(base),
            s,
            clip=0.0,
            zero={"reduce_bucket_size": 2000, **SHARD_ALL},
            **_precision(dtype),
        )
        for s in (0, stage)
    ]
    x, y = task.data
    rtol = {"fp16": 5e-3, "bf16": 2e-2}[dtype]
    for step in range(steps):
        rows = rank_rows(step, 0, 2, 1)
        losses = []
        for engine in engines:
            loss = engine(x[rows], y[rows])
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach().float())
        assert_close(losses[1], losses[0], f"loss at step {step}", rtol, rtol)
        with GatheredParameters(list(engines[1].module.parameters())):
            for (name, p), q in zip(
                engines[1].module.named_parameters(), engines[0].module.parameters(), strict=True
            ):
                assert p.dtype == DTYPES[dtype]
                # both step fp32 masters; the model copies may differ by one low-precision ulp
                assert_close(p.detach(), q.detach(), f"{name} at step {step}", rtol, rtol)
        master = safe_get_full_fp32_param(next(engines[1].module.parameters()))
        assert master is not None and master.dtype == torch.float32
    for engine in engines:
        engine.destroy()


def no_sync_equals_accumulation(stage: int, steps: int = 6) -> None:
    """``no_sync()`` for the first micro-batch of each step == the engine's own accumulation."""
    torch.manual_seed(0)
    task = make_task("gpt", rows=steps * 2 * 2 * dist.get_world_size())
    base = task.build()
    accumulate = _engine(copy.deepcopy(base), stage, gas=2, zero=SHARD_ALL)
    manual = _engine(copy.deepcopy(base), stage, gas=1, zero=SHARD_ALL)
    x, y = task.data
    for step in range(steps):
        for micro_step in range(2):
            rows = rank_rows(step, micro_step, 2, 2)
            loss = accumulate(x[rows], y[rows])
            accumulate.backward(loss)
            accumulate.step()
            if micro_step == 0:
                with manual.no_sync():
                    manual.backward(manual(x[rows], y[rows]) / 2)
            else:
                manual.backward(manual(x[rows], y[rows]) / 2)
                manual.step()
        params = [*accumulate.module.parameters(), *manual.module.parameters()]
        with GatheredParameters(params):
            for p, q in zip(
                accumulate.module.parameters(), manual.module.parameters(), strict=True
            ):
                assert_close(p.detach(), q.detach(), f"param at step {step}", 1e-5, 1e-6)
    for engine in (accumulate, manual):
        engine.destroy()


def comm_bus_bytes_per_step(
    stage: int, gas: int, steps: int = 3, zero: dict[str, Any] | None = None
) -> dict[str, float]:
    """Bus bytes this rank moved per optimizer step (after one warm-up step), and Ψ."""
    torch.manual_seed(0)
    model = MLP(width=64, depth=4)
    zero = {"reduce_bucket_size": 3000, **SHARD_ALL, **(zero or {})}
    engine = _engine(model, stage, gas=gas, zero=zero)
    x, y = torch.randn(2, 64), torch.randn(2, 1)

    def one_step() -> None:
        for _ in range(gas):
            engine.backward(engine(x, y))
            engine.step()

    one_step()
    comm.reset_comm_volume()
    for _ in range(steps):
        one_step()
    volume = comm.get_comm_volume()
    engine.destroy()
    return {
        "bus_bytes": sum(v["bus_bytes"] for v in volume.values()) / steps,
        "params": float(sum(p.numel() for p in model.parameters())),
        "ops": float(len(volume)),
    }


def _numel_outside(tensors: list[torch.Tensor], buffers: list[torch.Tensor]) -> int:
    """Elements of ``tensors`` whose memory is not one of ``buffers``."""
    owned = {b.untyped_storage().data_ptr() for b in buffers}
    return sum(t.numel() for t in tensors if t.untyped_storage().data_ptr() not in owned)


def memory_accounting(stage: int) -> dict[str, int]:
    """Element counts of what this rank holds after a boundary backward and after a step."""
    torch.manual_seed(0)
    model = GPT(TINY_GPT)
    engine = _engine(model, stage, zero={"reduce_bucket_size": 4000, "overlap_comm": True})
    (group,) = engine.strategy.groups  # one shard group: the data-parallel one
    x = torch.randint(TINY_GPT.vocab_size, (2, TINY_GPT.block_size))
    engine.backward(engine(x, x))
    held_model_grads = sum(p.grad.numel() for p in model.parameters() if p.grad is not None)
    bucket_buffers = sum(b.size for b in group.buckets.buckets if b.buffer is not None)
    spare_buffers = group.buckets.spare_numel()
    grad_chunks = [g for g in group.grad_chunks if g is not None]
    grad_buffers = [b.buffer for b in group.buckets.buckets if b.buffer is not None]
    engine.step()
    # stage 2 frees its gradient chunks with the step's zero_grad
    grads_after_step = sum(g.numel() for g in group.grad_chunks if g is not None)
    state_elems = {
        key: sum(s[key].numel() for s in engine.optimizer.state.values())
        for key in ("exp_avg", "exp_avg_sq")
    }
    result = {
        "params": sum(p.numel() for p in model.parameters()),
        "model_grads": held_model_grads,
        "bucket_buffers_after_backward": bucket_buffers,
        "spare_bucket_buffers": spare_buffers,
        "grad_partition": sum(g.numel() for g in grad_chunks),
        # reduced-gradient chunks with memory of their own (stage 1 reduces into its chunk of
        # the full gradient buffers)
        "grad_partition_copies": _numel_outside(grad_chunks, grad_buffers),
        "grad_partition_after_step": grads_after_step,
        "master_partition": sum(m.numel() for m in group.master_chunks),
        # masters that are not the model's own memory (fp32 steps the parameter chunks)
        "master_copies": _numel_outside(group.master_chunks, group.flat_params.buffers),
        # parameters not stored in the flat buffers
        "params_outside_flat": _numel_outside(list(model.parameters()), group.flat_params.buffers),
        "exp_avg": state_elems["exp_avg"],
        "exp_avg_sq": state_elems["exp_avg_sq"],
        "world": dist.get_world_size(),
    }
    engine.destroy()
    return result


def _train(engine: Any, task: Any, steps: range, gas: int) -> list[float]:
    x, y = task.data
    losses = []
    for step in steps:
        for micro_step in range(gas):
            rows = rank_rows(step, micro_step, 2, gas)
            loss = engine(x[rows], y[rows])
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
    return losses


def checkpoint_resume(stage: int, folder: str, dtype: str = "fp32") -> None:
    """Train 6 steps; save at 3; a fresh engine resumed from the save continues identically."""
    gas = 2
    torch.manual_seed(0)
    task = make_task("gpt", rows=6 * 2 * gas * dist.get_world_size())
    base = task.build()
    extra = {"zero": {"reduce_bucket_size": 3000}, **_precision(dtype)}
    first = _engine(copy.deepcopy(base), stage, gas=gas, **copy.deepcopy(extra))
    _train(first, task, range(3), gas)
    first.save_checkpoint(folder, tag="mid")
    tail = _train(first, task, range(3, 6), gas)
    files = sorted(p.name for p in (Path(folder) / "mid").iterdir())
    torch.manual_seed(123)
    second = _engine(task.build(), stage, gas=gas, **copy.deepcopy(extra))
    path, _ = second.load_checkpoint(folder)
    assert path is not None and second.global_steps == 3
    resumed = _train(second, task, range(3, 6), gas)
    assert resumed == tail, (resumed, tail)
    for p, q in zip(first.module.parameters(), second.module.parameters(), strict=True):
        assert torch.equal(p, q)
    shard = first.optimizer.strategy.checkpoint_shard_name()
    assert shard is None or shard in files, files
    for engine in (first, second):
        engine.destroy()


def accessors(stage: int) -> None:
    """The safe_* utilities read and write the partitioned state of every stage consistently."""
    torch.manual_seed(0)
    model = MLP(width=8)
    reference = copy.deepcopy(model)
    engine = _engine(model, stage, zero={"reduce_bucket_size": 50, **SHARD_ALL})
    params = list(model.parameters())
    rank = dist.get_rank()
    for p, q in zip(params, reference.parameters(), strict=True):
        assert torch.equal(safe_get_full_fp32_param(p), q.detach())
    x, y = torch.randn(2, 8), torch.randn(2, 1)
    engine.backward(engine(x, y))
    # the full gradient is the all-ranks average; every rank gets the same tensor
    grads = [safe_get_full_grad(p) for p in params]
    for grad in grads:
        gathered = [torch.zeros_like(grad) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, grad)
        assert all(torch.equal(g, grad) for g in gathered)
    local = safe_get_local_grad(params[0])
    assert local is not None and local.numel() <= params[0].numel()
    safe_set_local_grad(params[0], torch.full_like(local, float(rank)))
    safe_set_full_grad(params[1], torch.ones_like(params[1]))
    assert torch.equal(safe_get_full_grad(params[1]), torch.ones_like(params[1]))
    safe_update_full_grad_vectorized(params[2:], lambda gs: [g * 0 for g in gs])
    assert all(torch.count_nonzero(safe_get_full_grad(p)) == 0 for p in params[2:])
    engine.step()
    for p in params[2:]:  # zero gradient: AdamW only decays; the moments stay zero
        assert torch.count_nonzero(safe_get_full_optimizer_state(p, "exp_avg")) == 0
    value = torch.arange(params[1].numel(), dtype=torch.float32).view_as(params[1])
    safe_set_full_fp32_param(params[1], value)
    assert torch.equal(safe_get_full_fp32_param(params[1]), value)
    with GatheredParameters(params[1]):  # stage 3 holds shards
        assert torch.equal(params[1].detach(), value)
    local_master = safe_get_local_fp32_param(params[1])
    assert local_master is not None and local_master.numel() <= value.numel()
    safe_set_full_optimizer_state(params[1], value * 2, "exp_avg")
    assert torch.equal(safe_get_full_optimizer_state(params[1], "exp_avg"), value * 2)
    engine.destroy()


def config_error(stage: int, case: str) -> str:
    """The message of the error engine construction raises for ``case``."""
    model = MLP(width=8)
    config = adamw_config(2, 1, 0.0, zero_optimization={"stage": stage})
    optimizer = None
    if case == "quantized":
        config["zero_optimization"]["zero_quantized_gradients"] = True
    elif case == "offload":
        # NVMe offload with no folder to swap to
        config["zero_optimization"]["offload_optimizer"] = {"device": "nvme"}
    elif case in ("untested", "untested_allowed"):
        del config["optimizer"]
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        config["zero_allow_untested_optimizer"] = case == "untested_allowed"
    try:
        engine, *_ = shardspeed.initialize(model=model, optimizer=optimizer, config=config)
    except (ValueError, NotImplementedError) as err:
        return str(err)
    engine.backward(engine(torch.randn(2, 8), torch.randn(2, 1)))
    engine.step()
    engine.destroy()
    return ""


def fp16_overflow_skips_everywhere(stage: int) -> list[float]:
    """An inf in one rank's gradient partition skips the step on every rank."""
    torch.manual_seed(0)
    engine = _engine(MLP(width=8), stage, zero=SHARD_ALL, **_precision("fp16"))
    params = list(engine.module.parameters())
    with GatheredParameters(params):
        before = [p.detach().clone() for p in params]
    x, y = torch.randn(2, 8, dtype=torch.float16), torch.randn(2, 1, dtype=torch.float16)
    engine.backward(engine(x, y))
    first = next(engine.module.parameters())
    local = safe_get_local_grad(first)
    if dist.get_rank() == 1 and local is not None and local.numel():
        safe_set_local_grad(first, torch.full_like(local, float("inf")))
    engine.step()
    assert engine.skipped_steps == 1
    with GatheredParameters(params):
        for b, p in zip(before, params, strict=True):
            assert torch.equal(b, p)
    scale = engine.optimizer.loss_scale
    engine.destroy()
    return [scale]
