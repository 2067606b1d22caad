"""The engine's refusals of verbs called out of order or with an unusable argument.

Where DeepSpeed refuses the same call with an ``assert`` (``step()`` or a second ``no_sync()``
inside ``no_sync()``), the error is a :class:`NoSyncError`, both a ``RuntimeError`` and an
``AssertionError``, so code written for either catches it. The messages keep DeepSpeed's
wording, which its users' tests match, and add the fix. (DeepSpeed also refuses ``no_sync()`` at
ZeRO stages 2 and 3; shardspeed's strategies support it at every stage.)
"""

from __future__ import annotations

import os

__all__ = ["NoSyncError", "check_no_sync_entry", "check_step_allowed", "checkpoint_dir"]


class NoSyncError(RuntimeError, AssertionError):
    """A verb that ``engine.no_sync()`` does not allow (DeepSpeed asserts)."""


def check_step_allowed(no_sync: bool, coalescing: bool) -> None:
    """Refuse ``engine.step()`` inside ``no_sync()`` or ``coalesce_grad_reduction()``."""
    if no_sync:
        raise NoSyncError(
            "It is illegal to call Engine.step() inside no_sync context manager: no_sync() "
            "suppresses the gradient reduction the step needs; call step() after the block"
        )
    if coalescing:
        raise RuntimeError(
            "engine.step() inside coalesce_grad_reduction(): gradients are reduced when the "
            "block exits, so call step() after it"
        )


def check_no_sync_entry(supported: bool, nested: bool, stage: int) -> None:
    """Refuse ``engine.no_sync()`` under a strategy that must reduce every gradient as it
    arrives (not ``supported``) or inside another ``no_sync()``."""
    if not supported:
        raise NoSyncError(
            "no_sync context manager is incompatible with gradient partitioning logic of ZeRO "
            f"stage {stage}: this strategy reduces gradients as they arrive; accumulate with "
            "gradient_accumulation_steps instead"
        )
    if nested:
        raise NoSyncError(
            "no_sync() blocks cannot be nested (no_sync context manager reentry is "
            "unsupported); enter it once around the micro-steps that skip the reduction"
        )


def checkpoint_dir(value: str | os.PathLike[str] | None, argument: str, verb: str) -> str:
    """``value`` as a checkpoint folder path; an empty or missing one is refused (it would
    write into, or read from, the working directory)."""
    if value is None or not os.fspath(value):
        raise ValueError(
            f"engine.{verb}({argument}={value!r}): {argument} must name the checkpoint folder, "
            f'e.g. engine.{verb}("checkpoints"); pass "." to use the working directory'
        )
    return os.fspath(value)
