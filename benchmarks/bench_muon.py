"""Muon under ZeRO: the optimizer step's time with each way of orthogonalising sharded matrices.

ZeRO stages 1-3 hand the optimizer one flat chunk per rank, so Muon must see each matrix whole.
``gather``: all-gather the momentum update of the buffer, each rank orthogonalises the matrices
its chunk overlaps (a matrix spanning two chunks is done twice). ``round_robin``: all-gather,
matrix ``i`` is orthogonalised by rank ``i % world`` alone, a reduce-scatter returns the chunks
(one more collective, no duplicated Newton-Schulz). Stage 0 (whole matrices, every rank
orthogonalises every matrix) is the baseline.

    python benchmarks/bench_muon.py                       # 2 gloo ranks on the CPU
    python benchmarks/bench_muon.py --world 4 --width 512 --layers 8

Times ``engine.step()`` (gradient unscale/norm, the optimizer step, the parameter all-gather)
after a forward and backward, median over ``--steps``; prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import shardspeed  # noqa: E402


class Stack(nn.Module):
    """``layers`` square and rectangular hidden matrices (Muon) between two norms (AdamW)."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        blocks: list[nn.Module] = [nn.LayerNorm(width)]
        for _ in range(layers):
            blocks += [nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)]
        self.net = nn.Sequential(*blocks, nn.LayerNorm(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).pow(2).mean()


def _time_steps(stage: int, placement: str, args: argparse.Namespace) -> float:
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "Muon", "params": {"lr": 1e-3, "ns_placement": placement}},
        "zero_optimization": {"stage": stage},
    }
    model = Stack(args.width, args.layers)
    engine, *_ = shardspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    x = torch.randn(4, args.width)
    times = []
    for step in range(args.steps + 2):
        engine.backward(engine(x))
        dist.barrier()
        start = time.perf_counter()
        engine.step()
        dist.barrier()
        if step >= 2:  # warm-up
            times.append(time.perf_counter() - start)
    engine.destroy()
    return statistics.median(times) * 1e3


def _rank(rank: int, args: argparse.Namespace, port: int, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank))
    os.environ.update(WORLD_SIZE=str(args.world), LOCAL_RANK=str(rank))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    results = {"stage0_ms": _time_steps(0, "gather", args)}
    for stage in args.stages:
        for placement in args.placements:
            results[f"stage{stage}_{placement}_ms"] = _time_steps(stage, placement, args)
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--placements", nargs="+", default=["gather", "round_robin"])
    args = parser.parse_args()
    from tests.harness.distributed import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.spawn(_rank, args=(args, free_port(), queue), nprocs=args.world, join=True)
    results = queue.get()
    params = args.layers * 2 * (2 * args.width * args.width)
    line = {"bench": "muon", "world": args.world, "muon_params": params, **vars(args), **results}
    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in line.items()}))


if __name__ == "__main__":
    main()
