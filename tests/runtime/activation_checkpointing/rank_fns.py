"""Code the 2-rank tests run on every rank (module level, so the pool can pickle it)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import shardspeed
import shardspeed.checkpointing as ckpt
from examples.gpt_model import GPT, GPTConfig, synthetic_tokens
from shardspeed import comm
from shardspeed.runtime.activation_checkpointing import partition, state
from tests.runtime.activation_checkpointing.models import Checkpointed, count_saved, deep_mlp


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


def _train(enabled: bool, steps: int) -> tuple[list[float], list[torch.Tensor], int]:
    _fresh()
    torch.manual_seed(0)
    model = GPT(TINY)
    model.blocks = nn.ModuleList(Checkpointed(b, enabled) for b in model.blocks)
    engine, *_ = shardspeed.initialize(model=model, config=ENGINE_CONFIG)
    if enabled:
        ckpt.configure(None, deepspeed_config=engine.config)
    data = synthetic_tokens(steps * 4 * comm.get_world_size(), TINY, seed=3)
    tokens, targets = data.tensors
    torch.manual_seed(100 + comm.get_rank())  # dropout differs per rank, same in both runs
    losses = []
    for step in range(steps):
        rows = slice((step * comm.get_world_size() + comm.get_rank()) * 4, None)
        loss = engine(tokens[rows][:4], targets[rows][:4])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    params = [p.detach().clone() for p in model.parameters()]
    stats = ckpt.get_stats()
    # every block input went through partition, contiguous buffer and host placement
    assert stats.partitioned_tensors == stats.offloaded_tensors == stats.checkpoints
    checkpoints = stats.checkpoints
    engine.destroy()
    _fresh()
    return losses, params, checkpoints


def engine_parity(steps: int) -> dict[str, Any]:
    """Train with and without checkpointing through the engine; compare step by step."""
    ref_losses, ref_params, _ = _train(False, steps)
    losses, params, checkpoints = _train(True, steps)
    assert checkpoints == steps * TINY.n_layer
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for p, q in zip(params, ref_params, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
    return {"losses": losses}
