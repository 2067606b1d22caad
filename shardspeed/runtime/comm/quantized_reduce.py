"""ZeRO++ qgZ: a reduce-scatter (sum) carried by quantized all-to-alls, with LoCo's error
feedback.

The group's ranks are numbered in mixed radix over the *levels* (innermost first): with a node
level of ``k`` ranks and a cross-node level of ``G``, group rank ``r = g * k + l``. The source's
``N = G * k`` equal chunks go through one all-to-all per level:

1. node level: the source is cut into ``k`` pieces, piece ``l'`` holding the chunks
   ``{g' * k + l'}`` for every ``g'`` (what node rank ``l'`` ends up responsible for). Each
   piece is quantized into one payload (scales, then codes: :mod:`.quantize`), the payloads are
   exchanged with one ``all_to_all_single`` over the node group, and the ``k`` pieces that
   arrive are dequantized and summed in fp32: this rank now holds its node's partial sums of
   ``G`` chunks.
2. cross level: each of those ``G`` chunks is quantized, one ``all_to_all_single`` over the
   ranks at the same place in the other nodes sends chunk ``g' * k + l`` to node ``g'``, and the
   ``G`` arrivals summed in fp32 are chunk ``r`` summed over every rank.

One level (the whole group at once) is the same with ``k = N``. Each level moves one payload
of ``numel / (ranks before it)`` elements per destination (int4: a quarter byte each plus a
4-byte scale per block), so the cross-node bytes are those of the node's partial sums, not of
every rank's gradient.

**LoCo** (arXiv 2407.04480, as DeepSpeed's ``loco_swizzled_quant`` kernels apply it): at each
level the rows about to be quantized are first compensated with that level's error buffer,
``c = x + e``, and after quantizing, ``e <- beta * e + (1 - beta) * (c - deQ(Q(c)))``. Summed over
many reductions of similar values the quantization errors then cancel instead of adding up
(``sum(deQ) - sum(x) = (e_0 - e_T) / (1 - beta)`` telescopes). The buffers are fp32, one per
level and reduction key, cleared every ``reset_t`` reductions of that key. An element whose
update is not finite (an fp16 overflow the loss scaler will skip) keeps its previous error, so
one overflowing step does not poison the buffers until the next reset. Memory: per key, the
node level's buffer is the whole source and the cross level's ``1/k`` of it, i.e. ``4 (1 + 1/k)``
bytes per element reduced (ZeRO-3 reduces every bucket on every rank: that much per model
element on each rank, beside the shards).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from shardspeed import comm
from shardspeed.comm import ProcessGroup
from shardspeed.runtime.comm.quantize import INT4, QuantSpec, dequantize, quantize


@dataclass(frozen=True)
class Level:
    """One all-to-all of a quantized reduce-scatter: its group (None: the world) and size."""

    group: ProcessGroup | None
    size: int


@dataclass
class ErrorFeedback:
    """LoCo's state for one reduction key: an fp32 error buffer per level (each shaped like the
    rows that level quantizes) and how many reductions used them."""

    err_beta: float
    reset_t: int
    buffers: list[torch.Tensor | None] = field(default_factory=list)
    reductions: int = 0

    def begin(self, levels: int) -> None:
        """A reduction starts: clear the buffers when ``reset_t`` reductions have passed."""
        if len(self.buffers) != levels:
            self.buffers = [None] * levels
        if self.reductions and self.reductions % self.reset_t == 0:
            for buffer in self.buffers:
                if buffer is not None:
                    buffer.zero_()
        self.reductions += 1

    def buffer(self, level: int, like: torch.Tensor) -> torch.Tensor:
        """Level ``level``'s buffer, zeros shaped like ``like`` when new (or when the reduction
        under this key changed size)."""
        buffer = self.buffers[level]
        if buffer is None or buffer.shape != like.shape or buffer.device != like.device:
            buffer = self.buffers[level] = torch.zeros_like(like, dtype=torch.float32)
        return buffer

    def nbytes(self) -> int:
        """The memory the buffers hold."""
        return sum(b.numel() * b.element_size() for b in self.buffers if b is not None)


def quantize_rows(rows: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """One payload per row of the 2-D float tensor ``rows``: a ``(rows, payload bytes)``
    ``uint8`` tensor whose row ``i`` is ``quantize(rows[i])``."""
    count, numel = rows.shape
    blocks = spec.blocks(numel)
    width = blocks * spec.block
    if width != numel:  # each row pads to whole blocks, as its own payload would
        padded = rows.new_zeros(count, width)
        padded[:, :numel] = rows
        rows = padded
    # one call quantizes every row's blocks: the scales of all rows, then all their codes;
    # each row's payload is its scales followed by its codes
    flat = quantize(rows.reshape(-1), spec)
    scales = flat[: 4 * blocks * count].view(count, 4 * blocks)
    codes = flat[4 * blocks * count :].view(count, -1)
    return torch.cat((scales, codes), dim=1)


def dequantize_rows(payloads: torch.Tensor, numel: int, spec: QuantSpec) -> torch.Tensor:
    """The fp32 ``(rows, numel)`` values of payloads laid out as :func:`quantize_rows` gives."""
    count = payloads.shape[0]
    blocks = spec.blocks(numel)
    split = 4 * blocks
    flat = torch.cat((payloads[:, :split].reshape(-1), payloads[:, split:].reshape(-1)))
    values = dequantize(flat, count * blocks * spec.block, spec)
    return values.view(count, -1)[:, :numel]


def _compensate(
    rows: torch.Tensor, feedback: ErrorFeedback, level: int, spec: QuantSpec
) -> torch.Tensor:
    """``rows`` plus the level's error, quantized; the error buffer updated (LoCo)."""
    error = feedback.buffer(level, rows)
    compensated = rows + error
    payloads = quantize_rows(compensated, spec)
    residual = compensated - dequantize_rows(payloads, rows.shape[1], spec)
    beta = feedback.err_beta
    updated = error * beta + residual * (1.0 - beta)
    # a non-finite block (fp16 overflow) must not enter the buffer: it would reach every
    # later reduction of this key, not only the step the loss scaler skips
    error.copy_(torch.where(torch.isfinite(updated), updated, error))
    return payloads


@torch.no_grad()
def quantized_reduce_scatter(
    output: torch.Tensor,
    source: torch.Tensor,
    levels: Sequence[Level],
    spec: QuantSpec = INT4,
    feedback: ErrorFeedback | None = None,
) -> None:
    """Sum ``source`` over the ranks of ``levels`` (innermost first; see the module docstring)
    and leave this rank's chunk in ``output``, as ``reduce_scatter_tensor`` would up to the
    quantization error: accumulated in fp32, cast to ``output``'s dtype."""
    ranks = 1
    for level in levels:
        ranks *= level.size
    numel = source.numel()
    if numel % ranks or output.numel() * ranks != numel:
        raise ValueError(
            f"a reduce-scatter over {ranks} ranks needs a source of {ranks} x the output's "
            f"elements; got {numel} and {output.numel()}"
        )
    if feedback is not None:
        feedback.begin(len(levels))
    # axes (size of the outermost level, ..., size of the innermost level, chunk)
    shape = [level.size for level in reversed(levels)] + [numel // ranks]
    values = source.reshape(shape)
    for index, level in enumerate(levels):
        # the innermost remaining axis picks the destination: it goes first, one row each
        rows = values.movedim(-2, 0).reshape(level.size, -1).to(torch.float32)
        numel_row = rows.shape[1]
        if feedback is not None:
            send = _compensate(rows, feedback, index, spec)
        else:
            send = quantize_rows(rows, spec)
        received = torch.empty_like(send)
        comm.all_to_all_single(received, send, group=level.group)
        summed = dequantize_rows(received, numel_row, spec).sum(dim=0)
        values = summed.view(shape[: len(shape) - 2 - index] + [shape[-1]])
    output.copy_(values.view_as(output))
