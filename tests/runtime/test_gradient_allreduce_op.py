"""``gradient_allreduce_op``: "sum" adds the data-parallel gradients where "mean" averages them."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import shardspeed
from tests.runtime.parity import MLP

LR = 0.1


def _sgd_updates(model: torch.nn.Module, stage: int, op: str, backwards: int) -> list[torch.Tensor]:
    """The parameter changes of one SGD step (``lr * reduced gradient``) after ``backwards``
    engine.backward() calls at the accumulation boundary, each on this rank's own data."""
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_allreduce_op": op,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 200},
    }
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine, *_ = shardspeed.initialize(model=model, optimizer=optimizer, config=config)
    assert engine.gradient_average == (op == "mean")  # DeepSpeed's engine attribute
    before = [p.detach().clone() for p in engine.module.parameters()]
    gen = torch.Generator().manual_seed(100 + dist.get_rank())  # every rank sees other data
    for _ in range(backwards):
        x, y = torch.randn(2, 8, generator=gen), torch.randn(2, 1, generator=gen)
        engine.backward(engine(x, y))
    engine.step()
    after = [p.detach().clone() for p in engine.module.parameters()]
    engine.destroy()
    return [b - a for b, a in zip(before, after, strict=True)]


def sum_over_mean_ratios() -> dict[str, float]:
    """For ZeRO stages 0-2 and one or two backward calls per step: the smallest and largest
    ratio of the "sum" update to the "mean" update, and the mean update's size."""
    torch.manual_seed(0)
    model = MLP(width=8)
    out: dict[str, float] = {}
    for stage in (0, 1, 2):
        for backwards in (1, 2):
            mean = _sgd_updates(model, stage, "mean", backwards)
            summed = _sgd_updates(model, stage, "sum", backwards)
            mean_flat = torch.cat([t.flatten() for t in mean])
            sum_flat = torch.cat([t.flatten() for t in summed])
            key = f"stage{stage}_x{backwards}"
            out[f"{key}_err"] = (sum_flat - dist.get_world_size() * mean_flat).abs().max().item()
            out[f"{key}_mean_norm"] = mean_flat.norm().item()
    return out


@pytest.mark.timeout(240)
def test_sum_gives_world_size_times_the_mean(dist_pool) -> None:
    result = dist_pool(2).run(sum_over_mean_ratios)[0]
    for stage in (0, 1, 2):
        for backwards in (1, 2):
            key = f"stage{stage}_x{backwards}"
            assert result[f"{key}_mean_norm"] > 1e-3, key  # the updates are not trivially zero
            assert result[f"{key}_err"] < 1e-6, (key, result)
