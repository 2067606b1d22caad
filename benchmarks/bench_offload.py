"""ZeRO-Infinity on this machine: the largest GPT that trains with stage 3 + NVMe offload.

    python benchmarks/bench_offload.py --nvme /var/tmp/shardspeed_swap                # 2.5B
    python benchmarks/bench_offload.py --nvme DIR --n_layer 8 --n_embd 1024 --compare  # small

Builds a GPT-style model under ``shardspeed.zero.Init`` (never whole in memory), trains it with
ZeRO stage 3, parameter shards and optimizer state offloaded to files under ``--nvme``
(``offload_param`` and ``offload_optimizer`` with ``device: nvme``), fp32, and reports seconds
per step, peak RSS per rank, the bytes in the swap files, and what the model states would take
in memory without offload (16 bytes per parameter: fp32 parameters, gradients and Adam's two
moments, spread over the ranks). ``--compare`` also trains the same model without offload (only
for models that fit) in the same run. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_train import _batches, _peak_rss_mb, gpt_config, init_rank, spawn_ranks  # noqa: E402

from examples.gpt_model import GPT  # noqa: E402


def _config(args: argparse.Namespace, mode: str, folder: str) -> dict[str, Any]:
    zero: dict[str, Any] = {
        "stage": 3,
        "sub_group_size": args.sub_group,
        "stage3_param_persistence_threshold": 10_000,
        "stage3_max_live_parameters": args.max_live,
        "stage3_prefetch_bucket_size": 0,
    }
    if mode == "nvme":
        zero["offload_param"] = {"device": "nvme", "nvme_path": folder}
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": folder}
    return {
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }


def _rank_main(
    rank: int, world: int, port: int, mode: str, args: argparse.Namespace, queue: Any
) -> None:
    import shardspeed

    torch.set_num_threads(args.threads)
    init_rank(rank, world, port)
    folder = os.path.join(args.nvme, mode)
    os.makedirs(folder, exist_ok=True)
    config = _config(args, mode, folder)
    cfg = gpt_config(args)
    torch.manual_seed(0)
    start = time.perf_counter()
    with shardspeed.zero.Init(config_dict_or_path=config):
        model = GPT(cfg)
    params = sum(p.ds_numel for p in model.parameters())  # type: ignore[attr-defined]
    built_rss = _peak_rss_mb()
    engine, *_ = shardspeed.initialize(model=model, config=config)
    setup_s = time.perf_counter() - start
    times, losses = [], []
    for tokens, targets in _batches(cfg, args.micro, args.warmup + args.steps, rank):
        dist.barrier()
        began = time.perf_counter()
        loss = engine(tokens, targets)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - began)
        losses.append(loss.item())
    mine = Path(folder) / f"swap_rank{rank}"  # this rank's files only (the folder is shared)
    on_disk = sum(f.stat().st_size for f in mine.rglob("*") if f.is_file())
    queue.put(
        {
            "rank": rank,
            "params": params,
            "setup_s": setup_s,
            "step_s": statistics.median(times[args.warmup :]),
            "step_times_s": [round(t, 1) for t in times],
            "losses": [round(v, 4) for v in losses],
            "rss_after_build_mb": built_rss,
            "peak_rss_mb": _peak_rss_mb(),
            "swap_file_bytes": on_disk,
        }
    )
    engine.destroy()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nvme", required=True, help="a folder on a fast disk for the swap files")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--n_layer", type=int, default=32)
    ap.add_argument("--n_embd", type=int, default=2560)
    ap.add_argument("--n_head", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--micro", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--sub_group", type=int, default=100_000_000)
    ap.add_argument("--max_live", type=int, default=200_000_000)
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    ap.add_argument("--compare", action="store_true", help="also train without offload")
    args = ap.parse_args()

    modes = ["nvme", "none"] if args.compare else ["nvme"]
    results = {}
    for port, mode in enumerate(modes, start=29810):
        results[mode] = spawn_ranks(_rank_main, args.world, args.world, port, mode, args)
        shutil.rmtree(os.path.join(args.nvme, mode), ignore_errors=True)
    ranks = results["nvme"]
    params = ranks[0]["params"]
    summary: dict[str, Any] = {
        "benchmark": "zero_infinity_nvme",
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "world": args.world,
        "dtype": "fp32",
        "params": params,
        "micro_batch": args.micro,
        "seq": args.seq,
        "ram_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        # what the model states would take in memory without offload, all ranks together
        "model_states_gib_without_offload": round(16 * params / 2**30, 1),
    }
    for mode, per_rank in results.items():
        summary[mode] = {
            "step_s": round(max(r["step_s"] for r in per_rank), 2),
            "setup_s": round(max(r["setup_s"] for r in per_rank), 1),
            "step_times_s": per_rank[0]["step_times_s"],
            "losses_rank0": per_rank[0]["losses"],
            "peak_rss_mb_per_rank": [round(r["peak_rss_mb"]) for r in per_rank],
            "peak_rss_gib_all_ranks": round(sum(r["peak_rss_mb"] for r in per_rank) / 1024, 2),
            "swap_file_gib": round(sum(r["swap_file_bytes"] for r in per_rank) / 2**30, 2),
        }
    if args.compare:
        summary["nvme_vs_none_step_time"] = round(
            summary["nvme"]["step_s"] / summary["none"]["step_s"], 2
        )
        summary["nvme_vs_none_peak_rss"] = round(
            summary["nvme"]["peak_rss_gib_all_ranks"] / summary["none"]["peak_rss_gib_all_ranks"],
            2,
        )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
