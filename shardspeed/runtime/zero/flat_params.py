"""Model parameters stored as views of one flat buffer per gradient bucket (ZeRO stages 1 and 2).

Each trainable parameter's ``.data`` becomes a view into its bucket's flat buffer, laid out
exactly as the bucket's gradients (same offsets, same padding). Rank ``r``'s chunk of a bucket is
then a contiguous slice of the model's weights, so

* after the optimizer step the chunks are all-gathered *in place* into the buffer: no gather
  buffer, no copy back into the parameters;
* with fp32 parameters the optimizer can step the chunk itself: the fp32 master partition *is*
  the model's own memory, not a second copy (DeepSpeed keeps a separate fp32 partition).

Module code sees ordinary parameters (same objects, same shapes); only their storage moved.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardspeed.runtime.zero.buckets import GradBucket


class FlatParams:
    """One flat parameter buffer per bucket, holding every parameter of the bucket."""

    @torch.no_grad()
    def __init__(self, buckets: Sequence[GradBucket]) -> None:
        self.buffers: list[torch.Tensor] = []
        for bucket in buckets:
            first = bucket.params[0]
            flat = torch.zeros(bucket.size, dtype=first.dtype, device=first.device)
            for param, offset in zip(bucket.params, bucket.offsets, strict=True):
                view = flat[offset : offset + param.numel()].view(param.shape)
                view.copy_(param.detach())
                # the old storage is freed here (unless the caller holds on to it)
                param.data = view
            self.buffers.append(flat)

    def chunk(self, bucket: int, chunk_slice: slice) -> torch.Tensor:
        """A view of this rank's chunk of bucket ``bucket``'s parameters."""
        return self.buffers[bucket][chunk_slice]
