"""Rank-side code of tests/runtime/pipe/test_dropin_pipe.py (run on every rank of a pool)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardspeed
from shardspeed.pipe import PipelineError, PipelineModule
from shardspeed.runtime.activation_checkpointing import checkpointing
from shardspeed.runtime.pipe.topology import (
    InvalidGridError,
    PipelineParallelGrid,
    PipeModelDataParallelTopology,
    ProcessTopology,
)
from shardspeed.utils import RepeatingLoader

WIDTH = 8


class Bomb(nn.Module):
    """Passes its input through; raises on call number ``armed`` (counting from 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = -1
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls - 1 == self.armed:
            raise RuntimeError(f"boom on rank {dist.get_rank()}")
        return x


def _config(micro: int = 2, gas: int = 4, **extra: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
        **extra,
    }


def _bomb_module(stages: int) -> PipelineModule:
    """A Bomb then two Linears per stage (uniform partition), an MSE loss."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(stages):
        layers += [Bomb(), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)]
    return PipelineModule(layers, num_stages=stages, loss_fn=F.mse_loss, partition_method="uniform")


def _batches(count: int, micro: int = 2, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(micro, WIDTH, generator=generator),
            torch.randn(micro, WIDTH, generator=generator),
        )
        for _ in range(count)
    ]


class _Failing:
    """An iterator over ``batches`` that raises ``ValueError`` at item ``at``."""

    def __init__(self, batches: list[Any], at: int) -> None:
        self.items: Iterator[Any] = iter(batches)
        self.at, self.index = at, 0

    def __iter__(self) -> _Failing:
        return self

    def __next__(self) -> Any:
        self.index += 1
        if self.index - 1 == self.at:
            raise ValueError(f"bad sample {self.at} on rank {dist.get_rank()}")
        return next(self.items)


def _expect_stop(fn: Any, failing_rank: int, own: type[BaseException], text: str) -> str:
    """``fn()`` raises ``own`` on ``failing_rank`` and a PipelineError naming that rank's
    stage and ``text`` everywhere else."""
    try:
        fn()
    except BaseException as caught:  # noqa: BLE001 - the type is the assertion
        if dist.get_rank() == failing_rank:
            assert isinstance(caught, own), repr(caught)
        else:
            assert isinstance(caught, PipelineError), repr(caught)
            assert f"(rank {failing_rank})" in str(caught), str(caught)
        assert text in str(caught), f"{text!r} not in {caught!r}"
        return type(caught).__name__
    raise AssertionError("no error raised")


def _still_trains(engine: Any, seed: int) -> float:
    loss = engine.train_batch(iter(_batches(4, seed=seed)))
    assert torch.isfinite(loss)
    losses = [torch.zeros(()) for _ in range(dist.get_world_size())]
    dist.all_gather(losses, loss.detach().reshape(()))
    assert all(torch.equal(x, losses[0]) for x in losses)  # every stage has the batch's loss
    return float(loss)


def reading_errors_stop_every_stage() -> list[str]:
    """A loader or batch_fn that raises on one stage: that stage raises its error, the others a
    PipelineError naming it, nothing hangs, and the engine trains on afterwards."""
    engine, *_ = shardspeed.initialize(model=_bomb_module(2), config=_config())
    rank = dist.get_rank()
    seen = []
    for failing in (0, 1):  # the first stage's loader, then the last stage's
        data = _Failing(_batches(4), at=2) if rank == failing else iter(_batches(4))
        seen.append(
            _expect_stop(lambda d=data: engine.train_batch(d), failing, ValueError, "bad sample 2")
        )
        _still_trains(engine, seed=failing)

    def broken(batch: Any) -> Any:
        raise KeyError("no such column")

    if rank == 1:
        engine.set_batch_fn(broken)
    seen.append(
        _expect_stop(lambda: engine.eval_batch(iter(_batches(4))), 1, KeyError, "no such column")
    )
    engine.set_batch_fn(lambda batch: batch)
    _still_trains(engine, seed=5)
    engine.destroy()
    return seen


def forward_errors_stop_every_stage() -> None:
    """A layer that raises in the middle of a schedule, on any stage, in the first batch (no
    activation shapes known yet: the "absent" marker travels) and in later ones (zeros of the
    known shapes stand in), in training and in evaluation: every rank raises, nothing hangs,
    nothing of the failed batch is applied, and training goes on."""
    stages = dist.get_world_size()
    module = _bomb_module(stages)
    engine, *_ = shardspeed.initialize(model=module, config=_config())
    bomb = module.forward_funcs[0]
    assert isinstance(bomb, Bomb)
    rank = dist.get_rank()
    for step, failing in enumerate(range(stages)):
        if step == 0 or failing == stages - 1:
            pass  # the first batch fails before any shape was exchanged
        else:
            _still_trains(engine, seed=10 + step)
        before = [p.detach().clone() for p in module.parameters()]
        bomb.calls, bomb.armed = 0, (1 if rank == failing else -1)  # its 2nd micro-batch
        _expect_stop(
            lambda: engine.train_batch(iter(_batches(4))), failing, RuntimeError, "boom on rank"
        )
        assert all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))
        bomb.armed = -1
    bomb.calls, bomb.armed = 0, (0 if rank == stages - 1 else -1)
    _expect_stop(
        lambda: engine.eval_batch(iter(_batches(4))), stages - 1, RuntimeError, "boom on rank"
    )
    bomb.armed = -1
    _still_trains(engine, seed=20)
    assert engine.global_steps >= 1
    engine.destroy()


def loader_in_order_and_eval_keeps_it() -> list[list[int]]:
    """With training_data the first and last stages read the shard in order (no shuffle),
    restarting at the end; eval_batch(other data) leaves the training position alone."""
    rows = torch.arange(8, dtype=torch.float32).reshape(8, 1).repeat(1, WIDTH)
    dataset = torch.utils.data.TensorDataset(rows, torch.zeros(8, WIDTH))
    torch.manual_seed(123)
    engine, _, loader, _ = shardspeed.initialize(
        model=_bomb_module(2), config=_config(micro=2, gas=1), training_data=dataset
    )
    seen: list[list[int]] = []

    def record(batch: Any) -> Any:
        seen.append([int(v) for v in batch[0][:, 0]])
        return batch

    engine.set_batch_fn(record)
    assert isinstance(engine.training_dataloader, RepeatingLoader)
    assert loader is engine.training_dataloader
    for _ in range(3):
        engine.train_batch()
    engine.eval_batch(iter(_batches(1)))
    seen.pop()  # the evaluation's batch
    for _ in range(3):
        engine.train_batch()
    engine.destroy()
    return seen


def reentrant_setting() -> None:
    """pipeline.use_reentrant and set_checkpoint_interval() as DeepSpeed's tests exercise
    them; under reentrant checkpointing the first stage's float inputs require grad."""
    mixed = nn.Sequential(
        *[nn.ReLU() for _ in range(4)], *[nn.Linear(WIDTH, WIDTH) for _ in range(4)]
    )

    def build(**module_kwargs: Any) -> PipelineModule:
        return PipelineModule(
            copy.deepcopy(mixed), num_stages=1, loss_fn=F.mse_loss, **module_kwargs
        )

    def start(pipeline: dict[str, Any], module: PipelineModule | None = None) -> Any:
        config = _config(micro=1, gas=1, pipeline=pipeline)
        return shardspeed.initialize(model=module or build(), config=config)[0]

    model = build(activation_checkpoint_interval=4)
    model._precompute_checkpointable_values()
    assert model.is_checkpointable_results == [False, True]
    model.set_checkpoint_interval(1)
    assert model.activation_checkpoint_interval == 1
    reference = build(activation_checkpoint_interval=1)
    reference._precompute_checkpointable_values()
    assert model.is_checkpointable_results == reference.is_checkpointable_results
    assert len(reference.is_checkpointable_results) == 8
    try:
        model.set_checkpoint_interval(-1)
    except ValueError as caught:
        assert isinstance(caught, AssertionError) and "interval" in str(caught)
    else:
        raise AssertionError("a negative interval was accepted")

    engine = start({"activation_checkpoint_interval": 0})
    assert not engine._reentrant_activation_checkpointing()
    engine.module.set_checkpoint_interval(2)
    assert engine._reentrant_activation_checkpointing()
    engine.destroy()

    engine = start({"activation_checkpoint_interval": 1, "use_reentrant": False})
    assert engine.module.activation_checkpoint_interval > 0
    assert engine.module.activation_checkpoint_func is checkpointing.non_reentrant_checkpoint
    assert not engine._reentrant_activation_checkpointing()
    engine.destroy()

    engine = start({"activation_checkpoint_interval": 0, "use_reentrant": False})
    assert engine.module.activation_checkpoint_func is checkpointing.non_reentrant_checkpoint
    engine.module.set_checkpoint_interval(1)
    assert engine.module.activation_checkpoint_func is checkpointing.non_reentrant_checkpoint
    assert not engine._reentrant_activation_checkpointing()
    engine.destroy()

    # both functions train to the same numbers; only the reentrant one marks the inputs
    losses = []
    x = torch.randn(1, WIDTH, generator=torch.Generator().manual_seed(dist.get_rank()))
    for use_reentrant in (True, False):
        module = build()
        marks: list[bool] = []
        module.forward_funcs[0].register_forward_pre_hook(
            lambda _m, args, marks=marks: marks.append(args[0].requires_grad)
        )
        engine = start(
            {"activation_checkpoint_interval": 1, "use_reentrant": use_reentrant}, module
        )
        losses.append(float(engine.train_batch(iter([(x, torch.zeros(1, WIDTH))]))))
        assert marks[0] is use_reentrant
        assert not x.requires_grad  # the caller's tensor is left alone
        engine.destroy()
    assert losses[0] == losses[1]


def grid_as_deepspeed() -> dict[str, Any]:
    """The grid's rank lists and process groups under DeepSpeed's names, on this world."""
    world, rank = dist.get_world_size(), dist.get_rank()
    topology = ProcessTopology(axes=["pipe", "data"], dims=[2, world // 2])
    grid = PipelineParallelGrid(topology=topology)
    assert grid._is_grid_valid()
    assert grid.is_first_stage == (grid.get_stage_id() == 0)
    total = torch.tensor([rank])
    dist.all_reduce(total, group=grid.get_pipe_parallel_group())
    assert int(total) == sum(grid.pp_group) and rank in grid.pp_group
    assert grid.pp_proc_group is grid.get_pipe_parallel_group()
    total = torch.tensor([rank])
    dist.all_reduce(total, group=grid.get_data_parallel_group())
    assert int(total) == sum(grid.dp_group) and grid.dp_proc_group is grid.get_data_parallel_group()
    assert grid.p2p_groups[rank] == [rank, grid.pp_group[(grid.pp_group.index(rank) + 1) % 2]]
    try:
        PipelineParallelGrid(topology=ProcessTopology(axes=["pipe", "data"], dims=[world, 2]))
    except InvalidGridError as caught:
        assert isinstance(caught, AssertionError) and isinstance(caught, ValueError)
    else:
        raise AssertionError("a grid larger than the world was accepted")
    default = PipelineParallelGrid()  # the world's prime factors, dealt to pipe then data
    out: dict[str, Any] = {
        "default": [default.pipe_parallel_size, default.data_parallel_size],
    }
    if world == 4:
        three_d = PipelineParallelGrid(PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1))
        out["3d"] = [
            three_d.model_parallel_size,
            three_d.get_model_parallel_world_size(),
            three_d.slice_group,
            three_d.get_slice_parallel_rank(),
        ]
    return out
