"""LAMB optimizer: :class:`FusedLamb`."""

from shardspeed.ops.lamb.fused_lamb import FusedLamb

__all__ = ["FusedLamb"]
