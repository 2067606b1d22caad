"""Pipeline parallelism: shardspeed's PipelineEngine (1F1B) vs ``torch.distributed.pipelining``
``Schedule1F1B`` on the same layers, same ranks, one alternating run.

    python benchmarks/bench_pipe.py                      # 2 and 4 stages, 8 micro-batches, CPU

One rank per stage (no data parallelism); the model is ``--layers`` equal transformer blocks on
float inputs with an MSE loss (stages balanced: ``partition_method="uniform"``), AdamW. For each
stage count the ranks start once and alternate the two modes step by step after a warm-up, so
both see the same machine state. Reports samples/s (global batch / median step time) of each,
their ratio, the loss of each after the same steps (same initial weights and data, so they
agree), and shardspeed's measured bubble fraction: per stage, 1 - (forward + backward time) /
(time in the schedule before the gradient reduction and optimizer step), averaged over stages,
beside the theoretical (p-1)/(m+p-1). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_train import init_rank, spawn_ranks  # noqa: E402

from examples.gpt_model import Block, GPTConfig  # noqa: E402

COMPUTE = ("ForwardPass", "BackwardPass")
AFTER_SCHEDULE = ("ReduceTiedGrads", "ReduceGrads", "OptimizerStep")


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


def _layers(args: argparse.Namespace) -> list[nn.Module]:
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=args.seq, n_layer=args.layers, n_head=args.heads, n_embd=args.width)
    return [Block(cfg) for _ in range(args.layers)]


def _data(args: argparse.Namespace, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    rows = args.micro * args.micro_batches
    return [
        (
            torch.randn(rows, args.seq, args.width, generator=gen),
            torch.randn(rows, args.seq, args.width, generator=gen),
        )
        for _ in range(steps)
    ]


def _shardspeed(args: argparse.Namespace, layers: list[nn.Module], stages: int) -> Any:
    import shardspeed
    from shardspeed.pipe import PipelineModule

    module = PipelineModule(
        copy.deepcopy(layers), num_stages=stages, loss_fn=_mse, partition_method="uniform"
    )
    config = {
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": args.micro_batches,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
    }
    engine, *_ = shardspeed.initialize(model=module, config=config)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        micro = list(zip(x.split(args.micro), y.split(args.micro), strict=True))
        return float(engine.train_batch(iter(micro)))

    return engine, step


def _torch_pipelining(
    args: argparse.Namespace, layers: list[nn.Module], stages: int, rank: int, device: Any
) -> Any:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    per = args.layers // stages
    submodule = nn.Sequential(*copy.deepcopy(layers[rank * per : (rank + 1) * per])).to(device)
    stage = PipelineStage(submodule, rank, stages, device)
    schedule = Schedule1F1B(stage, n_microbatches=args.micro_batches, loss_fn=_mse)
    optimizer = torch.optim.AdamW(submodule.parameters(), lr=1e-4)
    last = rank == stages - 1
    loss_out = torch.zeros((), device=device)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(x.to(device))
        elif last:
            schedule.step(target=y.to(device), losses=losses)
        else:
            schedule.step()
        optimizer.step()
        optimizer.zero_grad()
        loss_out.fill_(torch.stack(losses).mean().item() if last else 0.0)
        dist.broadcast(loss_out, src=stages - 1)
        return float(loss_out)

    return step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _rank_main(rank: int, stages: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    torch.set_num_threads(args.threads)
    init_rank(rank, stages, port)
    device = torch.device(f"cuda:{rank}" if torch.cuda.is_available() else "cpu")
    layers = _layers(args)
    data = _data(args, args.warmup + args.steps)
    engine, ours = _shardspeed(args, layers, stages)
    theirs = _torch_pipelining(args, layers, stages, rank, device)
    times: dict[str, list[float]] = {"shardspeed": [], "torch_pipelining": []}
    losses: dict[str, float] = {}
    for index, (x, y) in enumerate(data):
        if index == args.warmup:
            engine.instruction_seconds.clear()
        order = [("shardspeed", ours), ("torch_pipelining", theirs)]
        for name, step in order if index % 2 == 0 else order[::-1]:
            dist.barrier()
            _sync(device)
            start = time.perf_counter()
            losses[name] = step(x, y)
            _sync(device)
            if index >= args.warmup:
                times[name].append(time.perf_counter() - start)
    seconds = engine.instruction_seconds
    busy = sum(seconds.get(k, 0.0) for k in COMPUTE)
    in_schedule = sum(v for k, v in seconds.items() if k not in AFTER_SCHEDULE)
    queue.put(
        {
            "rank": rank,
            "times": times,
            "losses": losses,
            "bubble": 1.0 - busy / in_schedule if in_schedule else 0.0,
        }
    )
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=str, default="2,4")
    ap.add_argument("--micro_batches", type=int, default=8)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    summary: dict[str, Any] = {
        "benchmark": "pipeline_1f1b",
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "micro_batches": args.micro_batches,
        "micro_batch": args.micro,
        "layers": args.layers,
        "width": args.width,
        "seq": args.seq,
        "threads_per_rank": args.threads,
    }
    samples = args.micro * args.micro_batches
    for index, stages in enumerate(int(s) for s in args.stages.split(",")):
        ranks = spawn_ranks(_rank_main, stages, stages, 29700 + index, args)
        result: dict[str, Any] = {}
        for mode in ("shardspeed", "torch_pipelining"):
            per_step = [max(r["times"][mode][i] for r in ranks) for i in range(args.steps)]
            step_s = statistics.median(per_step)
            result[mode] = {
                "step_s": round(step_s, 4),
                "samples_per_s": round(samples / step_s, 2),
                "final_loss": round(ranks[0]["losses"][mode], 6),
            }
        result["speedup_vs_torch"] = round(
            result["shardspeed"]["samples_per_s"] / result["torch_pipelining"]["samples_per_s"], 3
        )
        result["bubble_measured"] = round(statistics.mean(r["bubble"] for r in ranks), 3)
        result["bubble_theory"] = round((stages - 1) / (args.micro_batches + stages - 1), 3)
        summary[f"stages_{stages}"] = result
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
