"""Code the 2-rank tests run on every rank (module level, so the pool can pickle it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import shardspeed
import shardspeed.checkpointing as ckpt
from examples.gpt_model import GPT, GPTConfig, synthetic_tokens
from shardspeed import comm
from shardspeed.runtime.activation_checkpointing import partition, state
from shardspeed.utils import safe_get_full_grad
from tests.runtime.activation_checkpointing.models import (
    Checkpointed,
    assert_same,
    count_saved,
    deep_mlp,
    grads,
)


class WorldMPU:
    """The whole world as one model-parallel group (and a data-parallel group of one)."""

    def get_model_parallel_group(self) -> Any:
        return comm.get_world_group()

    def get_model_parallel_world_size(self) -> int:
        return comm.get_world_size()

    def get_model_parallel_rank(self) -> int:
        return comm.get_rank()


def _fresh() -> None:
    state._SETTINGS = state.CheckpointingSettings()
    ckpt.reset()
    ckpt.reset_stats()
    ckpt.get_cuda_rng_tracker().reset()


def _mlp_run(shape: tuple[int, ...], options: dict[str, Any] | None) -> dict[str, Any]:
    _fresh()
    if options is not None:
        ckpt.configure(WorldMPU(), **options)
    ckpt.model_parallel_cuda_manual_seed(5)
    torch.manual_seed(0)  # same weights, input and dropout masks on both ranks
    width = shape[-1]
    blocks = deep_mlp(width, 3, dropout=0.25)
    model = nn.Sequential(*blocks)
    x = torch.randn(*shape, requires_grad=True)
    torch.manual_seed(1)
    with count_saved(model) as saved:
        h = x
        for block in blocks:
            h = ckpt.checkpoint(block, h) if options is not None else block(h)
    h.square().sum().backward()
    return {
        "grads": [x.grad, *(p.grad for p in model.parameters())],
        "saved_bytes": saved["bytes"],
        "devices": saved["devices"],
        "stats": ckpt.get_stats(),
        "buffer_bytes": partition.contiguous_buffers().allocated_bytes(),
    }


def partitioned_vs_plain(shape: tuple[int, ...], options: dict[str, Any]) -> dict[str, Any]:
    """Plain checkpointing and the ``options`` run on this rank; grads must match exactly."""
    plain = _mlp_run(shape, {})
    split = _mlp_run(shape, options)
    for a, b in zip(plain["grads"], split["grads"], strict=True):
        assert torch.equal(a, b), f"max diff {(a - b).abs().max().item():.3e}"
    _fresh()
    return {
        "plain_bytes": plain["saved_bytes"],
        "split_bytes": split["saved_bytes"],
        "devices": split["devices"],
        "partitioned": split["stats"].partitioned_tensors,
        "buffer_bytes": split["buffer_bytes"],
    }


TINY = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.1)
ENGINE_CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-6, "weight_decay": 0.01}},
    "activation_checkpointing": {
        "partition_activations": True,
        "cpu_checkpointing": True,
        "contiguous_memory_optimization": True,
        "number_checkpoints": TINY.n_layer,
        "synchronize_checkpoint_boundary": True,
    },
}


@dataclass
class GPTRun:
    """What one training run of the tiny GPT through the engine produced on this rank."""

    losses: list[torch.Tensor]
    #: ``.grad`` after the first micro-step, not reduced yet (empty when it is a boundary)
    local_grads: list[torch.Tensor]
    #: ``safe_get_full_grad`` of every parameter at the first accumulation boundary
    reduced_grads: list[torch.Tensor]
    params: list[torch.Tensor]
    stats: ckpt.CheckpointStats


def train_gpt(config: dict[str, Any], checkpointing: bool, mpu: Any, steps: int) -> GPTRun:
    """``steps`` optimizer steps of ``GPT(TINY)`` through ``shardspeed.initialize(config)``, its
    blocks checkpointed or not; ``configure(mpu, deepspeed_config=engine.config)`` when they are.

    Ranks of one model-parallel group of ``mpu`` form one data-parallel replica: they read the
    same batches and seed the default stream alike (``model_parallel_cuda_manual_seed``), so
    their activations (and dropout masks) agree and can be partitioned across them, as in
    Megatron. Replicas read different batches and draw different masks. Weights, data and masks
    do not depend on ``checkpointing``.
    """
    _fresh()
    torch.manual_seed(0)
    model = GPT(TINY)
    model.blocks = nn.ModuleList(Checkpointed(b, checkpointing) for b in model.blocks)
    engine, *_ = shardspeed.initialize(model=model, config=config)
    assert engine.zero_optimization_stage() == config.get("zero_optimization", {}).get("stage", 0)
    if checkpointing:
        ckpt.configure(mpu, deepspeed_config=engine.config)
    mp_size = 1 if mpu is None else mpu.get_model_parallel_world_size()
    replicas, replica = comm.get_world_size() // mp_size, comm.get_rank() // mp_size
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    tokens, targets = synthetic_tokens(steps * gas * micro * replicas, TINY, seed=3).tensors
    ckpt.model_parallel_cuda_manual_seed(100 + replica)
    run = GPTRun([], [], [], [], ckpt.get_stats())
    for micro_step in range(steps * gas):
        rows = slice((micro_step * replicas + replica) * micro, None)
        loss = engine(tokens[rows][:micro], targets[rows][:micro])
        engine.backward(loss)
        if micro_step == 0 and gas > 1:
            run.local_grads = grads(model)
        if micro_step == gas - 1:
            # a collective under ZeRO 1/2 (stage 2 keeps no full .grad): valid between the
            # reducing backward and step()
            reduced = [safe_get_full_grad(p) for p in model.parameters()]
            run.reduced_grads = [g for g in reduced if g is not None]
            assert len(run.reduced_grads) == len(reduced)
        engine.step()
        run.losses.append(loss.detach().clone())
    run.params = [p.detach().clone() for p in model.parameters()]
    run.stats = ckpt.get_stats()
    engine.destroy()
    _fresh()
    return run


def differences(reference: GPTRun, run: GPTRun) -> list[str]:
    """What ``run`` does not reproduce bitwise of ``reference`` (empty when nothing)."""
    found = []
    for what in ("losses", "local_grads", "reduced_grads", "params"):
        try:
            assert_same(getattr(reference, what), getattr(run, what))
        except AssertionError as error:
            found.append(f"{what}: {error}")
    return found


def engine_parity(steps: int) -> dict[str, Any]:
    """Train with and without checkpointing through the engine; compare step by step."""
    reference = train_gpt(ENGINE_CONFIG, False, None, steps)
    run = train_gpt(ENGINE_CONFIG, True, None, steps)
    stats = run.stats
    assert stats.checkpoints == steps * TINY.n_layer
    # every block input went through partition, contiguous buffer and host placement
    assert stats.partitioned_tensors == stats.offloaded_tensors == stats.checkpoints
    found = differences(reference, run)
    assert not found, found
    return {"losses": [loss.item() for loss in run.losses]}


#: ``activation_checkpointing`` sections of the GPT parity runs; partitioning spans the world
GPT_CHECKPOINTING: dict[str, dict[str, Any]] = {
    "plain": {},
    "partition": {"partition_activations": True},
    "cpu": {"cpu_checkpointing": True},
    "partition+cpu+contiguous": {
        "partition_activations": True,
        "cpu_checkpointing": True,
        "contiguous_memory_optimization": True,
        "number_checkpoints": TINY.n_layer,
    },
}


def gpt_checkpointing_parity(stage: int, steps: int) -> dict[str, dict[str, Any]]:
    """For every section of ``GPT_CHECKPOINTING``: train with it under ZeRO ``stage`` and compare
    bitwise with the same training without checkpointing. Returns, per section, the differences
    found and the checkpoint counters."""
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": ENGINE_CONFIG["optimizer"],
        "zero_optimization": {"stage": stage},
    }
    references: dict[bool, GPTRun] = {}
    results = {}
    for name, section in GPT_CHECKPOINTING.items():
        # Partitioning splits each block input across the model-parallel group, which must then
        # hold identical activations: all ranks form that group (one replica, same data and
        # masks) and data parallelism reduces over the same ranks. Without it every rank is a
        # replica of its own.
        partitioned = bool(section.get("partition_activations"))
        mpu = WorldMPU() if partitioned else None
        if partitioned not in references:
            references[partitioned] = train_gpt(config, False, mpu, steps)
        run = train_gpt({**config, "activation_checkpointing": section}, True, mpu, steps)
        stats = run.stats
        results[name] = {
            "differences": differences(references[partitioned], run),
            "checkpoints": stats.checkpoints,
            "recomputes": stats.recomputes,
            "partitioned": stats.partitioned_tensors,
            "offloaded": stats.offloaded_tensors,
        }
    return results


class SharedAcrossCheckpoint(nn.Module):
    """One linear layer called inside a checkpointed block and again outside it."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(ckpt.checkpoint(self.shared, x))
        return self.shared(h).square().mean()


def shared_param_across_checkpoint(stage: int) -> str:
    """The error a reducing backward raises when reentrant checkpointing accumulates a shared
    parameter's gradient twice ("" when it raises none)."""
    _fresh()
    torch.manual_seed(0)
    model = SharedAcrossCheckpoint()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": ENGINE_CONFIG["optimizer"],
        "zero_optimization": {"stage": stage},
    }
    engine, *_ = shardspeed.initialize(model=model, config=config)
    try:
        engine.backward(engine(torch.randn(2, 8)))
    except RuntimeError as error:
        return str(error)
    finally:
        engine.destroy()
        _fresh()
    return ""
