"""Mixture of Experts: the GPT-MoE with experts split over ranks (``ep_size`` 2) vs every expert
on every rank (``ep_size`` 1), its all-to-all bytes against the theory, and the index-based
dispatch against DeepSpeed's dense einsum dispatch, in one run.

    python benchmarks/bench_moe.py          # 2 CPU ranks, fp32, ZeRO 2, ~1.5 min when quiet

Training (``examples/gpt_moe_model.GPTMoE``: an MoE feed-forward in every other block, top-1,
capacity factor 1.0, AdamW): each ``ep_size`` runs in fresh rank processes, the modes alternate
over ``--rounds`` and the median step time gives tokens/s (all ranks' tokens). Per rank: the
parameter bytes it holds (expert and dense), DeepSpeed's model-state theory for the ZeRO stage
(expert parameters partitioned over their expert-data-parallel group of ``world / ep_size``
ranks, dense ones over all ``world``), peak RSS. Both modes train the same model on the same
data, so their losses agree (reported).

All-to-all bytes per optimizer step and rank, counted by ``shardspeed.comm``'s byte counter
(``all_to_all_single``; the MoE layer issues no other) in the forward (dispatch + combine) and
the backward (their gradients) separately: message bytes (the whole ``E x C x M`` buffer each
call, the nccl-tests convention) and bus bytes (the ``(ep-1)/ep`` of it that leaves the rank),
against the theory 2 x tokens x hidden x (ep-1)/ep x element size per MoE layer, for the forward
and again for the backward (``E x C == tokens`` at capacity factor 1.0 when experts divide the
rank's tokens).

Dispatch (one process, ``--threads`` threads): gate + dispatch + combine forward and backward
of one layer (no expert between, so only the routing is measured), shardspeed's index form
(``TopKGate.route`` -> ``dispatch`` -> ``combine``) against DeepSpeed's dense form
(``TopKGate.forward``'s ``combine_weights`` / ``dispatch_mask`` of ``tokens x experts x
capacity``, ``einsum("sec,sm->ecm")`` and ``einsum("sec,ecm->sm")``) for each
``--dispatch_sizes`` tokens x experts: median time and peak bytes of the tensors allocated (a
dispatch-mode tracker of live storages), plus the largest output and gradient difference.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_train import (
    _peak_rss_mb,
    gpt_config,
    init_rank,
    model_state_bytes,
    spawn_ranks,
)  # noqa: E402

from examples.gpt_model import synthetic_tokens  # noqa: E402
from examples.gpt_moe_model import GPTMoE, MoEConfig  # noqa: E402

A2A = "all_to_all_single"
MB = 2**20


def _moe_config(args: argparse.Namespace, ep_size: int) -> MoEConfig:
    return MoEConfig(
        num_experts=args.experts,
        ep_size=ep_size,
        k=args.k,
        capacity_factor=args.capacity_factor,
        min_capacity=4,
    )


def _ds_config(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": args.stage,
            "reduce_bucket_size": 6_250_000,
            "allgather_bucket_size": 6_250_000,
        },
    }


def _a2a(volume: dict[str, Any]) -> tuple[int, float]:
    entry = volume.get(A2A)
    return (entry["bytes"], entry["bus_bytes"]) if entry else (0, 0.0)


def _other_bus(volume: dict[str, Any]) -> float:
    return sum(v["bus_bytes"] for op, v in volume.items() if op != A2A)


def train_steps(ep_size: int, args: argparse.Namespace) -> dict[str, Any]:
    """On every rank of an initialized process group: train the GPT-MoE at ``ep_size`` for
    ``args.warmup + args.steps`` steps; this rank's step time, losses, sizes and byte counts."""
    import shardspeed
    from shardspeed import comm

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = gpt_config(args)
    torch.manual_seed(0)
    model = GPTMoE(cfg, _moe_config(args, ep_size))
    expert = sum(p.numel() for n, p in model.named_parameters() if "deepspeed_experts" in n)
    dense = sum(p.numel() for n, p in model.named_parameters() if "deepspeed_experts" not in n)
    base_rss = _peak_rss_mb()
    engine, *_ = shardspeed.initialize(model=model, config=_ds_config(args))
    steps = args.warmup + args.steps
    data = synthetic_tokens(steps * args.micro * world, cfg, seed=1).tensors
    times, losses = [], []
    a2a = {"fwd": [0, 0.0], "bwd": [0, 0.0]}
    other_bus = 0.0
    for step in range(steps):
        rows = slice((step * world + rank) * args.micro, (step * world + rank + 1) * args.micro)
        x, y = data[0][rows], data[1][rows]
        dist.barrier()
        comm.reset_comm_volume()
        start = time.perf_counter()
        loss = engine(x, y)
        forward = comm.get_comm_volume()
        engine.backward(loss)
        engine.step()
        elapsed = time.perf_counter() - start
        total = comm.get_comm_volume()
        losses.append(float(loss.detach()))
        if step < args.warmup:
            continue
        times.append(elapsed)
        fwd, all_ = _a2a(forward), _a2a(total)
        a2a["fwd"][0] += fwd[0]
        a2a["fwd"][1] += fwd[1]
        a2a["bwd"][0] += all_[0] - fwd[0]
        a2a["bwd"][1] += all_[1] - fwd[1]
        other_bus += _other_bus(total)
    engine.destroy()
    return {
        "rank": rank,
        "step_s": statistics.median(times),
        "losses": losses,
        "expert_params": expert,
        "dense_params": dense,
        "peak_rss_mb": _peak_rss_mb(),
        "rss_model_built_mb": base_rss,
        "a2a": {k: [v[0] // args.steps, v[1] / args.steps] for k, v in a2a.items()},
        "other_bus_per_step": other_bus / args.steps,
    }


def _train_rank(
    rank: int, world: int, port: int, ep_size: int, args: argparse.Namespace, queue: Any
) -> None:
    torch.set_num_threads(args.threads)
    init_rank(rank, world, port)
    queue.put(train_steps(ep_size, args))
    dist.destroy_process_group()


def _state_mb(args: argparse.Namespace, dense: int, expert: int, ep_size: int) -> float:
    """DeepSpeed's fp32 AdamW model-state bytes per rank at ``args.stage``: dense parameters
    partitioned over all ranks, this rank's experts over their expert-data-parallel group."""
    mode = f"shardspeed_stage{args.stage}"
    edp = args.world // ep_size
    return (model_state_bytes(mode, dense, args.world) + model_state_bytes(mode, expert, edp)) / MB


def moe_layers(args: argparse.Namespace) -> int:
    """MoE blocks in the GPT-MoE: blocks 1, 1 + every, ..."""
    return sum(1 for i in range(args.n_layer) if i % MoEConfig.every == 1)


def a2a_theory_bytes(args: argparse.Namespace, ep_size: int) -> float:
    """Bytes each rank sends to other ranks in one forward (or one backward): dispatch and
    combine of its ``micro x seq`` tokens per MoE layer, 2 x tokens x hidden x (ep-1)/ep x 4."""
    tokens = args.micro * args.seq
    return 2 * tokens * args.n_embd * (ep_size - 1) / ep_size * 4 * moe_layers(args)


def _training(args: argparse.Namespace) -> dict[str, Any]:
    modes = [1, 2] if args.world >= 2 else [1]
    runs: dict[int, list[list[dict[str, Any]]]] = {m: [] for m in modes}
    port = 29750
    for round_index in range(args.rounds):
        for ep_size in modes if round_index % 2 == 0 else modes[::-1]:
            port += 1
            runs[ep_size].append(
                spawn_ranks(_train_rank, args.world, args.world, port, ep_size, args)
            )
    tokens_per_rank = args.micro * args.seq
    out: dict[str, Any] = {}
    for ep_size, rounds in runs.items():
        last = rounds[-1]
        step_s = statistics.median(max(r["step_s"] for r in ranks) for ranks in rounds)
        expert, dense = last[0]["expert_params"], last[0]["dense_params"]
        theory_fwd = a2a_theory_bytes(args, ep_size)
        a2a = last[0]["a2a"]
        out[f"ep_{ep_size}"] = {
            "step_s": round(step_s, 4),
            "tokens_per_s": round(args.world * tokens_per_rank / step_s, 1),
            "expert_params_per_rank": expert,
            "dense_params_per_rank": dense,
            "param_mb_per_rank": round((expert + dense) * 4 / MB, 1),
            "expert_param_mb_per_rank": round(expert * 4 / MB, 1),
            "model_state_mb_per_rank_theory": round(_state_mb(args, dense, expert, ep_size), 1),
            "peak_rss_mb_per_rank": [
                round(max(rnd[i]["peak_rss_mb"] for rnd in rounds), 1) for i in range(args.world)
            ],
            "rss_model_built_mb_per_rank": [
                round(last[i]["rss_model_built_mb"], 1) for i in range(args.world)
            ],
            "a2a_per_step_per_rank": {
                "forward_msg_bytes": a2a["fwd"][0],
                "forward_bus_bytes": a2a["fwd"][1],
                "forward_bus_bytes_theory": theory_fwd,
                "backward_msg_bytes": a2a["bwd"][0],
                "backward_bus_bytes": a2a["bwd"][1],
                "backward_bus_bytes_theory": theory_fwd,
                "ranks_agree": all(r["a2a"] == a2a for r in last),
            },
            "other_comm_bus_mb_per_step": round(last[0]["other_bus_per_step"] / MB, 2),
            "rank0_losses": [round(v, 5) for v in last[0]["losses"]],
        }
    if len(modes) == 2:
        one, two = out["ep_1"], out["ep_2"]
        out["ep2_vs_ep1_tokens_per_s"] = round(two["tokens_per_s"] / one["tokens_per_s"], 3)
        out["ep2_vs_ep1_peak_rss"] = round(
            max(two["peak_rss_mb_per_rank"]) / max(one["peak_rss_mb_per_rank"]), 3
        )
        out["max_loss_diff_ep2_vs_ep1"] = max(
            abs(a - b) for a, b in zip(one["rank0_losses"], two["rank0_losses"], strict=True)
        )
    out["moe_layers"] = moe_layers(args)
    out["tokens_per_rank_per_step"] = tokens_per_rank
    return out


class _PeakBytes(TorchDispatchMode):
    """Live bytes of the storages that ops create while active, and their peak (storages that
    exist before, e.g. inputs and parameters, are not counted; views count once)."""

    def __init__(self, existing: list[torch.Tensor]) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen = {t.untyped_storage().data_ptr() for t in existing}

    def _free(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or key in self._seen:
                continue
            self._seen.add(key)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key, nbytes)
        return out


def _dispatch_case(tokens: int, experts: int, args: argparse.Namespace) -> dict[str, Any]:
    from shardspeed.moe.dispatch import combine, dispatch
    from shardspeed.moe.sharded_moe import TopKGate

    hidden = args.dispatch_hidden
    torch.manual_seed(0)
    gate = TopKGate(
        hidden,
        experts,
        k=args.k,
        capacity_factor=args.capacity_factor,
        min_capacity=4,
        use_rts=False,
        top2_2nd_expert_sampling=False,
    )
    x = torch.randn(tokens, hidden, requires_grad=True)
    grad_out = torch.randn(tokens, hidden)

    def index() -> torch.Tensor:
        routing = gate.route(x)
        out = combine(dispatch(x, routing), routing)
        out.backward(grad_out)
        return out.detach()

    def dense() -> torch.Tensor:
        _, combine_weights, dispatch_mask, _ = gate(x)
        buffers = torch.einsum("sec,sm->ecm", dispatch_mask.type_as(x), x)
        out = torch.einsum("sec,ecm->sm", combine_weights.type_as(x), buffers)
        out.backward(grad_out)
        return out.detach()

    fns: dict[str, Callable[[], torch.Tensor]] = {"index": index, "dense": dense}
    outputs: dict[str, torch.Tensor] = {}
    grads: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    peaks: dict[str, int] = {}
    for name, fn in fns.items():
        x.grad = gate.wg.weight.grad = None
        with _PeakBytes([x, grad_out, gate.wg.weight]) as tracker:
            outputs[name] = fn()
        assert x.grad is not None and gate.wg.weight.grad is not None
        grads[name] = (x.grad.clone(), gate.wg.weight.grad.clone())
        peaks[name] = tracker.peak
    times: dict[str, list[float]] = {name: [] for name in fns}
    for rep in range(args.dispatch_repeats):
        for name in fns if rep % 2 == 0 else list(fns)[::-1]:
            x.grad = gate.wg.weight.grad = None
            start = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - start)
    capacity = gate.route(x).capacity
    result: dict[str, Any] = {"tokens": tokens, "experts": experts, "capacity": capacity}
    for name in fns:
        result[name] = {
            "time_ms": round(statistics.median(times[name]) * 1e3, 2),
            "peak_mb": round(peaks[name] / MB, 2),
        }
    result["dense_sec_tensor_mb"] = round(tokens * experts * capacity * 4 / MB, 1)
    result["dense_vs_index_time"] = round(
        result["dense"]["time_ms"] / result["index"]["time_ms"], 2
    )
    result["dense_vs_index_peak"] = round(peaks["dense"] / peaks["index"], 2)
    pairs = [(outputs["index"], outputs["dense"])]
    pairs += list(zip(grads["index"], grads["dense"], strict=True))
    # output, input gradient, gate gradient: largest difference relative to the largest value
    result["max_rel_diff"] = max(float((a - b).abs().max() / b.abs().max()) for a, b in pairs)
    return result


def _dispatch(args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.set_num_threads(args.threads)
    cases = []
    for size in args.dispatch_sizes.split(","):
        tokens, experts = (int(v) for v in size.split("x"))
        cases.append(_dispatch_case(tokens, experts, args))
    return cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--stage", type=int, default=2, choices=(0, 1, 2))
    ap.add_argument("--n_layer", type=int, default=4)
    ap.add_argument("--n_embd", type=int, default=384)
    ap.add_argument("--n_head", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--capacity_factor", type=float, default=1.0)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dispatch_sizes", type=str, default="1024x8,4096x16,8192x32")
    ap.add_argument("--dispatch_hidden", type=int, default=512)
    ap.add_argument("--dispatch_repeats", type=int, default=3)
    args = ap.parse_args()
    os.environ.setdefault("SHARDSPEED_LOG_LEVEL", "WARNING")
    summary: dict[str, Any] = {
        "benchmark": "moe_expert_parallel",
        "device": "cpu",
        "world": args.world,
        "dtype": "fp32",
        "zero_stage": args.stage,
        "n_layer": args.n_layer,
        "n_embd": args.n_embd,
        "experts": args.experts,
        "k": args.k,
        "capacity_factor": args.capacity_factor,
        "micro_batch": args.micro,
        "seq": args.seq,
        "threads_per_rank": args.threads,
    }
    summary["training"] = _training(args)
    summary["dispatch"] = {
        "hidden": args.dispatch_hidden,
        "cases": _dispatch(args) if args.dispatch_sizes else [],
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
