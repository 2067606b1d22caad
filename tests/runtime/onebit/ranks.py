"""Rank-side code of the 1-bit optimizer tests (sent to a pool of gloo ranks)."""

from __future__ import annotations

import math
from typing import Any

import torch

import shardspeed
from examples.gpt_model import GPT, GPTConfig
from shardspeed import comm
from shardspeed.runtime.comm.compressed import CompressedBackend, padded_size
from tests.inference.models import VOCAB, structured_stream

SMALL_GPT = GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=1, n_head=2, n_embd=32)


def _signs(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= 0, 1.0, -1.0)


def _inputs(rank: int, numel: int, call: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(100 * call + rank))


def compressed_allreduce_case(numel: int, calls: int) -> dict[str, Any]:
    """Run ``calls`` compressed averages of known per-rank buffers and recompute each by hand
    (every rank knows every rank's inputs and keeps everyone's error buffers)."""
    world, rank = comm.get_world_size(), comm.get_rank()
    backend = CompressedBackend(None)
    n = padded_size(numel, world)
    chunk = n // world
    worker = torch.zeros(n)
    server = torch.zeros(chunk)
    ref_worker = [torch.zeros(n) for _ in range(world)]
    ref_server = [torch.zeros(chunk) for _ in range(world)]
    comm.reset_comm_volume()
    out: dict[str, Any] = {"equal": [], "worker_ok": [], "server_ok": []}
    for call in range(calls):
        mine = _inputs(rank, numel, call)
        result = backend.compressed_allreduce(mine.clone(), worker, server)
        # by hand: compensate, take signs and scales, average, compensate per chunk again
        compensated = []
        for r in range(world):
            c = torch.zeros(n)
            c[:numel] = _inputs(r, numel, call)
            c += ref_worker[r]
            compensated.append(c)
        scales = [torch.linalg.vector_norm(c) / math.sqrt(n) for c in compensated]
        for r in range(world):
            ref_worker[r] = compensated[r] - scales[r] * _signs(compensated[r])
        average = (
            torch.stack([_signs(c) for c in compensated])
            * (torch.stack(scales).reshape(world, 1) / world)
        ).sum(dim=0)
        expected = torch.empty(n)
        for j in range(world):
            part = average[j * chunk : (j + 1) * chunk] + ref_server[j]
            scale = torch.linalg.vector_norm(part) / math.sqrt(chunk)
            ref_server[j] = part - scale * _signs(part)
            expected[j * chunk : (j + 1) * chunk] = scale * _signs(part)
        out["equal"].append(torch.equal(result, expected[:numel]))
        out["worker_ok"].append(torch.equal(worker, ref_worker[rank]))
        out["server_ok"].append(torch.equal(server, ref_server[rank]))
        out["result"] = result
    out["volume"] = comm.get_comm_volume()
    comm.reset_comm_volume()
    return out


def compressed_allreduce_many_case(sizes: list[int], calls: int) -> dict[str, Any]:
    """``calls`` batched averages of buffers of ``sizes`` elements against one single-buffer
    call per buffer on copies of the same errors: results and errors bitwise equal? And the
    collectives each batched call issued."""
    world, rank = comm.get_world_size(), comm.get_rank()
    backend = CompressedBackend(None)
    workers = [torch.zeros(padded_size(k, world)) for k in sizes]
    servers = [torch.zeros(padded_size(k, world) // world) for k in sizes]
    ref_workers = [w.clone() for w in workers]
    ref_servers = [s.clone() for s in servers]
    out: dict[str, Any] = {"equal": [], "errors_equal": [], "ops": [], "bytes": []}
    for call in range(calls):
        inputs = [
            torch.randn(k, generator=torch.Generator().manual_seed(1000 * call + 10 * i + rank))
            for i, k in enumerate(sizes)
        ]
        singles, single_bytes = [], 0
        for x, w, s in zip(inputs, ref_workers, ref_servers, strict=True):
            comm.reset_comm_volume()
            singles.append(backend.compressed_allreduce(x.clone(), w, s))
            single_bytes += sum(v["bytes"] for v in comm.get_comm_volume().values())
        comm.reset_comm_volume()
        batched = backend.compressed_allreduce_many([x.clone() for x in inputs], workers, servers)
        volume = comm.get_comm_volume()
        out["ops"].append({op: v["count"] for op, v in volume.items()})
        out["bytes"].append((sum(v["bytes"] for v in volume.values()), single_bytes))
        out["equal"].append(all(torch.equal(a, b) for a, b in zip(batched, singles, strict=True)))
        out["errors_equal"].append(
            all(
                torch.equal(a, b)
                for a, b in zip(workers + servers, ref_workers + ref_servers, strict=True)
            )
        )
    comm.reset_comm_volume()
    return out


def _config(kind: str, params: dict[str, Any], micro: int, **extra: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": kind, "params": params},
        "zero_optimization": {"stage": 0},
        **extra,
    }


def _batch(step: int, micro: int) -> torch.Tensor:
    """This rank's share of global batch ``step`` of the structured stream."""
    tokens = structured_stream(micro * comm.get_world_size(), 17, seed=1000 + step)
    rank = comm.get_rank()
    return tokens[rank * micro : (rank + 1) * micro]


def train(
    kind: str,
    params: dict[str, Any],
    steps: int,
    micro: int = 4,
    seed: int = 0,
    save: tuple[str, int] | None = None,
    load: str | None = None,
    start: int = 0,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train the small GPT ``steps`` steps from ``start`` with optimizer ``kind``; per step the
    loss, whether the engine all-reduced gradients and the bytes each collective moved; the
    final parameters. ``save=(dir, after)`` checkpoints after that many steps; ``load`` resumes."""
    torch.manual_seed(seed)
    model = GPT(SMALL_GPT)
    engine, *_ = shardspeed.initialize(
        model=model, config=_config(kind, params, micro, **(extra or {}))
    )
    if load is not None:
        engine.load_checkpoint(load)
    record: dict[str, Any] = {"loss": [], "allreduce": [], "volume": [], "params": []}
    for step in range(start, start + steps):
        tokens = _batch(step, micro)
        comm.reset_comm_volume()
        record["allreduce"].append(engine.enable_backward_allreduce)
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        record["volume"].append(comm.get_comm_volume())
        record["loss"].append(loss.item())
        record["params"].append([p.detach().clone() for p in engine.module.parameters()])
        if save is not None and step + 1 == save[1]:
            engine.save_checkpoint(save[0], tag="onebit")
    engine.destroy()
    return record


def refused(config_extra: dict[str, Any], kind: str, params: dict[str, Any]) -> str:
    """The error message ``initialize`` raises for this setup (empty if none)."""
    torch.manual_seed(0)
    try:
        shardspeed.initialize(model=GPT(SMALL_GPT), config=_config(kind, params, 2, **config_extra))
    except ValueError as error:
        return f"{type(error).__name__}: {error}"
    return ""
