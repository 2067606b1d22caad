"""ZeRO stage 3 vs PyTorch FSDP2: step time and per-rank peak memory, same model, same run.

    python benchmarks/bench_zero3.py      # 2 CPU ranks, fp32, ~98M-param GPT, 2 rounds

FSDP2 shards every transformer block and the root (``fully_shard(..., reshard_after_forward=
True)``), its usual setup; shardspeed runs ``zero_optimization.stage = 3`` with DeepSpeed's
defaults. Each mode runs in fresh rank processes, the modes alternate over ``--rounds`` and the
median step time is reported, with the theoretical model-state bytes per rank (16Ψ/N for fp32
AdamW: parameters, gradients and two moments, all partitioned) plus stage 3's gathered working
set (the most parameter bytes it held gathered at once) beside the measured peak RSS.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_train import rank_setup, spawn_ranks, time_steps  # noqa: E402


def _ds_config(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 3},
    }


def _rank_main(
    rank: int, world: int, port: int, mode: str, args: argparse.Namespace, queue: Any
) -> None:
    setup = rank_setup(rank, world, port, args)
    device, model, params, batches, base_rss = (
        setup.device,
        setup.model,
        setup.params,
        setup.batches,
        setup.base_rss,
    )
    if mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        model = model.to(device)
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=True)
        fully_shard(model, reshard_after_forward=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)

        def step(tokens: torch.Tensor, targets: torch.Tensor) -> None:
            loss = model(tokens, targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    else:
        import shardspeed

        engine, *_ = shardspeed.initialize(model=model, config=_ds_config(args))

        def step(tokens: torch.Tensor, targets: torch.Tensor) -> None:
            loss = engine(tokens, targets)
            engine.backward(loss)
            engine.step()

    result = time_steps(step, batches, device, args.warmup, rank, params, base_rss)
    if mode != "fsdp2":  # the gathered working set: most parameter bytes gathered at once
        result["gathered_peak_mb"] = engine.strategy.sharding.peak_live * 4 / 2**20
    queue.put(result)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--n_layer", type=int, default=12)
    ap.add_argument("--n_embd", type=int, default=768)
    ap.add_argument("--n_head", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    args = ap.parse_args()

    modes = ["fsdp2", "shardspeed_stage3"]
    runs: dict[str, list[list[dict[str, Any]]]] = {m: [] for m in modes}
    port = 29700
    for round_index in range(args.rounds):
        for mode in modes if round_index % 2 == 0 else list(reversed(modes)):
            port += 1
            runs[mode].append(spawn_ranks(_rank_main, args.world, args.world, port, mode, args))

    params = runs["fsdp2"][0][0]["params"]
    summary: dict[str, Any] = {
        "benchmark": "zero3_vs_fsdp2",
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "world": args.world,
        "dtype": "fp32",
        "params": params,
        "micro_batch": args.micro,
        "seq": args.seq,
        "model_state_mb_per_rank_theory": round(16 * params / args.world / 2**20, 1),
    }
    for mode, rounds in runs.items():
        summary[mode] = {
            "step_s": statistics.median(max(r["step_s"] for r in ranks) for ranks in rounds),
            "peak_rss_mb_per_rank": [
                round(max(rnd[i]["peak_rss_mb"] for rnd in rounds), 1) for i in range(args.world)
            ],
            "rss_model_built_mb_per_rank": [
                round(rounds[-1][i]["rss_model_built_mb"], 1) for i in range(args.world)
            ],
            "peak_device_mb_per_rank": [rounds[-1][i]["peak_device_mb"] for i in range(args.world)],
        }
    fsdp, ours = summary["fsdp2"], summary["shardspeed_stage3"]
    gathered = max(r["gathered_peak_mb"] for rnd in runs["shardspeed_stage3"] for r in rnd)
    ours["gathered_peak_mb"] = round(gathered, 1)
    # the theory for stage 3: partitioned model states + the gathered working set
    ours["theory_mb_per_rank"] = round(summary["model_state_mb_per_rank_theory"] + gathered, 1)
    summary["stage3_vs_fsdp2_step_time"] = round(ours["step_s"] / fsdp["step_s"], 3)
    summary["stage3_vs_fsdp2_peak_rss"] = round(
        max(ours["peak_rss_mb_per_rank"]) / max(fsdp["peak_rss_mb_per_rank"]), 3
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
