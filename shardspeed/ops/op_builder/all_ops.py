"""``ALL_OPS``: every op's builder by its DeepSpeed name."""

from __future__ import annotations

from shardspeed.ops.op_builder.builder import OpBuilder
from shardspeed.ops.op_builder.builders import BUILDERS

ALL_OPS: dict[str, OpBuilder] = {cls.NAME: cls() for cls in BUILDERS}


def op_compatibility() -> dict[str, bool]:
    """``{op name: is_compatible()}`` for every op (DeepSpeed's ``compatible_ops``)."""
    return {name: op.is_compatible() for name, op in ALL_OPS.items()}
