"""Rank-side code of the qgZ / LoCo tests (sent to a pool of 4 gloo ranks): the quantized
reduce-scatter called directly with known inputs, and a few ZeRO-3 steps of the small GPT
with the bytes each collective moved and the gradient buckets' sizes."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

import shardspeed
from examples.gpt_model import GPT
from shardspeed import comm
from shardspeed.runtime.zero.comm_group import CommGroup
from shardspeed.runtime.zero.zeropp import LocoSettings, ZeroPP
from tests.runtime.zeropp.ranks import SMALL_GPT, batch, config, node_size

#: elements of each rank's chunk in the direct calls (not a whole number of 256-blocks)
CHUNK = 300

_GROUPS: dict[str, CommGroup] = {}


def node_groups() -> tuple[CommGroup, CommGroup]:
    """This rank's node group (ranks 2g, 2g+1) and cross group (ranks l, l+2), made once per
    rank process (every rank creates every group, in the same order)."""
    if not _GROUPS:
        for name, members in (("local", [[0, 1], [2, 3]]), ("cross", [[0, 2], [1, 3]])):
            for ranks in members:
                group = comm.new_group(ranks=ranks)
                if comm.get_rank() in ranks:
                    _GROUPS[name] = CommGroup.of(group)
    return _GROUPS["local"], _GROUPS["cross"]


def qgz_group(two_levels: bool, loco: LocoSettings | None = None) -> CommGroup:
    """The world as a stage-3 shard group with qgZ on (two levels: 2 nodes of 2 ranks)."""
    local, cross = node_groups() if two_levels else (None, None)
    settings = ZeroPP(quantized_gradients=True, local=local, cross=cross, loco=loco)
    return dataclasses.replace(CommGroup.of(None), zeropp=settings)


def source_of(rank: int, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rank ``rank``'s known input: values of very different sizes across the chunks."""
    generator = torch.Generator().manual_seed(100 + rank)
    values = torch.randn(numel, generator=generator) * torch.linspace(0.1, 4.0, numel)
    return values.to(dtype)


def reduce_once(
    group: CommGroup, source: torch.Tensor, key: Any = 0, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, dict[str, Any]]:
    """One reduce-scatter of ``source`` through ``group`` (async handle waited on), and the
    bytes it moved by group size."""
    output = torch.empty(source.numel() // group.world_size, dtype=dtype or source.dtype)
    comm.reset_comm_volume()
    work = group.reduce_scatter(output, source, async_op=True, key=key)
    work.wait()
    return output, comm.get_comm_volume(by_group_size=True)


def direct_calls(two_levels: bool) -> dict[str, Any]:
    """Plain qgZ on known inputs: an fp32 and a bf16 call, then one with an inf on rank 1."""
    rank, world = comm.get_rank(), comm.get_world_size()
    group = qgz_group(two_levels)
    numel = CHUNK * world
    result: dict[str, Any] = {}
    result["fp32"], result["volume"] = reduce_once(group, source_of(rank, numel))
    result["bf16"], _ = reduce_once(group, source_of(rank, numel, torch.bfloat16))
    overflow = source_of(rank, numel)
    if rank == 1:
        overflow[3 * CHUNK + 7] = float("inf")  # rank 3's chunk, element 7
    result["overflow"], _ = reduce_once(group, overflow)
    return result


def repeated_calls(
    two_levels: bool, calls: int, loco: LocoSettings | None, key: Any = "w"
) -> dict[str, Any]:
    """``calls`` reductions of the same input under one key; every output, and LoCo's buffers
    after each call."""
    rank, world = comm.get_rank(), comm.get_world_size()
    group = qgz_group(two_levels, loco)
    source = source_of(rank, CHUNK * world)
    outputs, buffers = [], []
    for _ in range(calls):
        output, _ = reduce_once(group, source, key=key)
        outputs.append(output)
        assert group.zeropp is not None
        feedback = group.zeropp.errors.get(key)
        if feedback is not None:
            buffers.append([b.clone() for b in feedback.buffers if b is not None])
    return {"outputs": outputs, "buffers": buffers}


def loco_after_overflow() -> dict[str, Any]:
    """LoCo over two levels: a call with an inf on rank 1, then a clean one: the buffers stay
    finite and the clean call's result is finite."""
    rank, world = comm.get_rank(), comm.get_world_size()
    group = qgz_group(True, LocoSettings(0.8, 100))
    source = source_of(rank, CHUNK * world)
    overflow = source.clone()
    if rank == 1:
        overflow[3 * CHUNK + 7] = float("inf")
    first, _ = reduce_once(group, source)
    second, _ = reduce_once(group, overflow)
    assert group.zeropp is not None
    feedback = group.zeropp.errors[0]
    finite = all(bool(torch.isfinite(b).all()) for b in feedback.buffers if b is not None)
    third, _ = reduce_once(group, source)
    return {"first": first, "overflow": second, "finite_buffers": finite, "after": third}


def train_steps(
    zeropp: dict[str, Any], steps: int, node: int = 2, reload: str | None = None
) -> dict[str, Any]:
    """The small GPT's ZeRO-3 steps with ``zeropp`` (as ``ranks.train``); per step the loss
    and the bytes moved by group size; the gradient buckets' padded sizes; LoCo's buffer
    bytes (and with ``reload``, a directory: how many keys hold buffers after saving and
    loading a checkpoint there)."""
    torch.manual_seed(0)
    with node_size(node):
        engine, *_ = shardspeed.initialize(model=GPT(SMALL_GPT), config=config(zeropp))
    record: dict[str, Any] = {"loss": [], "volume": []}
    for step in range(steps):
        tokens = batch(step, 2)
        comm.reset_comm_volume()
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        record["volume"].append(comm.get_comm_volume(by_group_size=True))
        record["loss"].append(loss.item())
    groups = engine.strategy.groups
    record["buckets"] = [b.size for g in groups for b in g.buckets.buckets]
    zpp = groups[0].comm.zeropp
    record["error_bytes"] = sum(f.nbytes() for f in zpp.errors.values()) if zpp else 0
    if reload is not None and zpp is not None:
        engine.save_checkpoint(reload, tag="loco")
        engine.load_checkpoint(reload, tag="loco")
        record["errors_after_load"] = len(zpp.errors)
    engine.destroy()
    return record
