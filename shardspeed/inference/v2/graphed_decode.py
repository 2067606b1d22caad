"""Decode batches of inference v2 replayed from CUDA graphs (``enable_cuda_graph``).

On a GPU a decode step (one new token for each of its sequences) is bound by the host: a small
model's forward is a few hundred kernel launches of microseconds each. Here a decode batch is
padded to a bucket (sequences: a power of two up to ``max_ragged_sequence_count``; blocks per
sequence: a power of two up to what ``max_context`` needs), each bucket's forward is captured
once on buffers allocated once, and every later decode step of that bucket copies its tokens,
positions, cache slots and block tables into one buffer (one host-to-device copy) and replays
the graph. Padding rows repeat the last real row (its token written again to the same slot,
with the same values); padding blocks are masked like any decode batch's. Without ``graph`` the
same buffers and arithmetic run eagerly, on any device (how the tests check them on a CPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from shardspeed.accelerator import get_accelerator
from shardspeed.inference.graph_capture import capture_step
from shardspeed.inference.v2.model.ragged_lm import _STATIC_ROPE, RaggedCausalLM
from shardspeed.inference.v2.ragged.kv_cache import BlockedKVCache
from shardspeed.inference.v2.ragged.paged_attention import RaggedBatchMetadata, private_workspace

__all__ = ["GraphedDecode", "graph_refusal"]

# eager runs before a capture (graph_capture's recipe); two suffice for a forward
_WARMUP_RUNS = 2


def graph_refusal(model: RaggedCausalLM, tp_size: int) -> str | None:
    """Why ``model`` cannot decode from CUDA graphs (None: it can)."""
    if model.family == "mixtral":
        return "Mixtral's expert routing has data-dependent shapes, which a graph cannot hold"
    rope = getattr(getattr(model.base, "rotary_emb", None), "rope_type", "default")
    if model.layout != "gpt2" and rope not in _STATIC_ROPE:
        return f"rope_type {rope!r} rescales with the sequence length, which a graph cannot hold"
    if tp_size > 1:
        return f"tensor_parallel.tp_size={tp_size}: graphs are captured at tp_size 1 only"
    device = model.device
    if device.type != "cuda":
        return f"CUDA graphs exist only on CUDA devices and the model runs on {device.type}"
    return None


def _bucket(n: int, limit: int) -> int:
    """The smallest power of two >= ``n``, or ``limit`` when that is smaller."""
    size = 1
    while size < n:
        size *= 2
    return min(size, limit)


def _buckets_up_to(top: int) -> list[int]:
    """Every bucket size up to bucket ``top``: the powers of two below it, then ``top``."""
    sizes = [1]
    while sizes[-1] < top:
        sizes.append(min(2 * sizes[-1], top))
    return sizes


class _Bucket:
    """One padded decode shape (``seqs`` sequences of ``blocks`` blocks): its buffers, and its
    forward captured on them (or run eagerly on them)."""

    def __init__(self, owner: GraphedDecode, seqs: int, blocks: int) -> None:
        device = owner.model.device
        self.owner, self.seqs = owner, seqs
        #: one row per sequence: token, position, cache slot, then its block table
        self.packed = torch.zeros(seqs, 3 + blocks, dtype=torch.int64, device=device)
        self.keys = torch.arange(blocks * owner.block_size, device=device)
        self.rows = torch.arange(seqs, device=device)
        self.offsets = torch.zeros(seqs, dtype=torch.int64, device=device)
        self.graph: Any = None
        self.logits: torch.Tensor | None = None

    def __call__(self, host_rows: torch.Tensor) -> torch.Tensor:
        self.packed.copy_(host_rows)
        if not self.owner.use_graph:
            return self._step()
        if self.graph is None:
            self._capture()
        get_accelerator().replay_graph(self.graph)
        self.owner.replays += 1
        assert self.logits is not None
        return self.logits

    def _step(self) -> torch.Tensor:
        owner, packed = self.owner, self.packed
        positions = packed[:, 1].contiguous()
        meta = RaggedBatchMetadata(
            positions=positions,
            slots=packed[:, 2].contiguous(),
            query_index=self.rows[:, None],
            token_seq=self.rows,
            token_offset=self.offsets,
            block_tables=packed[:, 3:].contiguous(),
            mask=(self.keys[None, :] <= positions[:, None])[:, None, None, :],
            block_size=owner.block_size,
            decode=True,
            new_counts=(1,) * self.seqs,
            # the rotary table is sized once for the whole context: no regrowth in a replay
            max_position=owner.max_context - 1,
        )
        return owner.model(packed[:, 0].contiguous(), meta, owner.cache)

    def _capture(self) -> None:
        # every bucket's graph shares one memory pool: they replay one at a time, and each
        # one's output is read before the next replay; the capture allocates its own gather
        # buffers (its kernels keep the addresses they were captured with)
        owner = self.owner
        graph, self.logits = capture_step(
            self._step, owner.pool, _WARMUP_RUNS, recording=private_workspace()
        )
        if owner.pool is None and hasattr(graph, "pool"):
            owner.pool = graph.pool()
        self.graph = graph
        owner.captures += 1


class GraphedDecode:
    """Decode batches of ``model`` over ``cache`` through padded buckets, each captured in a
    CUDA graph on first use (``graph``) or run eagerly on the same buffers."""

    def __init__(
        self,
        model: RaggedCausalLM,
        cache: BlockedKVCache,
        block_size: int,
        max_sequences: int,
        max_context: int,
        graph: bool,
    ) -> None:
        self.model, self.cache, self.block_size = model, cache, block_size
        self.max_sequences, self.max_context, self.use_graph = max_sequences, max_context, graph
        self.max_blocks = -(-max_context // block_size)
        self.buckets: dict[tuple[int, int], _Bucket] = {}
        self.pool: Any = None
        self.captures = 0
        """Graphs captured so far."""
        self.replays = 0
        """Decode steps replayed from a graph so far."""

    def bucket_of(self, sequences: int, blocks: int) -> tuple[int, int]:
        """The padded (sequences, blocks) a decode batch of that size runs in."""
        return _bucket(sequences, self.max_sequences), _bucket(blocks, self.max_blocks)

    def run(
        self, tokens: Sequence[int], seen: Sequence[int], tables: Sequence[Sequence[int]]
    ) -> torch.Tensor:
        """Logits (sequences, vocab), float32, of a decode batch: sequence ``s`` brings token
        ``tokens[s]`` at position ``seen[s]``, its blocks ``tables[s]`` (already reserved)."""
        key = self.bucket_of(len(tokens), max(len(t) for t in tables))
        seqs, blocks = key
        bucket = self.buckets.get(key)
        if bucket is None:
            bucket = self.buckets[key] = _Bucket(self, seqs, blocks)
        size = self.block_size
        rows = [
            [token, position, table[position // size] * size + position % size, *table]
            + [0] * (blocks - len(table))
            for token, position, table in zip(tokens, seen, tables, strict=True)
        ]
        rows += [rows[-1]] * (seqs - len(rows))
        # a copy: the bucket's output buffer is overwritten by its next step
        return bucket(torch.tensor(rows, dtype=torch.int64))[: len(tokens)].clone()

    def capture_all(
        self, max_sequences: int | None, max_context: int | None, scratch_block: int
    ) -> int:
        """Capture (or, eagerly, run once) every bucket up to ``max_sequences`` sequences and
        ``max_context`` tokens each (None: the engine's limits), so that no later decode step
        waits for a capture; returns how many buckets were new. The captures write keys and
        values into block ``scratch_block``, which no sequence may be using."""
        top_seqs = _bucket(max_sequences or self.max_sequences, self.max_sequences)
        top_blocks = _bucket(
            -(-(max_context or self.max_context) // self.block_size), self.max_blocks
        )
        new = 0
        for seqs in _buckets_up_to(top_seqs):
            for blocks in _buckets_up_to(top_blocks):
                if (seqs, blocks) in self.buckets:
                    continue
                bucket = self.buckets[(seqs, blocks)] = _Bucket(self, seqs, blocks)
                # token 0 at position 0 of a table of only the scratch block
                rows = torch.full((seqs, 3 + blocks), scratch_block, dtype=torch.int64)
                rows[:, :2] = 0
                rows[:, 2] = scratch_block * self.block_size
                bucket(rows)
                new += 1
        return new
