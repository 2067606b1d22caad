"""Checkpoint save and load: synchronous vs background (``checkpoint.writer.decoupled``), ZeRO
stages 0 and 2, against the disk's own bandwidth (``dd``) measured in the same run.

    python benchmarks/bench_checkpoint.py                   # ~17M-param GPT
    python benchmarks/bench_checkpoint.py --n_layer 12 --n_embd 768 --n_head 12 --vocab 16384

For each stage and mode a job of ``--world`` CPU ranks trains ``--steps`` steps, saves, and
measures: how long ``save_checkpoint`` blocks training (``save_s``; background: the snapshot to
CPU memory), how long until the tag is committed (``committed_s``: the write, fsync'd, plus the
manifest and the rename; ``wait_for_checkpoint`` right after a background save, so it includes no
training), and, in background mode, the median time of ``--steps`` training steps taken while
the writer works (``step_s_during_write``, over the ``steps_during_write`` steps that started
before it finished) against the same steps with no save (``step_s``). A second job loads the tag (``load_s``,
manifest and all). ``bytes`` is the tag's size on disk; ``disk_mb_s`` is ``dd``'s bandwidth for a
file of the same size (``conv=fdatasync``: on disk, as a save). Times are the slowest rank's.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_train import _batches, _build, _ds_config, init_rank, spawn_ranks  # noqa: E402


def _engine(args: argparse.Namespace, stage: int, background: bool) -> Any:
    import shardspeed

    model, _ = _build(args)
    config = _ds_config(args, stage)
    config["checkpoint"] = {"writer": {"decoupled": background}}
    engine, *_ = shardspeed.initialize(model=model, config=config)
    return engine


def _steps(engine: Any, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    times = []
    for tokens, targets in batches:
        start = time.perf_counter()
        engine.backward(engine(tokens, targets))
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _save_job(rank: int, args: argparse.Namespace, folder: str, stage: int, mode: str) -> Any:
    background = mode == "async"
    engine = _engine(args, stage, background)
    batches = _batches(engine.module.cfg, args.micro, 2 * args.steps, rank)
    quiet = _steps(engine, batches[: args.steps])
    dist.barrier()
    start = time.perf_counter()
    engine.save_checkpoint(folder, tag=mode)
    save_s = time.perf_counter() - start
    engine.wait_for_checkpoint()
    committed_s = time.perf_counter() - start
    result = {"save_s": save_s, "committed_s": committed_s}
    if background:  # again, now training while the writer works
        engine.save_checkpoint(folder, tag=f"{mode}-busy")
        pending = engine.pending_checkpoint
        assert pending is not None and pending.thread is not None
        during = []
        for batch in batches[args.steps :]:
            writing = pending.thread.is_alive()
            step_s = _steps(engine, [batch])[0]
            if writing:  # the step started while the writer was still at work
                during.append(step_s)
        engine.wait_for_checkpoint()
        result |= {"step_s": _median(quiet), "steps_during_write": float(len(during))}
        if during:
            result["step_s_during_write"] = _median(during)
    engine.destroy()
    return result


def _load_job(rank: int, args: argparse.Namespace, folder: str, stage: int, mode: str) -> Any:
    del rank
    engine = _engine(args, stage, background=False)
    dist.barrier()
    start = time.perf_counter()
    engine.load_checkpoint(folder, tag=mode)
    return {"load_s": time.perf_counter() - start}


def _rank(rank: int, world: int, port: int, job: str, *rest: Any) -> None:
    *args, queue = rest
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    init_rank(rank, world, port)
    queue.put((_save_job if job == "save" else _load_job)(rank, *args))
    dist.destroy_process_group()


def _dd_mb_s(folder: str, nbytes: int) -> float:
    """dd's write bandwidth for a file of ``nbytes``, flushed to disk."""
    count = max(1, nbytes // 2**20)
    target = Path(folder) / "dd.bin"
    run = subprocess.run(
        ["dd", "if=/dev/zero", f"of={target}", "bs=1M", f"count={count}", "conv=fdatasync"],
        capture_output=True,
        text=True,
        check=True,
    )
    target.unlink()
    seconds = float(re.findall(r"copied, ([\d.]+) s", run.stderr)[-1])
    return round(count / seconds, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--stages", type=str, default="0,2")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--n_layer", type=int, default=4)
    ap.add_argument("--n_embd", type=int, default=512)
    ap.add_argument("--n_head", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--overlap_comm", default="unset")
    args = ap.parse_args()

    summary: dict[str, Any] = {
        "benchmark": "checkpoint",
        "device": "cpu",
        "params": sum(p.numel() for p in _build(args)[0].parameters()),
        "world": args.world,
    }
    port = 29800
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as folder:
        for stage in map(int, args.stages.split(",")):
            for mode in ("sync", "async"):
                port += 2
                spawn = (args, folder, stage, mode)
                saved = spawn_ranks(_rank, args.world, args.world, port, "save", *spawn)
                loaded = spawn_ranks(_rank, args.world, args.world, port + 1, "load", *spawn)
                tag = Path(folder) / mode
                nbytes = sum(f.stat().st_size for f in tag.rglob("*") if f.is_file())
                figures = {k: max(r[k] for r in saved) for k in saved[0]}
                figures["load_s"] = max(r["load_s"] for r in loaded)
                figures = {k: round(v, 3) for k, v in figures.items()}
                figures["bytes"] = nbytes
                figures["mb_s"] = round(nbytes / 2**20 / figures["committed_s"], 1)
                summary[f"stage{stage}_{mode}"] = figures
                for old in Path(folder).iterdir():  # the next stage starts from an empty disk
                    subprocess.run(["rm", "-rf", str(old)], check=True)
        biggest = max(v["bytes"] for k, v in summary.items() if k.startswith("stage"))
        summary["disk_mb_s"] = _dd_mb_s(folder, biggest)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
