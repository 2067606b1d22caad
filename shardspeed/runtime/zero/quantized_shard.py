"""Frozen parameters kept as an int8 shard (ZeRO++ ``zero_quantized_nontrainable_weights``).

A :class:`QuantizedFlatShard` is a :class:`~.flat_shard.FlatShard` whose shard is stored as the
blockwise int8 payload (:data:`~shardspeed.runtime.comm.quantize.INT8`: fp32 scales, then one
code per element) of this rank's chunk, about a quarter of the fp32 bytes (half of bf16's).
Every gather sends that payload as it is (no re-quantization) and dequantizes every rank's part.

The stored values are the dequantized ones: when the buffer's full values are taken as the
shard (at construction, after the initial broadcast, ``GatheredParameters(modifier_rank=...)``,
``load_state_dict``), each rank's chunk is quantized and the full buffer replaced by its
dequantized values, on every rank alike. So a frozen weight changes once, by at most half a
quantization step per element, and from then on every gather, state dict and checkpoint gives
exactly those values (quantizing dequantized values again gives the same values back). Only
buffers of frozen parameters are built this way (:func:`~.flat_shard.pack_flat_shards`): the
optimizer never writes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from shardspeed.runtime.comm.quantize import INT8, dequantize, quantize
from shardspeed.runtime.zero.comm_group import CommGroup
from shardspeed.runtime.zero.flat_shard import FlatShard


class QuantizedFlatShard(FlatShard):
    """A :class:`~.flat_shard.FlatShard` (over more than one rank) whose :attr:`shard` is a
    ``uint8`` payload of ``INT8.payload_nbytes(chunk_numel)`` bytes."""

    @torch.no_grad()
    def __init__(
        self,
        params: Sequence[nn.Parameter],
        offsets: Sequence[int],
        size: int,
        comm_group: CommGroup,
    ) -> None:
        assert comm_group.partitioned, "a quantized shard needs a group of several ranks"
        super().__init__(params, offsets, size, comm_group)
        self.shard = torch.empty(
            INT8.payload_nbytes(self.chunk_numel), dtype=torch.uint8, device=self.full.device
        )
        self._take_full()

    def _gather_primary(self, lossy: bool, async_op: bool) -> Any:
        del lossy  # the stored payload is what is sent: the values are the stored ones
        self.lossy = False
        return self.comm.all_gather_payload(self.full, self._source(), INT8, async_op)

    def _write_shard(self, values: torch.Tensor) -> None:
        quantize(values, INT8, out=self.shard)

    @torch.no_grad()
    def _take_full(self) -> None:
        """Quantize every rank's chunk of the full buffer (the same on every rank), keep this
        rank's payload and replace the full buffer by the dequantized values."""
        chunk = self.chunk_numel
        for member in range(self.comm.world_size):
            part = self.full[chunk * member : chunk * (member + 1)]
            mine = member == self.comm.rank
            payload = quantize(part, INT8, out=self.shard if mine else None)
            dequantize(payload, chunk, INT8, out=part)

    def values(self) -> torch.Tensor:
        """This rank's chunk, dequantized (a new tensor in the full buffer's dtype)."""
        source = self._source()
        out = torch.empty(self.chunk_numel, dtype=self.full.dtype, device=source.device)
        return dequantize(source, self.chunk_numel, INT8, out=out)

    def piece_of(self, param: torch.Tensor) -> torch.Tensor:
        """The dequantized elements of ``param`` in this rank's chunk (a copy: writing it
        does not change the stored payload)."""
        piece = self._piece_slice(param)
        if piece.start == piece.stop:
            return self.full.new_empty(0)
        return self.values()[piece]
