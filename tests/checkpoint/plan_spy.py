"""Rank-side helpers for the checkpoint planner's tests: catch the plans the one reader returns,
and edit a saved record as a damaged or mismatched checkpoint would have it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from shardspeed.checkpoint.planner import OPTIMIZER, PLAN_KEY, LoadPlan
from shardspeed.runtime import checkpoint_reader


@contextmanager
def captured_plans() -> Iterator[list[LoadPlan]]:
    """The plans :func:`~shardspeed.runtime.checkpoint_reader.read_checkpoint` (the one
    reader) returns while the block runs, in order: a load that did not go through it leaves
    the list empty."""
    real = checkpoint_reader.read_checkpoint
    plans: list[LoadPlan] = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        loaded = real(*args, **kwargs)
        if loaded is not None:
            plans.append(loaded.plan)
        return loaded

    checkpoint_reader.read_checkpoint = spy  # type: ignore[assignment]
    try:
        yield plans
    finally:
        checkpoint_reader.read_checkpoint = real  # type: ignore[assignment]


def check_plan(plan: LoadPlan, recorded: bool = True) -> None:
    """``plan`` was checked against a record (or, ``recorded=False``, the checkpoint had none)
    and the record holds every optimizer tensor the model needs."""
    assert plan.recorded == recorded, plan
    if recorded:
        missing = [
            n for n in plan.expected.get(OPTIMIZER, {}) if (OPTIMIZER, n) not in plan.sources
        ]
        assert not missing, missing


def edit_record(path: Path, edit: Callable[[dict[str, Any]], str] | None) -> str | None:
    """Rewrite the model-states file ``path`` with its record changed by ``edit`` (None: the
    record removed, as written before it existed); the tag's manifest goes (the file's size
    changed, as in a tag written without one). Returns the name of the tensor ``edit``
    changed."""
    state = torch.load(path, weights_only=True)
    name = None
    if edit is None:
        del state[PLAN_KEY]
    else:
        name = edit(state[PLAN_KEY])
    torch.save(state, path)
    (path.parent / "manifest.json").unlink(missing_ok=True)
    return name


def transpose_recorded(name: str) -> Callable[[dict[str, Any]], str]:
    """An edit recording tensor ``name`` (2-D) with its dimensions swapped in every file."""

    def edit(record: dict[str, Any]) -> str:
        for held in record["files"]:
            piece = held["pieces"].get(name)
            if piece is not None:
                piece["global_shape"] = piece["global_shape"][::-1]
                if not piece["flat"]:
                    piece["local_shape"] = piece["local_shape"][::-1]
        return name

    return edit


def shift_flat_piece(file: str, by: int, shrink: int = 0) -> Callable[[dict[str, Any]], str]:
    """An edit moving the first flat piece of ``file`` that starts past a tensor's first element
    by ``by`` elements (and shortening it by ``shrink``); returns the tensor's name."""

    def edit(record: dict[str, Any]) -> str:
        held = next(f for f in record["files"] if f["name"] == file)
        for name, piece in held["pieces"].items():
            if piece["flat"] and piece["offsets"][0] > 0:
                piece["offsets"][0] += by
                piece["local_shape"][0] -= shrink
                return str(name)
        raise AssertionError(f"no flat piece past a tensor's start in {file}")

    return edit
