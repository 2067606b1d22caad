"""Error-compensated 1-bit all-reduce: DeepSpeed's "compressed" communication backend.

Each rank's buffer ``x`` (flattened, zero-padded to ``n`` elements, a multiple of ``8 * world``)
is averaged over the group in two phases, each sending one sign bit per element plus one scale:

1. worker: ``c = x + worker_error``; ``scale = ||c|| / sqrt(n)``; ``worker_error = c - scale *
   sign(c)``. The signs, packed 8 per byte, are split into ``world`` chunks and exchanged with
   ``all_to_all_single`` (rank ``r`` receives every rank's chunk ``r``); the scales with
   ``all_gather``.
2. server (every rank serves its chunk): ``s = mean_i(scale_i * sign_i) + server_error``;
   ``server_scale = ||s|| / sqrt(n / world)``; ``server_error = s - server_scale * sign(s)``.
   The packed signs and scales are ``all_gather``\\ ed, and every rank rebuilds the whole
   averaged buffer as ``server_scale_j * sign_j`` for chunk ``j``.

:meth:`CompressedBackend.compressed_allreduce_many` averages several buffers with the same
numerics, each with its own scales, error buffers and chunking, but in 4 collectives in all:
each phase's signs and scales of every buffer travel in one message.

``sign(0)`` is +1 (one bit cannot say zero). Bus bytes: ``(world-1)/world * n/4`` against the fp32
all-reduce's ``(world-1)/world * 8n``, i.e. 1/32, plus ``8 * world`` bytes of scales. Only
:mod:`shardspeed.comm` collectives are used, so it runs on any backend (gloo, nccl, ...);
DeepSpeed's "nccl" and "mpi" 1-bit backends compute the same thing with other transports.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from shardspeed import comm

#: bit weights of one packed byte, most significant first
_BIT_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


def padded_size(numel: int, world_size: int) -> int:
    """``numel`` rounded up to a multiple of ``8 * world_size`` (whole bytes per rank's chunk)."""
    unit = 8 * max(world_size, 1)
    return max(unit, -(-numel // unit) * unit)


def signs(tensor: torch.Tensor) -> torch.Tensor:
    """+1 where ``tensor >= 0`` (zero included), -1 elsewhere, as float32."""
    return torch.where(tensor >= 0, 1.0, -1.0).to(torch.float32)


def pack_signs(tensor: torch.Tensor) -> torch.Tensor:
    """One bit per element of ``tensor`` (1 for ``>= 0``), 8 per uint8; ``numel % 8 == 0``."""
    bits = (tensor.reshape(-1, 8) >= 0).to(torch.uint8)
    return (bits * _BIT_WEIGHTS.to(bits.device)).sum(dim=1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """The +1/-1 float32 signs that :func:`pack_signs` packed into ``packed``."""
    shifts = torch.arange(7, -1, -1, device=packed.device, dtype=torch.uint8)
    bits = (packed.reshape(-1, 1) >> shifts) & 1
    return bits.reshape(-1).to(torch.float32).mul_(2.0).sub_(1.0)


def _compress(values: torch.Tensor, error: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``values + error`` as (scale, packed signs); ``error`` becomes what they miss."""
    values = values.add(error)
    scale = torch.linalg.vector_norm(values) / math.sqrt(values.numel())
    error.copy_(values - scale * signs(values))
    return scale.reshape(1), pack_signs(values)


class CompressedBackend:
    """The 1-bit averaging of buffers over one process group (``None``: the world)."""

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.size = comm.get_world_size(group) if comm.is_initialized() else 1
        self.rank = comm.get_rank(group) if comm.is_initialized() else 0

    def padded_size(self, numel: int) -> int:
        """The worker-error length for a buffer of ``numel`` elements."""
        return padded_size(numel, self.size)

    def compressed_allreduce(
        self, buffer: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor
    ) -> torch.Tensor:
        """Replace ``buffer`` by the group's error-compensated 1-bit average of it (in place,
        also returned); ``worker_error`` (:meth:`padded_size` elements) and ``server_error``
        (that over the group size) are updated. Every rank ends with the same values."""
        return self.compressed_allreduce_many([buffer], [worker_error], [server_error])[0]

    def compressed_allreduce_many(
        self,
        buffers: Sequence[torch.Tensor],
        worker_errors: Sequence[torch.Tensor],
        server_errors: Sequence[torch.Tensor],
    ) -> list[torch.Tensor]:
        """:meth:`compressed_allreduce` of every buffer, bit-identical to one call per buffer
        (each keeps its own scales, error buffers and chunking), in 4 collectives in all.

        Every rank must pass buffers of the same sizes in the same order."""
        if not len(buffers) == len(worker_errors) == len(server_errors):
            raise ValueError(
                f"compressed_allreduce_many: {len(buffers)} buffers, {len(worker_errors)} "
                f"worker errors and {len(server_errors)} server errors; pass one of each per buffer"
            )
        if not buffers:
            return []
        chunks: list[int] = []
        for buffer, worker_error, server_error in zip(
            buffers, worker_errors, server_errors, strict=True
        ):
            n = worker_error.numel()
            if (
                server_error.numel() != n // self.size
                or n % (8 * self.size) != 0
                or n < buffer.numel()
            ):
                raise ValueError(
                    f"compressed_allreduce: error buffers of {n} and {server_error.numel()} "
                    f"elements do not fit a buffer of {buffer.numel()} over {self.size} ranks; "
                    "size them with padded_size()"
                )
            chunks.append(n // self.size)
        device = buffers[0].device
        scales, packed = [], []
        for buffer, worker_error in zip(buffers, worker_errors, strict=True):
            flat = torch.zeros(worker_error.numel(), dtype=torch.float32, device=device)
            flat[: buffer.numel()] = buffer.reshape(-1)
            scale, signs_packed = _compress(flat, worker_error)
            scales.append(scale)
            packed.append(signs_packed.reshape(self.size, -1))
        chunk_bytes = [c // 8 for c in chunks]
        # phase 1: row r of the send buffer holds every buffer's chunk r, so rank r receives,
        # in one all_to_all, every rank's signs of its chunk of every buffer
        send = torch.cat(packed, dim=1).reshape(-1)
        received = torch.empty_like(send)
        comm.all_to_all_single(received, send, group=self.group)
        local_scales = torch.cat(scales)
        gathered = [torch.empty_like(local_scales) for _ in range(self.size)]
        comm.all_gather(gathered, local_scales, group=self.group)
        # (rank, buffer) scales; column i, divided as the single call does, weights buffer i
        all_scales = torch.stack(gathered)
        by_buffer = received.reshape(self.size, -1).split(chunk_bytes, dim=1)
        server_scales, server_packed = [], []
        for i, (part, server_error) in enumerate(zip(by_buffer, server_errors, strict=True)):
            worker_signs = unpack_signs(part.contiguous()).reshape(self.size, chunks[i])
            weights = all_scales[:, i].reshape(self.size, 1) / self.size
            served = (worker_signs * weights).sum(dim=0)
            # phase 2: compress this rank's averaged chunk again and share it with everyone
            scale, signs_packed = _compress(served, server_error)
            server_scales.append(scale)
            server_packed.append(signs_packed)
        local_packed = torch.cat(server_packed)
        packed_from = [torch.empty_like(local_packed) for _ in range(self.size)]
        comm.all_gather(packed_from, local_packed, group=self.group)
        local_server_scales = torch.cat(server_scales)
        scales_from = [torch.empty_like(local_server_scales) for _ in range(self.size)]
        comm.all_gather(scales_from, local_server_scales, group=self.group)
        server_all = torch.stack(scales_from)
        per_rank = torch.stack(packed_from).split(chunk_bytes, dim=1)
        for i, buffer in enumerate(buffers):
            rebuilt = unpack_signs(per_rank[i].contiguous()).reshape(self.size, chunks[i])
            rebuilt.mul_(server_all[:, i].reshape(self.size, 1))
            buffer.copy_(rebuilt.reshape(-1)[: buffer.numel()].view_as(buffer))
        return list(buffers)


def exchanged_bytes(numel: int, world_size: int) -> tuple[int, int]:
    """Bus bytes per rank of one compressed average of ``numel`` elements, and of the fp32
    all-reduce it replaces (nccl-tests bus factors, as :mod:`shardspeed.comm.volume`)."""
    n = padded_size(numel, world_size)
    ring = (world_size - 1) / world_size
    compressed = ring * (n // 8) * 2 + ring * 4 * world_size * 2
    return int(compressed), int(2 * ring * 4 * numel)
