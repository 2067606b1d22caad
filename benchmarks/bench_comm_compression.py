"""Communication compression: the 1-bit optimizers and ZeRO++ against uncompressed training.

    python benchmarks/bench_comm_compression.py          # 2 CPU ranks, fp32, ~5M-param GPT
    python benchmarks/bench_comm_compression.py --tiny   # seconds: the test's sizes
    python benchmarks/bench_comm_compression.py --world 4 --node 2 \
        --modes zero0_adam,torch_ddp,zero3_adam,zeropp_hpz,zeropp_qwz,zeropp_qgz,zeropp_all

ZeRO++ modes (stage 3, Adam): ``zeropp_hpz`` (``zero_hpz_partition_size`` = ``--node``),
``zeropp_qwz`` (``zero_quantized_weights``), ``zeropp_qgz`` (``zero_quantized_gradients``) and
``zeropp_all`` (the three). ``--node`` ranks form one emulated node (``LOCAL_WORLD_SIZE`` in the
ranks; default 1: every rank its own node, as the 1-bit comparisons assume).

Modes, each from the same seeded model on the same Markov-chain token stream
(``examples.gpt_model.synthetic_tokens``): ``zero0_adam`` (Adam at ZeRO stage 0, the DDP-like
gradient all-reduce: the byte baseline), ``torch_ddp`` (``torch.optim.Adam`` under torch DDP,
the peer), ``zero3_adam`` (Adam at stage 3), ``onebit_adam``, ``zero_one_adam`` and
``onebit_lamb`` (stage 0; warm-up at full precision, compressed from ``--freeze`` on:
``freeze_step`` for 1-bit Adam/LAMB, ``var_freeze_step`` for 0/1 Adam, whose other settings are
DeepSpeed's defaults). All modes run ``--freeze + 1`` untimed steps first, so every figure is a
post-freeze one, then two timed passes of ``--steps`` steps in the same ranks:

* pass A, plain: the measured step time (median per rank, slowest rank reported), the bus bytes
  per step from ``shardspeed.comm``'s byte counter (mean over the pass, max over ranks; bus
  bytes = message bytes times nccl-tests' bus factor, the bytes a rank's link carries), and the
  final loss (mean over ranks of the pass's last 3 steps). torch DDP bypasses shardspeed.comm:
  a DDP communication hook counts its all-reduced buckets with the same bus factor.
* pass B, compute split: shardspeed modes with the comms logger on (every collective timed,
  i.e. synchronous), compute = step time - timed collective time; torch DDP with its gradient
  all-reduce switched off (``no_sync``), compute = that step time. Per rank the median, then the
  max over ranks (the rank that arrived last at each collective did not wait for a peer, so its
  split is the honest one). Passes A and B are separate runs of steps, so on a busy machine
  ``compute_s`` can exceed ``step_s`` by the noise; ``comm_s_loopback`` is then clamped to 0.

The final loss after ``--freeze + 1 + --steps`` steps is a sanity check (every mode trains, the
1-bit ones near Adam), not a convergence result: tests/runtime/onebit/test_engine.py trains 300
steps for that. A whole default run takes about 3 minutes on 2 shared CPU cores.

Link-rate emulation is MODELLED, not measured: the loopback gloo link of one machine is far
faster, relative to its compute, than an inter-node link. ``modelled_step_s = compute_s +
bus_bytes_per_step / link``, no overlap of communication with compute (an upper bound for
DDP, which overlaps), for two links:

* ``at_link_gbps``: ``--link_gbps`` per rank (default 100 Gb/s, one HDR InfiniBand port per
  GPU as on DGX A100 / H100 nodes; intra-node NVLink is 20-40x faster, so only the inter-node
  hop is the bottleneck that gradient compression targets). Against CPU compute this link is
  nearly free.
* ``at_gpu_ratio``: the same link scaled to this machine's compute, i.e. the link a GPU cluster
  has per FLOP: ``link_gbps * cpu_flops / (--ref_tflops * 1e12)``, where ``cpu_flops`` is
  ``6 * params * tokens per step / zero0_adam's compute_s`` and ``--ref_tflops`` the achieved
  (not peak) per-GPU rate (default 125: an A100 at ~40% of its bf16 peak).

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_train import gpt_config, init_rank, spawn_ranks  # noqa: E402

from examples.gpt_model import GPT, synthetic_tokens  # noqa: E402

MODES = (
    "zero0_adam",
    "torch_ddp",
    "zero3_adam",
    "onebit_adam",
    "zero_one_adam",
    "onebit_lamb",
    "zeropp_hpz",
    "zeropp_qwz",
    "zeropp_qgz",
    "zeropp_all",
)
ONEBIT = ("onebit_adam", "zero_one_adam", "onebit_lamb")
LR = 1e-3


def _zeropp_keys(mode: str, node: int) -> dict[str, Any]:
    """The ``zero_optimization`` keys of a ZeRO++ mode (none for the others)."""
    hpz = {"zero_hpz_partition_size": node}
    qwz = {"zero_quantized_weights": True}
    qgz = {"zero_quantized_gradients": True}
    return {
        "zeropp_hpz": hpz,
        "zeropp_qwz": qwz,
        "zeropp_qgz": qgz,
        "zeropp_all": {**hpz, **qwz, **qgz},
    }.get(mode, {})


def _ds_config(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    stage3 = mode == "zero3_adam" or mode.startswith("zeropp_")
    optimizer: dict[str, Any] = {
        "zero0_adam": {"type": "Adam", "params": {"lr": LR}},
        "zero3_adam": {"type": "Adam", "params": {"lr": LR}},
        "onebit_adam": {"type": "OneBitAdam", "params": {"lr": LR, "freeze_step": args.freeze}},
        "zero_one_adam": {
            "type": "ZeroOneAdam",
            "params": {"lr": LR, "var_freeze_step": args.freeze},
        },
        "onebit_lamb": {"type": "OneBitLamb", "params": {"lr": LR, "freeze_step": args.freeze}},
    }.get(mode, {"type": "Adam", "params": {"lr": LR}})
    return {
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": 1,
        "optimizer": optimizer,
        "zero_optimization": {
            "stage": 3 if stage3 else 0,
            "stage3_param_persistence_threshold": args.persistence,
            **_zeropp_keys(mode, args.node),
        },
    }


def _bus_bytes(crossing_nodes: bool = False) -> float:
    from shardspeed import comm

    volume = comm.get_comm_volume(crossing_nodes=crossing_nodes)
    return sum(op["bus_bytes"] for op in volume.values())


def _logged_comm_s() -> float:
    from shardspeed import comm

    return sum(
        sum(stats["latencies_ms"]) / 1e3
        for sizes in comm.get_logged_comm_ops().values()
        for stats in sizes.values()
    )


class _DDPCounter:
    """State of a DDP communication hook that counts each all-reduced bucket's bus bytes."""

    def __init__(self, world: int) -> None:
        self.factor = 2.0 * (world - 1) / world  # all_reduce's nccl-tests bus factor
        self.bus_bytes = 0.0


def _counting_allreduce_hook(state: _DDPCounter, bucket: Any) -> Any:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    buffer = bucket.buffer()
    state.bus_bytes += buffer.numel() * buffer.element_size() * state.factor
    world = dist.group.WORLD
    assert world is not None  # the process group is up: DDP was built on it
    return allreduce_hook(world, bucket)


# DDP checks the hook's annotations as objects; this module's are strings (postponed evaluation)
_counting_allreduce_hook.__annotations__.update(
    bucket=dist.GradBucket, state=_DDPCounter, **{"return": torch.futures.Future[torch.Tensor]}
)


def _run_mode(
    mode: str, args: argparse.Namespace, batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> dict[str, Any]:
    """Train ``mode`` over ``batches`` (warm-up, pass A, pass B); this rank's raw figures."""
    from shardspeed import comm

    torch.manual_seed(0)
    model = GPT(gpt_config(args))
    counter = _DDPCounter(dist.get_world_size())
    if mode == "torch_ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        ddp.register_comm_hook(counter, _counting_allreduce_hook)
        optimizer = torch.optim.Adam(model.parameters(), lr=LR)

        def step(tokens: torch.Tensor, targets: torch.Tensor, split: bool) -> float:
            if split:  # no gradient all-reduce: the compute alone
                with ddp.no_sync():
                    loss = ddp(tokens, targets)
                    loss.backward()
            else:
                loss = ddp(tokens, targets)
                loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
            return float(loss.item())
    else:
        import shardspeed

        engine, *_ = shardspeed.initialize(model=model, config=_ds_config(mode, args))

        def step(tokens: torch.Tensor, targets: torch.Tensor, split: bool) -> float:
            loss = engine(tokens, targets)
            engine.backward(loss)
            engine.step()
            return float(loss.item())

    warm = args.freeze + 1
    step_s: list[float] = []
    bus: list[float] = []
    cross: list[float] = []
    losses: list[float] = []
    compute_s: list[float] = []
    for i, (tokens, targets) in enumerate(batches):
        split = i >= warm + args.steps  # pass B
        if split and mode != "torch_ddp":
            comm.configure(enabled=True, prof_all=True, verbose=False)
            comm.reset_log()
        comm.reset_comm_volume()
        before = counter.bus_bytes
        dist.barrier()
        start = time.perf_counter()
        loss = step(tokens, targets, split)
        elapsed = time.perf_counter() - start
        if i < warm:
            continue
        if split:
            comm_s = 0.0 if mode == "torch_ddp" else _logged_comm_s()
            compute_s.append(elapsed - comm_s)
        else:
            step_s.append(elapsed)
            ddp_bytes = counter.bus_bytes - before  # over the world: crossing nodes if several
            bus.append(_bus_bytes() + ddp_bytes)
            cross.append(_bus_bytes(True) + (ddp_bytes if args.node < args.world else 0.0))
            losses.append(loss)
    comm.configure(enabled=False)
    comm.reset_log()
    if mode != "torch_ddp":
        engine.destroy()
    return {
        "step_s": statistics.median(step_s),
        "compute_s": statistics.median(compute_s),
        "bus_bytes": statistics.fmean(bus),
        "cross_bytes": statistics.fmean(cross),
        "final_loss": statistics.fmean(losses[-3:]),
    }


def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    torch.set_num_threads(args.threads)
    init_rank(rank, world, port)
    os.environ["LOCAL_WORLD_SIZE"] = str(args.node)  # the emulated node (byte counter, ZeRO++)
    cfg = gpt_config(args)
    total = args.freeze + 1 + 2 * args.steps
    data = synthetic_tokens(total * args.micro * world, cfg, seed=7)
    inputs, targets = data.tensors
    batches = []
    for i in range(total):
        at = (i * world + rank) * args.micro  # this rank's share of global batch i
        batches.append((inputs[at : at + args.micro], targets[at : at + args.micro]))
    result: dict[str, Any] = {
        "rank": rank,
        "params": sum(p.numel() for p in GPT(cfg).parameters()),
    }
    for mode in args.modes.split(","):
        result[mode] = _run_mode(mode, args, batches)
    queue.put(result)
    dist.destroy_process_group()


def summarize(args: argparse.Namespace, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON summary from every rank's raw figures."""
    modes = args.modes.split(",")
    params = ranks[0]["params"]
    tokens = args.micro * args.seq  # per rank per step
    summary: dict[str, Any] = {
        "benchmark": "comm_compression",
        "device": "cpu",
        "backend": "gloo",
        "world": args.world,
        "dtype": "fp32",
        "params": params,
        "micro_batch": args.micro,
        "seq": args.seq,
        "freeze_step": args.freeze,
        "timed_steps": args.steps,
        "ranks_per_node": args.node,
        "link_model": (
            "modelled, not measured: compute_s + inter-node bus bytes / link + intra-node bus "
            "bytes / (link * intra_ratio)"
        ),
        "intra_ratio": args.intra_ratio,
    }
    figures: dict[str, dict[str, Any]] = {}
    for mode in modes:
        figures[mode] = {
            "step_s": max(r[mode]["step_s"] for r in ranks),
            "compute_s": max(r[mode]["compute_s"] for r in ranks),
            "bus_bytes_per_step": max(r[mode]["bus_bytes"] for r in ranks),
            "inter_node_bytes_per_step": max(r[mode]["cross_bytes"] for r in ranks),
            "final_loss": statistics.fmean(r[mode]["final_loss"] for r in ranks),
        }
    base = figures.get("zero0_adam")
    links = {"at_link_gbps": args.link_gbps}
    if base is not None and base["compute_s"] > 0:
        cpu_flops = 6 * params * tokens / base["compute_s"]
        summary["cpu_tflops_measured"] = round(cpu_flops / 1e12, 4)
        links["at_gpu_ratio"] = args.link_gbps * cpu_flops / (args.ref_tflops * 1e12)
        summary["gpu_ratio_link_gbps"] = round(links["at_gpu_ratio"], 4)
        summary["ref_tflops"] = args.ref_tflops
    summary["link_gbps"] = args.link_gbps
    for mode, fig in figures.items():
        comm_s = max(fig["step_s"] - fig["compute_s"], 0.0)
        out: dict[str, Any] = {
            "step_s": round(fig["step_s"], 4),
            "compute_s": round(fig["compute_s"], 4),
            "comm_s_loopback": round(comm_s, 4),
            "bus_bytes_per_step": round(fig["bus_bytes_per_step"]),
            "inter_node_bytes_per_step": round(fig["inter_node_bytes_per_step"]),
            "bytes_vs_zero0": None,
            "final_loss": round(fig["final_loss"], 4),
        }
        if base is not None:
            out["bytes_vs_zero0"] = round(fig["bus_bytes_per_step"] / base["bus_bytes_per_step"], 4)
        inter = fig["inter_node_bytes_per_step"]
        intra = fig["bus_bytes_per_step"] - inter
        out["modelled_step_s"] = {
            name: round(fig["compute_s"] + (inter + intra / args.intra_ratio) / (gbps * 1e9 / 8), 4)
            for name, gbps in links.items()
        }
        summary[mode] = out
    for peer in ("zero0_adam", "zero3_adam"):
        if peer not in figures:
            continue
        peer_model = summary[peer]["modelled_step_s"]
        peer_inter = max(summary[peer]["inter_node_bytes_per_step"], 1)
        for mode in modes:
            summary[mode][f"modelled_speedup_vs_{peer.split('_')[0]}"] = {
                name: round(peer_model[name] / max(value, 1e-12), 3)
                for name, value in summary[mode]["modelled_step_s"].items()
            }
            if peer == "zero3_adam":
                summary[mode]["inter_node_bytes_vs_zero3"] = round(
                    summary[mode]["inter_node_bytes_per_step"] / peer_inter, 4
                )
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--modes", type=str, default=",".join(MODES[:6]), help=f"of {MODES}")
    ap.add_argument("--n_layer", type=int, default=4)
    ap.add_argument("--n_embd", type=int, default=256)
    ap.add_argument("--n_head", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--freeze", type=int, default=5, help="compression starts after this step")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per pass")
    ap.add_argument("--link_gbps", type=float, default=100.0, help="inter-node Gb/s per rank")
    ap.add_argument(
        "--persistence",
        type=int,
        default=100_000,
        help="stage3_param_persistence_threshold (DeepSpeed's default; --tiny: 0, so its small "
        "modules are gathered and released as a large model's are)",
    )
    ap.add_argument("--node", type=int, default=1, help="ranks per emulated node")
    ap.add_argument(
        "--intra_ratio",
        type=float,
        default=18.0,
        help="intra-node link speed over the inter-node one (H100: NVLink 900 GB/s per GPU "
        "against one 400 Gb/s NDR port, 18x)",
    )
    ap.add_argument("--ref_tflops", type=float, default=125.0, help="achieved TFLOP/s per GPU")
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    ap.add_argument("--tiny", action="store_true", help="test sizes: a few seconds per mode")
    args = ap.parse_args()
    if args.tiny:
        args.n_layer, args.n_embd, args.n_head, args.vocab, args.seq = 1, 32, 2, 256, 16
        args.micro, args.freeze, args.steps, args.persistence = 2, 3, 3, 0
    unknown = sorted(set(args.modes.split(",")) - set(MODES))
    if unknown:
        raise ValueError(f"--modes: unknown {unknown}; choose from {list(MODES)}")
    if args.node < 1 or args.world % args.node:
        raise ValueError(f"--node {args.node} must divide --world {args.world}")
    with socket.socket() as sock:  # a free port: other benchmarks or tests may hold fixed ones
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    ranks = spawn_ranks(_rank_main, args.world, args.world, port, args)
    print(json.dumps(summarize(args, ranks)))


if __name__ == "__main__":
    main()
