"""ZeRO stage 1: optimizer state (and fp32 master weights) partitioned across data-parallel ranks.

Gradients stay full-size on every rank (``.grad`` views of flat bucket buffers, as in stage 0)
and are reduce-scattered at the accumulation boundary, in place: each rank's own chunk of its
gradient buffers receives the reduced gradient of the partition it updates, so no separate
gradient partition exists. The machinery is shared with stage 2 in
:mod:`~shardspeed.runtime.zero.partitioned`.
"""

from __future__ import annotations

from shardspeed.runtime.zero.partitioned import PartitionedStrategy


class OptimizerStateStrategy(PartitionedStrategy):
    """Stage 1: partitioned optimizer state, full gradients, reduce-scatter + all-gather."""

    stage = 1
    staged_gradients = False
