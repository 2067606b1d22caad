"""ZeRO stage 2: stage 1 plus partitioned gradients.

In the backward that reduces (the accumulation boundary), each gradient is copied into its
bucket as soon as autograd finalises it and ``.grad`` is dropped; a full bucket is
reduce-scattered straight away, its owner keeps the reduced chunk in a partition-sized buffer
(freed again after the step), and the bucket's memory is released. No rank ever holds a full reduced gradient, only its
partition and the bucket in flight. Between boundaries gradients accumulate locally in the
model's ``.grad`` (low precision), so communication stays one reduce-scatter per step, and
``engine.no_sync()`` works as it does for stage 0.
"""

from __future__ import annotations

from shardspeed.runtime.zero.partitioned import PartitionedStrategy


class GradientPartitionStrategy(PartitionedStrategy):
    """Stage 2: partitioned optimizer state and gradients, bucketed reduce-scatter in backward."""

    stage = 2
    staged_gradients = True
    supports_no_sync = True
