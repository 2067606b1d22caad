"""Rank-side code for the strategy contract tests (run on every rank of a ``dist_pool``)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardspeed import comm
from shardspeed.runtime.precision.policy import PrecisionPolicy
from shardspeed.runtime.zero.comm_group import CommGroup
from shardspeed.runtime.zero.grad_norm import GradNormReducer
from shardspeed.runtime.zero.records import ParamRecord, record_of
from shardspeed.runtime.zero.reduce_options import GradReduceOptions
from shardspeed.runtime.zero.registry import STRATEGIES
from shardspeed.runtime.zero.strategy import StrategyContext, ZeroStrategy, strategy_of
from shardspeed.utils import safe_get_full_grad
from tests.runtime.parity import MLP


def _world() -> CommGroup:
    return CommGroup(None, dist.get_rank(), dist.get_world_size())


def _context(
    comm_for: Callable[[ParamRecord], CommGroup] | None = None, bucket_size: int = 100
) -> StrategyContext:
    return StrategyContext(
        precision=PrecisionPolicy(),
        reduce=GradReduceOptions(bucket_size=bucket_size),
        data_parallel=_world(),
        device=torch.device("cpu"),
        comm_for=comm_for,
    )


def _local_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    reference = copy.deepcopy(model)
    loss = reference(x, y)
    return [g.detach() for g in torch.autograd.grad(loss, list(reference.parameters()))]


def _mean_over(tensor: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    total = tensor.clone()
    dist.all_reduce(total, group=group)
    return total / size


def every_strategy_through_one_interface() -> list[int]:
    """Each registered strategy, built the same way: forward/eval and the full state dict with
    no optimizer, then one training step through the interface, the norm from one reducer,
    fragments for every trained parameter, versioned checkpoint state, and a clean destroy."""
    stages = []
    rank, world = dist.get_rank(), dist.get_world_size()
    for stage, cls in sorted(STRATEGIES.items()):
        torch.manual_seed(0)
        model = MLP(width=8)
        if rank == 1:  # the placement must start every rank from rank 0's weights
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
        strategy: ZeroStrategy = cls(model, _context())
        assert strategy.stage == stage and strategy.optimizer is None and not strategy.groups
        strategy.place_module()
        state = strategy.full_state_dict()
        assert state.keys() == model.state_dict().keys()
        gathered = [torch.zeros_like(state["net.0.weight"]) for _ in range(world)]
        dist.all_gather(gathered, state["net.0.weight"])
        assert all(torch.equal(g, gathered[0]) for g in gathered)
        x, y = torch.randn(4, 8) + rank, torch.randn(4, 1)
        with torch.no_grad():  # eval needs no optimizer
            assert torch.isfinite(model(x, y))
        assert strategy_of(next(model.parameters())) is strategy
        expected = [_mean_over(g, None, world) for g in _local_grads(model, x, y)]

        strategy.bind_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
        strategy.begin_backward(reduce=True)
        model(x, y).backward()
        strategy.end_backward()
        for param, want in zip(model.parameters(), expected, strict=True):
            got = safe_get_full_grad(param)
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        strategy.prepare_step(1.0)
        reducer = GradNormReducer()
        assert not reducer.any_overflow(strategy.overflow_flags(), strategy.placement.device)
        norm = reducer.global_norm(strategy.grad_squares(), strategy.placement.device)
        torch.testing.assert_close(
            norm, torch.linalg.vector_norm(torch.cat([e.flatten() for e in expected]))
        )
        before = [p.detach().clone() for p in model.parameters()]
        strategy.optimizer_step()
        strategy.zero_grad()
        assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
        assert all(strategy.param_fragment(p) is not None for p in model.parameters())
        saved = strategy.state_dict()
        assert saved["stage"] == stage and saved["layout_version"] >= 1
        strategy.destroy()
        assert record_of(next(model.parameters())) is None
        stages.append(stage)
    return stages


def two_groups_reduce_on_their_own_process_groups(stage: int) -> None:
    """The Mixture-of-Experts shape: the "expert" layer's parameters on a shard group over
    ranks {0, 1} or {2, 3}, the rest over all four ranks. Each parameter's reduced gradient is
    the mean over its own group only."""
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 4
    pairs = [comm.new_group(ranks=[0, 1]), comm.new_group(ranks=[2, 3])]
    pair = CommGroup(pairs[rank // 2], rank % 2, 2)

    def comm_for(record: ParamRecord) -> CommGroup:
        return pair if record.name.startswith("net.2.") else _world()

    torch.manual_seed(0)
    model = MLP(width=8)
    unsharded = copy.deepcopy(model)  # stage 3 keeps only shards of ``model``
    strategy = STRATEGIES[stage](model, _context(comm_for, bucket_size=40))
    strategy.place_module()
    strategy.bind_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    assert len(strategy.groups) == 2
    assert {g.comm.world_size for g in strategy.groups} == {2, 4}
    x, y = torch.randn(4, 8) * (rank + 1), torch.randn(4, 1)
    local = _local_grads(unsharded, x, y)
    strategy.begin_backward(reduce=True)
    model(x, y).backward()
    strategy.end_backward()
    for (name, param), grad in zip(model.named_parameters(), local, strict=True):
        expert = name.startswith("net.2.")
        want = _mean_over(grad, pair.group if expert else None, 2 if expert else 4)
        everyone = _mean_over(grad, None, 4)
        got = safe_get_full_grad(param)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        if expert:  # and not the all-ranks mean: the pairs' inputs differ
            assert not torch.allclose(got, everyone), name
    strategy.prepare_step(1.0)
    reducer = GradNormReducer()
    norm = reducer.global_norm(strategy.grad_squares(), torch.device("cpu"))
    # an expert pair's norm: its own group's mean gradients plus the shared ones
    full = [
        _mean_over(
            g, pair.group if n.startswith("net.2.") else None, 2 if n.startswith("net.2.") else 4
        )
        for (n, _), g in zip(model.named_parameters(), local, strict=True)
    ]
    torch.testing.assert_close(
        norm, torch.linalg.vector_norm(torch.cat([f.flatten() for f in full]))
    )
    strategy.optimizer_step()
    strategy.zero_grad()
    strategy.destroy()
