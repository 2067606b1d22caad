"""Checkpoint save, load and re-partitioned load: shardspeed vs a DDP-style torch.save, same run.

    python benchmarks/bench_checkpoint.py                   # ~17M-param GPT, stage 2, 2 -> 2, 1 ranks
    python benchmarks/bench_checkpoint.py --n_layer 12 --n_embd 768 --n_head 12 --vocab 16384

The saving job (``--world`` CPU ranks, ZeRO ``--stage``) trains one step and saves; the peer is
what a DDP job does: rank 0 ``torch.save``s the model and the full AdamW state, every rank
``torch.load``s it. Then a job for each of ``--load_worlds`` loads the shardspeed checkpoint
(re-partitioning it where the world size differs) with ZeRO ``--load_stage``, and
``zero_to_fp32`` consolidates it. Times are the slowest rank's; RSS growth is the most any rank's
peak RSS rose during the load. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_train import (  # noqa: E402
    _batches,
    _build,
    _ds_config,
    _peak_rss_mb,
    init_rank,
    spawn_ranks,
)


def _timed(fn: Any) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _engine(args: argparse.Namespace, stage: int) -> Any:
    import shardspeed

    model, _ = _build(args)
    engine, *_ = shardspeed.initialize(model=model, config=_ds_config(args, stage))
    return engine


def _save_job(rank: int, args: argparse.Namespace, folder: str) -> dict[str, Any]:
    engine = _engine(args, args.stage)
    tokens, targets = _batches(engine.module.cfg, args.micro, 1, rank)[0]
    engine.backward(engine(tokens, targets))
    engine.step()
    save_s = _timed(lambda: engine.save_checkpoint(folder, tag="bench"))
    engine.destroy()
    # the peer: a DDP job's checkpoint, model and full optimizer state, written by rank 0
    model, cfg = _build(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    tokens, targets = _batches(cfg, args.micro, 1, rank)[0]
    model(tokens, targets).backward()
    optimizer.step()
    peer = Path(folder) / "ddp.pt"

    def peer_save() -> None:
        if rank == 0:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, peer)

    def peer_load() -> None:
        state = torch.load(peer, map_location="cpu", weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    return {"save_s": save_s, "peer_save_s": _timed(peer_save), "peer_load_s": _timed(peer_load)}


def _load_job(rank: int, args: argparse.Namespace, folder: str) -> dict[str, Any]:
    engine = _engine(args, args.load_stage)
    before = _peak_rss_mb()
    load_s = _timed(lambda: engine.load_checkpoint(folder, tag="bench"))
    assert engine.global_steps == 1
    return {"load_s": load_s, "rss_growth_mb": _peak_rss_mb() - before}


def _rank(
    rank: int, world: int, port: int, job: str, args: argparse.Namespace, folder: str, queue: Any
) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    init_rank(rank, world, port)
    queue.put(_save_job(rank, args, folder) if job == "save" else _load_job(rank, args, folder))
    dist.destroy_process_group()


def _run(
    job: str, world: int, port: int, args: argparse.Namespace, folder: str
) -> dict[str, float]:
    results = spawn_ranks(_rank, world, world, port, job, args, folder)
    return {key: round(max(r[key] for r in results), 3) for key in results[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--load_stage", type=int, default=2)
    ap.add_argument("--load_worlds", type=str, default="2,1")
    ap.add_argument("--n_layer", type=int, default=4)
    ap.add_argument("--n_embd", type=int, default=512)
    ap.add_argument("--n_head", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--overlap_comm", default="unset")
    args = ap.parse_args()

    from shardspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with tempfile.TemporaryDirectory() as folder:
        port = 29700
        summary: dict[str, Any] = {
            "benchmark": "checkpoint",
            "device": "cpu",
            "params": sum(p.numel() for p in _build(args)[0].parameters()),
            "stage": args.stage,
            "load_stage": args.load_stage,
            "save_world": args.world,
            **_run("save", args.world, port, args, folder),
        }
        files = list((Path(folder) / "bench").iterdir())
        summary["checkpoint_mb"] = round(sum(f.stat().st_size for f in files) / 2**20, 1)
        summary["peer_checkpoint_mb"] = round((Path(folder) / "ddp.pt").stat().st_size / 2**20, 1)
        for world in map(int, args.load_worlds.split(",")):
            port += 1
            summary[f"load_into_{world}_ranks"] = _run("load", world, port, args, folder)
        start = time.perf_counter()
        state = get_fp32_state_dict_from_zero_checkpoint(folder, tag="bench")
        summary["zero_to_fp32_s"] = round(time.perf_counter() - start, 3)
        assert len(state) > 0
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
