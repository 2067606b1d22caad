"""CPU Adam throughput: ``DeepSpeedCPUAdam`` against torch's AdamW and the memory bandwidth.

    python benchmarks/bench_cpu_adam.py                      # 100M fp32 parameters
    python benchmarks/bench_cpu_adam.py --numel 50000000 --rounds 7 --steps 5

One fp32 tensor of ``--numel`` parameters with a gradient; each round, in turn, each optimizer
is built, takes one untimed step (its state is allocated), then ``--steps`` timed steps; and a
``--numel`` fp32 copy is timed ``--steps`` times. Gparam/s = numel / seconds per step. Each
figure is the median over all timed steps of all ``--rounds`` rounds, with min and max (this
machine is shared: the max is the least disturbed figure). ``copy_gbps`` counts the bytes read
plus written by ``dst.copy_(src)``, as STREAM does; ``bound_gparam_s`` divides it by the 28
bytes an fp32 Adam step reads and writes per parameter (param, grad, two moments read; param
and moments written). ``bf16_fp32_states`` is ours on bf16 parameters with fp32 moments (the
blocked upcast path); ``shardspeed_cpu_adagrad`` and ``shardspeed_cpu_lion`` are the other CPU
optimizers on the same tensor (``--no-others`` skips them). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from shardspeed.ops.adagrad import DeepSpeedCPUAdagrad  # noqa: E402
from shardspeed.ops.adam import DeepSpeedCPUAdam  # noqa: E402
from shardspeed.ops.lion import DeepSpeedCPULion  # noqa: E402

Make = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]

OPTIMIZERS: dict[str, Make] = {
    "shardspeed_cpu_adam": lambda ps: DeepSpeedCPUAdam(ps, lr=1e-3, weight_decay=0.01),
    "torch_adamw_foreach": lambda ps: torch.optim.AdamW(
        ps, lr=1e-3, weight_decay=0.01, foreach=True
    ),
    "torch_adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, fused=True),
}
OTHERS: dict[str, Make] = {
    "shardspeed_cpu_adagrad": lambda ps: DeepSpeedCPUAdagrad(ps, lr=1e-2),
    "shardspeed_cpu_lion": lambda ps: DeepSpeedCPULion(ps, lr=1e-4, weight_decay=0.01),
}


def summary(samples: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(samples), 3),
        "min": round(min(samples), 3),
        "max": round(max(samples), 3),
    }


def time_steps(opt: torch.optim.Optimizer, steps: int) -> list[float]:
    opt.step()  # allocates the state
    out = []
    for _ in range(steps):
        start = time.perf_counter()
        opt.step()
        out.append(time.perf_counter() - start)
    return out


def time_copy(numel: int, steps: int) -> list[float]:
    src, dst = torch.randn(numel), torch.empty(numel)
    dst.copy_(src)
    out = []
    for _ in range(steps):
        start = time.perf_counter()
        dst.copy_(src)
        out.append(time.perf_counter() - start)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=int, default=100_000_000)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-bf16", action="store_true", help="skip the bf16-parameter figure")
    p.add_argument("--no-others", action="store_true", help="skip CPU Adagrad and Lion")
    args = p.parse_args()
    optimizers = OPTIMIZERS if args.no_others else {**OPTIMIZERS, **OTHERS}
    n = args.numel
    gen = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(n, generator=gen))
    param.grad = torch.randn(n, generator=gen) * 1e-2
    rates: dict[str, list[float]] = {name: [] for name in optimizers}
    rates["bf16_fp32_states"] = []
    copy_gbps: list[float] = []
    for _ in range(args.rounds):
        for name, make in optimizers.items():
            opt = make([param])
            rates[name] += [n / s / 1e9 for s in time_steps(opt, args.steps)]
            del opt
        if not args.no_bf16:
            low = torch.nn.Parameter(param.detach().bfloat16())
            low.grad = param.grad.bfloat16()
            opt = DeepSpeedCPUAdam([low], lr=1e-3, weight_decay=0.01)
            rates["bf16_fp32_states"] += [n / s / 1e9 for s in time_steps(opt, args.steps)]
            del opt, low
        copy_gbps += [8 * n / s / 1e9 for s in time_copy(n, args.steps)]
    if args.no_bf16:
        del rates["bf16_fp32_states"]
    copy = summary(copy_gbps)
    result = {
        "numel": n,
        "threads": torch.get_num_threads(),
        "steps_per_round": args.steps,
        "rounds": args.rounds,
        "gparam_s": {name: summary(samples) for name, samples in rates.items()},
        "copy_gbps": copy,
        "bound_gparam_s": {k: round(v / 28, 3) for k, v in copy.items()},
        "ours_vs_torch_fused": round(
            statistics.median(rates["shardspeed_cpu_adam"])
            / statistics.median(rates["torch_adamw_fused"]),
            3,
        ),
        "ours_vs_deepspeed_1_20": round(statistics.median(rates["shardspeed_cpu_adam"]) / 1.20, 3),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
