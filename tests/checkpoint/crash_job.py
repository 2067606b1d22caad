"""Rank-side code of the crash-safety tests (tests/checkpoint/test_crash_safety.py).

One job trains the tiny GPT on 2 ranks (ZeRO stage 2), saves tag ``A`` after step 2 and tag ``B``
after step 3; in the killed jobs a rank's environment makes it SIGKILL itself at the k-th point
of the save of ``B`` (:mod:`shardspeed.checkpoint.crash_points`). :func:`reference_run` is the
uninterrupted job: it records every point of the save of ``B`` and the losses and parameters of
steps 4-5. :func:`resume` is the next job: it loads whatever ``latest`` (or ``tag``) names and
must train on to exactly the reference's losses and parameters.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardspeed.checkpoint import crash_points
from tests.runtime.parity import make_task, rank_rows
from tests.runtime.zero.ranks import _engine

STEPS = 5
SAVES = {"A": 2, "B": 3}  # tag -> the step after which it is saved


def _build(seed: int, **extra: Any) -> tuple[Any, Any]:
    torch.manual_seed(0)
    task = make_task("gpt", rows=STEPS * 2 * 2)
    torch.manual_seed(seed)  # a resuming job's own initial weights must not matter
    return _engine(task.build(), 2, zero={"reduce_bucket_size": 3000}, **extra), task


def _step(engine: Any, task: Any, step: int) -> float:
    x, y = task.data
    rows = rank_rows(step, 0, 2, 1)
    loss = engine(x[rows], y[rows])
    engine.backward(loss)
    engine.step()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def train_and_save(
    engine: Any, task: Any, folder: str, kill_at: int | None, events: str | None = None
) -> list[float]:
    """Steps 0-1, save A, step 2, save B (killing this process at point ``kill_at`` of it, or
    recording its points to ``events``); returns the losses."""
    losses = []
    for step in range(SAVES["B"]):
        losses.append(_step(engine, task, step))
        if step + 1 == SAVES["A"]:
            engine.save_checkpoint(folder, tag="A")
    crash_points.reset()  # points are counted from the start of the save of B
    if kill_at is not None:
        os.environ[crash_points.KILL_AT] = str(kill_at)
    if events is not None:
        os.environ[crash_points.EVENTS] = events
    try:
        engine.save_checkpoint(folder, tag="B")
    finally:
        os.environ.pop(crash_points.KILL_AT, None)
        os.environ.pop(crash_points.EVENTS, None)
    return losses


def killed_job(rank: int, port: int, folder: str, kill_at: dict[int, int]) -> None:
    """One rank of a job that is killed during the save of B (entry point of a fresh process)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="2",
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    engine, task = _build(seed=0)
    train_and_save(engine, task, folder, kill_at.get(rank))
    # the rank that was not killed stops in the save's collectives (its peer is gone) and
    # never gets here; in a job where nobody was killed, both do
    dist.destroy_process_group()


def reference_run(folder: str, events: str) -> None:
    """The uninterrupted job: every point of the save of B to ``events``.<rank>; the losses of
    every step and the final parameters to ``folder``/ref.pt."""
    engine, task = _build(seed=0)
    losses = train_and_save(engine, task, folder, None, f"{events}.{dist.get_rank()}")
    losses += [_step(engine, task, step) for step in range(SAVES["B"], STEPS)]
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    if dist.get_rank() == 0:
        torch.save({"losses": losses, "params": params}, Path(folder) / "ref.pt")
    dist.barrier()
    engine.destroy()


def resume(folder: str, reference: str, tag: str | None = None) -> str:
    """Load ``tag`` (None: what ``latest`` names), train to the end, compare bit for bit with
    the reference run; returns the tag loaded."""
    engine, task = _build(seed=123)
    path, _ = engine.load_checkpoint(folder, tag=tag)
    assert path is not None
    loaded = Path(path).parent.name
    assert engine.global_steps == SAVES[loaded], (loaded, engine.global_steps)
    ref = torch.load(reference, weights_only=True)
    losses = [_step(engine, task, step) for step in range(engine.global_steps, STEPS)]
    assert losses == ref["losses"][SAVES[loaded] :], (losses, ref["losses"])
    for name, param in engine.module.named_parameters():
        assert torch.equal(param.detach(), ref["params"][name]), name
    engine.destroy()
    return loaded
