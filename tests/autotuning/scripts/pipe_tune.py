"""A tiny pipeline training script for the autotuner's launch test: it takes its stage count
from ``--pipeline_stages`` (what ``autotuning.arg_mappings`` gives it), builds a
``PipelineModule`` with that many stages, trains with ``engine.train_batch()`` and prints what it
got (an autotuning experiment ends inside ``train_batch`` once it is measured)."""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Iterator

import torch
from torch import nn

import shardspeed
from shardspeed.pipe import PipelineModule

WIDTH = 16


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deepspeed_config", required=True)
    parser.add_argument("--pipeline_stages", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    return parser.parse_args()


def batches(micro: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless (inputs, targets) micro-batches of a fixed linear map."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(WIDTH, WIDTH, generator=gen) / WIDTH**0.5
    for _ in itertools.count():
        x = torch.randn(micro, WIDTH, generator=gen)
        yield x, x @ weight


def main() -> None:
    args = parse_args()
    torch.manual_seed(1)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    module = PipelineModule(
        layers,
        num_stages=args.pipeline_stages,
        loss_fn=nn.functional.mse_loss,
        partition_method="uniform",
    )
    engine, *_ = shardspeed.initialize(
        model=module, model_parameters=module.parameters(), config=args.deepspeed_config
    )
    micro = engine.train_micro_batch_size_per_gpu()
    if engine.global_rank == 0:
        print(
            f"pipe script: stages {engine.num_stages} micro {micro} "
            f"accum {engine.gradient_accumulation_steps()} dp {engine.dp_world_size}",
            flush=True,
        )
    data = batches(micro)
    for step in range(args.steps):
        loss = engine.train_batch(data)
        if engine.global_rank == 0:
            print(f"pipe script: step {step} loss {float(loss):.4f}", flush=True)


if __name__ == "__main__":
    main()
