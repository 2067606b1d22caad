"""Training step time and per-rank peak memory: shardspeed vs torch DDP, same model, same run.

    python benchmarks/bench_train.py                       # 2 CPU ranks, fp32, ~17M-param GPT
    python benchmarks/bench_train.py --stages 0 --n_layer 8 --n_embd 768

Each mode runs in fresh rank processes (so each has its own peak RSS), modes alternate over
``--rounds`` rounds, and the median step time of every mode is reported. Each mode also reports
its theoretical model-state bytes per rank (fp32 AdamW; see :func:`model_state_bytes`) and the
memory target ``theory + activations + 300 MB``, with activations measured as the bytes autograd
saves in one micro-batch forward (:func:`activation_mb`). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import queue as pyqueue
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from examples.gpt_model import GPT, GPTConfig  # noqa: E402


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def gpt_config(args: argparse.Namespace) -> GPTConfig:
    """The benchmark model's shape from the command line (--vocab, --seq, --n_layer, ...)."""
    return GPTConfig(
        vocab_size=args.vocab,
        block_size=args.seq,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
    )


def _build(args: argparse.Namespace) -> tuple[GPT, GPTConfig]:
    cfg = gpt_config(args)
    torch.manual_seed(0)
    return GPT(cfg), cfg


def _batches(
    cfg: GPTConfig, micro: int, count: int, rank: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + rank)
    out = []
    for _ in range(count):
        tokens = torch.randint(cfg.vocab_size, (micro, cfg.block_size + 1), generator=gen)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def _ds_config(args: argparse.Namespace, stage: int) -> dict[str, Any]:
    zero: dict[str, Any] = {
        "stage": stage,
        # DDP's default bucket (25 MB of fp32) for both reduce and gather: with DeepSpeed's
        # 5e8-element defaults a ~100M model is one bucket, i.e. a full-size temporary buffer
        "reduce_bucket_size": 6_250_000,
        "allgather_bucket_size": 6_250_000,
    }
    if args.overlap_comm != "unset":
        zero["overlap_comm"] = args.overlap_comm == "true"
    return {
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "zero_optimization": zero,
    }


def model_state_bytes(mode: str, params: int, world: int, elem: int = 4) -> int:
    """Theoretical bytes of parameters, gradients and AdamW state per rank (fp32, Ψ = ``params``).

    DDP: params + grads + its gradient buckets (a second copy of the grads) + 2 moments.
    Stage 0: params + grads (bucket views) + 2 moments. Stage 1: params + full grads, and per
    partition (Ψ/N) the fp32 master, reduced gradient and 2 moments. Stage 2: params and the
    four partition tensors (plus the buckets in flight, not counted). Stage 3: the parameter
    shard (fp32: the optimizer steps it directly), its gradient and 2 moments (the gathered
    units in flight not counted).
    """
    psi, part = params, -(-params // world)
    per_mode = {
        "ddp": 5 * psi,
        "shardspeed_stage0": 3 * psi + psi,
        "shardspeed_stage1": 2 * psi + 4 * part,
        "shardspeed_stage2": psi + 4 * part,
        "shardspeed_stage3": 4 * part,
    }
    return per_mode[mode] * elem


def activation_mb(args: argparse.Namespace) -> float:
    """MB of tensors autograd saves for backward in one micro-batch forward (parameters excluded,
    each storage counted once): the activations term of the memory target."""
    model, cfg = _build(args)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    tokens, targets = _batches(cfg, args.micro, 1, rank=0)[0]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, targets)
    return sum(saved.values()) / 2**20


def init_rank(rank: int, world: int, port: int) -> None:
    """Join a ``world``-rank process group as ``rank`` (gloo on CPU, NCCL on GPU)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        # stdout carries only the one JSON line: keep the ranks' info logs off it
        SHARDSPEED_LOG_LEVEL="WARNING",
    )
    if torch.cuda.is_available():
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")


def spawn_ranks(target: Any, world: int, *args: Any) -> list[dict[str, Any]]:
    """Run ``target(rank, *args, queue)`` in ``world`` fresh processes; each puts one dict on
    the queue. Returns them by rank order of arrival, sorted by their ``rank`` key if any."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, *args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results: list[dict[str, Any]] = []
    deadline = time.monotonic() + 3600
    while len(results) < len(procs):
        try:
            results.append(queue.get(timeout=5))
        except pyqueue.Empty:
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise RuntimeError(
                    f"{target.__name__}: a rank exited with {failed} (its traceback is above)"
                    if failed
                    else f"{target.__name__}: no result within an hour"
                ) from None
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"{target.__name__}: a rank exited with {p.exitcode}")
    return sorted(results, key=lambda r: r.get("rank", 0))


@dataclass
class RankSetup:
    """What every benchmark rank starts from: the fp32 model, its batches, the device."""

    device: torch.device
    model: GPT
    params: int
    batches: list[tuple[torch.Tensor, torch.Tensor]]
    #: peak RSS once the model is built, before any wrapper touches it
    base_rss: float


def rank_setup(rank: int, world: int, port: int, args: argparse.Namespace) -> RankSetup:
    """Join the process group and build the model and this rank's batches."""
    torch.set_num_threads(args.threads)
    init_rank(rank, world, port)
    device = torch.device(f"cuda:{rank}" if torch.cuda.is_available() else "cpu")
    model, cfg = _build(args)
    params = sum(p.numel() for p in model.parameters())
    batches = _batches(cfg, args.micro, args.warmup + args.steps, rank)
    return RankSetup(device, model, params, batches, _peak_rss_mb())


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
    if mode == "ddp":
        model = model.to(device)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)

        def step(tokens: torch.Tensor, targets: torch.Tensor) -> None:
            loss = ddp(tokens, targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
    else:
        import shardspeed

        engine, *_ = shardspeed.initialize(model=model, config=_ds_config(args, int(mode[-1])))

        def step(tokens: torch.Tensor, targets: torch.Tensor) -> None:
            loss = engine(tokens, targets)
            engine.backward(loss)
            engine.step()

    queue.put(time_steps(step, batches, device, args.warmup, rank, params, base_rss))
    dist.destroy_process_group()


def time_steps(
    step: Any,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
    warmup: int,
    rank: int,
    params: int,
    base_rss: float,
) -> dict[str, Any]:
    """Run ``step`` on every batch (all ranks start each step together) and report this rank's
    median step time after ``warmup`` steps and its peak memory."""
    cuda = device.type == "cuda"
    times = []
    for i, (tokens, targets) in enumerate(batches):
        tokens, targets = tokens.to(device), targets.to(device)
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        step(tokens, targets)
        if cuda:
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return {
        "rank": rank,
        "params": params,
        "step_s": statistics.median(times),
        "peak_rss_mb": _peak_rss_mb(),
        "rss_model_built_mb": base_rss,
        "peak_device_mb": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
    }


def _run_mode(mode: str, args: argparse.Namespace, port: int) -> list[dict[str, Any]]:
    return spawn_ranks(_rank_main, args.world, args.world, port, mode, args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--stages", type=str, default="0", help="comma-separated ZeRO stages")
    ap.add_argument("--n_layer", type=int, default=4)
    ap.add_argument("--n_embd", type=int, default=512)
    ap.add_argument("--n_head", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--overlap_comm",
        choices=["unset", "true", "false"],
        default="unset",
        help="zero_optimization.overlap_comm for the shardspeed modes (unset: config default)",
    )
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    args = ap.parse_args()

    modes = ["ddp", *[f"shardspeed_stage{s}" for s in args.stages.split(",")]]
    runs: dict[str, list[list[dict[str, Any]]]] = {m: [] for m in modes}
    port = 29600
    for round_index in range(args.rounds):
        order = modes if round_index % 2 == 0 else list(reversed(modes))
        for mode in order:
            port += 1
            runs[mode].append(_run_mode(mode, args, port))

    summary: dict[str, Any] = {
        "benchmark": "train_step",
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "world": args.world,
        "dtype": "fp32",
        "params": runs["ddp"][0][0]["params"],
        "micro_batch": args.micro,
        "seq": args.seq,
        "activations_mb": round(activation_mb(args), 1),
    }
    for mode, rounds in runs.items():
        summary[mode] = {
            "step_s": statistics.median(max(r["step_s"] for r in ranks) for ranks in rounds),
            "peak_rss_mb_per_rank": [
                round(max(rnd[i]["peak_rss_mb"] for rnd in rounds), 1) for i in range(args.world)
            ],
            "peak_device_mb_per_rank": [rounds[-1][i]["peak_device_mb"] for i in range(args.world)],
            # the process once the fp32 model is built, before the engine/DDP wraps it: peak
            # minus this is what training added
            "rss_model_built_mb_per_rank": [
                round(rounds[-1][i]["rss_model_built_mb"], 1) for i in range(args.world)
            ],
            "model_state_mb_per_rank_theory": round(
                model_state_bytes(mode, summary["params"], args.world) / 2**20, 1
            ),
        }
        # the memory target: theory + activations + 300 MB (process, allocator, buffers)
        target = summary[mode]["model_state_mb_per_rank_theory"] + summary["activations_mb"] + 300
        summary[mode]["rss_target_mb"] = round(target, 1)
        summary[mode]["rss_within_target"] = max(summary[mode]["peak_rss_mb_per_rank"]) <= target
    for mode in modes[1:]:
        summary[f"{mode}_vs_ddp_step_time"] = round(
            summary[mode]["step_s"] / summary["ddp"]["step_s"], 3
        )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
