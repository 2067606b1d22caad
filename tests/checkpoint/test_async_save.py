"""Asynchronous save (``checkpoint.writer.decoupled``): training goes on while a background
thread writes a snapshot; the files are those a synchronous save writes, byte for byte; a writer
failure surfaces at the next join on every rank, and ``latest`` never names a failed save."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardspeed.checkpoint import crash_points
from tests.runtime.parity import make_task, rank_rows
from tests.runtime.zero.ranks import _engine

DECOUPLED = {"checkpoint": {"writer": {"decoupled": True}}}


def _build(stage: int) -> tuple[Any, Any]:
    torch.manual_seed(0)
    task = make_task("gpt", rows=64 * 2 * dist.get_world_size())
    engine = _engine(task.build(), stage, zero={"reduce_bucket_size": 3000}, **DECOUPLED)
    return engine, task


def _step(engine: Any, task: Any, step: int) -> float:
    start = time.perf_counter()
    x, y = task.data
    rows = rank_rows(step, 0, 2, 1)
    engine.backward(engine(x[rows], y[rows]))
    engine.step()
    return time.perf_counter() - start


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name != "manifest.json"}


def same_bytes_as_sync(folder: str, stage: int) -> None:
    """The same state saved synchronously and in the background, then trained on at once (the
    live tensors change while the thread writes): the files are equal byte for byte."""
    base = Path(folder)
    engine, task = _build(stage)
    for step in range(3):
        _step(engine, task, step)
    writer = engine.config.checkpoint.writer
    writer.decoupled = False
    engine.save_checkpoint(folder, tag="sync")
    writer.decoupled = True
    engine.save_checkpoint(folder, tag="async")
    assert engine.pending_checkpoint is not None
    for step in range(3, 6):
        _step(engine, task, step)
    engine.wait_for_checkpoint()
    assert (base / "latest").read_text() == "async"
    sync, background = _files(base / "sync"), _files(base / "async")
    assert sync.keys() == background.keys() and len(sync) >= 1
    for name, data in sync.items():
        assert background[name] == data, name
    engine.destroy()


def training_goes_on(folder: str) -> dict[str, float]:
    """With a slow disk (a delay at every write), the steps taken while the thread writes take
    about as long as steps without a save, and save_checkpoint returns at once."""
    engine, task = _build(2)
    baseline = [_step(engine, task, step) for step in range(8)]
    os.environ[crash_points.DELAY_S] = "0.005"
    try:
        start = time.perf_counter()
        engine.save_checkpoint(folder, tag="slow")
        returned_s = time.perf_counter() - start
        pending = engine.pending_checkpoint
        assert pending is not None and pending.thread is not None
        # the same number of steps on every rank (each step's collectives pair up)
        during = [_step(engine, task, step) for step in range(8, 16)]
        still_writing = pending.thread.is_alive()
        pending.thread.join()
        write_s = time.perf_counter() - start
        engine.wait_for_checkpoint()
    finally:
        os.environ.pop(crash_points.DELAY_S, None)
    assert (Path(folder) / "latest").read_text() == "slow"
    engine.destroy()
    return {
        "save_returned_s": returned_s,
        "write_s": write_s,
        "steps_while_writing": float(still_writing),
        "step_s_without_save": sorted(baseline)[len(baseline) // 2],
        "step_s_during_save": sorted(during)[len(during) // 2],
    }


def failure_surfaces_at_the_join(folder: str) -> None:
    base, rank = Path(folder), dist.get_rank()
    engine, task = _build(2)
    _step(engine, task, 0)
    engine.save_checkpoint(folder, tag="good")
    engine.wait_for_checkpoint()
    expected = "injected checkpoint write failure" if rank == 1 else "another rank failed to write"
    for join in ("wait_for_checkpoint", "next save_checkpoint"):
        if rank == 1:  # the third write: in the middle of rank 1's shard
            os.environ[crash_points.FAIL_AT] = "3"
            crash_points.reset()
        try:  # the thread reads the variable: keep it until the join
            engine.save_checkpoint(folder, tag="bad")  # returns: the thread fails later
            _step(engine, task, 1)
            with pytest.raises(RuntimeError, match=expected):
                if join == "wait_for_checkpoint":
                    engine.wait_for_checkpoint()
                else:
                    engine.save_checkpoint(folder, tag="after")
        finally:
            os.environ.pop(crash_points.FAIL_AT, None)
        dist.barrier()  # rank 0 removes what the failed save staged
        assert (base / "latest").read_text() == "good"
        assert not (base / "bad").exists() and not (base / ".bad.saving").exists()
    engine.wait_for_checkpoint()  # nothing in flight any more
    engine.save_checkpoint(folder, tag="after")
    engine.destroy()  # joins the save in flight
    assert (base / "latest").read_text() == "after"


@pytest.mark.parametrize("stage", [0, 2])
def test_background_save_equals_a_synchronous_one(dist_pool, tmp_path, stage):
    dist_pool(2).run(same_bytes_as_sync, str(tmp_path), stage)


@pytest.mark.timeout(240)
def test_training_goes_on_during_a_background_save(dist_pool, tmp_path):
    figures = dist_pool(2).run(training_goes_on, str(tmp_path))
    print("async save on a slow disk, per rank:", figures)
    for rank in figures:
        assert rank["save_returned_s"] < rank["write_s"] / 4, rank
        assert rank["steps_while_writing"] == 1.0, rank  # all 8 steps ran during the write
        assert rank["step_s_during_save"] < 3 * rank["step_s_without_save"] + 0.01, rank


def test_a_writer_failure_surfaces_at_the_next_join(dist_pool, tmp_path):
    dist_pool(2).run(failure_surfaces_at_the_join, str(tmp_path))
