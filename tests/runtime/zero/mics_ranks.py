"""Rank side of the MiCS tests."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import shardspeed
from examples.gpt_model import GPT
from shardspeed.runtime.zero.records import record_of
from tests.runtime.parity import TINY_GPT, run_parity, train_global_losses

MICS = {"zero_optimization": {"mics_shard_size": 2, "reduce_bucket_size": 3000}}


def parity(kind: str, gas: int, clip: float) -> list[float]:
    """MiCS (shard groups of 2 ranks) against the single-process reference, step by step."""
    return run_parity(kind, gas, clip, steps=8, stage=3, config_extra=MICS, atol=1e-5)


def shard_bytes() -> dict[str, Any]:
    """Each rank holds 1/shard_size of every parameter (not 1/world), and its gradient shard."""
    torch.manual_seed(0)
    model = GPT(TINY_GPT)
    total = sum(p.numel() for p in model.parameters())
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "mics_shard_size": 2},
    }
    engine, *_ = shardspeed.initialize(model=model, config=config)
    held = 0
    for param in model.parameters():
        record = record_of(param)
        assert record is not None and record.unit is not None
    for unit in engine.strategy.sharding.units:
        held += sum(flat.shard.numel() for flat in unit.flats)
    engine.destroy()
    return {"total": total, "held": held, "world": dist.get_world_size()}


def built_by_mics_init() -> tuple[list[float], list[float], float]:
    """A GPT built under zero.MiCS_Init holds half of each parameter per rank (groups of 2 of
    4 ranks) and then trains under MiCS as the same GPT built whole trains at stage 0."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-6}},
        "zero_optimization": {"stage": 3, "mics_shard_size": 2},
    }
    torch.manual_seed(0)
    with shardspeed.zero.MiCS_Init(config_dict_or_path=config):
        model = GPT(TINY_GPT)
    # a rank's pieces of all parameters (a small one may sit whole in one rank's chunk)
    held = sum(p.ds_tensor.numel() for p in model.parameters())  # type: ignore[attr-defined]
    fraction = held / sum(p.ds_numel for p in model.parameters())  # type: ignore[attr-defined]
    engine, *_ = shardspeed.initialize(model=model, config=config)
    mics = train_global_losses(engine, TINY_GPT, 4, seed=3)
    engine.destroy()
    torch.manual_seed(0)
    plain = {**config, "zero_optimization": {"stage": 0}}
    engine, *_ = shardspeed.initialize(model=GPT(TINY_GPT), config=plain)
    reference = train_global_losses(engine, TINY_GPT, 4, seed=3)
    engine.destroy()
    return mics, reference, fraction
