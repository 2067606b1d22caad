"""The blocked KV cache: per layer, keys and values in fixed-size blocks, and per sequence a block
table saying which blocks hold its tokens, in order."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardspeed.inference.v2.ragged.blocked_allocator import BlockedAllocator

__all__ = ["BlockedKVCache", "SequenceDescriptor"]


class SequenceDescriptor:
    """One tracked sequence: its ``uid``, how many of its tokens are in the cache
    (``seen_tokens``), how many are in the forward pass now (``in_flight_tokens``) and its block
    table (``block_ids``: token ``t`` lives in block ``block_ids[t // block_size]`` at offset
    ``t % block_size``)."""

    def __init__(self, uid: int) -> None:
        self.uid = uid
        self.seen_tokens = 0
        self.in_flight_tokens = 0
        self.block_ids: list[int] = []

    def __repr__(self) -> str:
        return (
            f"SequenceDescriptor(uid={self.uid}, seen_tokens={self.seen_tokens}, "
            f"in_flight_tokens={self.in_flight_tokens}, block_ids={self.block_ids})"
        )

    @property
    def cur_allocated_blocks(self) -> int:
        """How many blocks the table holds."""
        return len(self.block_ids)

    def blocks_needed(self, new_tokens: int, block_size: int) -> int:
        """How many more blocks the table needs to hold ``new_tokens`` tokens after the seen
        ones."""
        total = self.seen_tokens + new_tokens
        return max(0, -(-total // block_size) - len(self.block_ids))

    def extend_blocks(self, block_ids: Sequence[int] | torch.Tensor) -> None:
        """Append ``block_ids`` to the block table."""
        if isinstance(block_ids, torch.Tensor):
            self.block_ids.extend(int(b) for b in block_ids.reshape(-1).tolist())
        else:
            self.block_ids.extend(int(b) for b in block_ids)

    def slots(self, new_tokens: int, block_size: int) -> torch.Tensor:
        """The cache slots (``block * block_size + offset``, int64) of the next ``new_tokens``
        tokens, positions ``seen_tokens ..``; ValueError when the table is too short."""
        positions = torch.arange(self.seen_tokens, self.seen_tokens + new_tokens)
        if new_tokens and self.blocks_needed(new_tokens, block_size):
            raise ValueError(
                f"sequence {self.uid} holds {len(self.block_ids)} block(s) of {block_size} "
                f"tokens and {self.seen_tokens + new_tokens} tokens were asked for; reserve "
                "blocks first (BlockedKVCache.reserve)."
            )
        table = torch.tensor(self.block_ids, dtype=torch.int64)
        return table[positions // block_size] * block_size + positions % block_size

    def pre_forward(self, num_tokens: int) -> None:
        """Mark ``num_tokens`` tokens as in the forward pass."""
        self.in_flight_tokens = num_tokens

    def post_forward(self) -> None:
        """The forward pass is done: its tokens now count as seen."""
        self.seen_tokens += self.in_flight_tokens
        self.in_flight_tokens = 0


class BlockedKVCache:
    """Keys and values of ``num_layers`` layers, each a tensor of shape
    (kv_heads, num_blocks, block_size, head_dim), with the allocator that hands out their blocks
    (one block id covers the same slots in every layer and head). Head-major, so one kv head's
    block is one contiguous run of ``block_size * head_dim`` values: attention gathers a
    sequence's context by whole blocks straight into (kv_heads, context, head_dim)."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("block_size", block_size),
            ("kv_heads", kv_heads),
            ("head_dim", head_dim),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
        self.allocator = BlockedAllocator(num_blocks)
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.kv_heads, self.head_dim = kv_heads, head_dim
        shape = (kv_heads, num_blocks, block_size, head_dim)
        # Zeroed, not empty: gathered padding slots are masked out, but NaN garbage times a zero
        # attention weight would still be NaN.
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def block_bytes(
        num_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes one block takes over all layers, keys and values (for sizing the cache from a
        memory budget)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * kv_heads * head_dim * itemsize

    @property
    def free_blocks(self) -> int:
        """How many blocks are free now."""
        return self.allocator.free_blocks

    def reserve(self, seq: SequenceDescriptor, new_tokens: int) -> torch.Tensor:
        """Allocate the blocks ``seq`` needs for ``new_tokens`` more tokens, append them to its
        table and return them (ValueError from the allocator, nothing taken, when too few are
        free)."""
        ids = self.allocator.allocate(seq.blocks_needed(new_tokens, self.block_size))
        seq.extend_blocks(ids)
        return ids

    def share_prefix(
        self, source: SequenceDescriptor, target: SequenceDescriptor, num_blocks: int
    ) -> None:
        """Give the empty ``target`` the first ``num_blocks`` blocks of ``source`` (full ones:
        their tokens never change again) as its cached prefix, shared by reference count."""
        if target.block_ids or target.seen_tokens:
            raise ValueError(f"sequence {target.uid} already holds tokens; a prefix goes first.")
        full = source.seen_tokens // self.block_size
        if not 0 <= num_blocks <= full:
            raise ValueError(
                f"sequence {source.uid} has {full} full block(s); cannot share {num_blocks}."
            )
        shared = source.block_ids[:num_blocks]
        self.allocator.share(shared)
        target.extend_blocks(shared)
        target.seen_tokens = num_blocks * self.block_size

    def release(self, seq: SequenceDescriptor) -> None:
        """Drop ``seq``'s hold on its blocks and empty its table."""
        self.allocator.free(seq.block_ids)
        seq.block_ids = []
        seq.seen_tokens = seq.in_flight_tokens = 0

    def write(
        self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Scatter ``keys``/``values`` (tokens, kv_heads, head_dim) of ``layer`` into the cache
        slots ``slots`` (tokens,) (slot = block * block_size + offset)."""
        expected = (slots.shape[0], self.kv_heads, self.head_dim)
        if tuple(keys.shape) != expected or tuple(values.shape) != expected:
            raise ValueError(
                f"keys/values must be shaped {expected} (tokens, kv_heads, head_dim), got "
                f"{tuple(keys.shape)} and {tuple(values.shape)}."
            )
        flat_k = self.keys[layer].view(self.kv_heads, -1, self.head_dim)
        flat_v = self.values[layer].view(self.kv_heads, -1, self.head_dim)
        index = slots.to(device=flat_k.device, dtype=torch.int64)
        flat_k.index_copy_(1, index, keys.to(flat_k.dtype).transpose(0, 1))
        flat_v.index_copy_(1, index, values.to(flat_v.dtype).transpose(0, 1))

    def read(
        self, layer: int, block_ids: Sequence[int] | torch.Tensor, length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``length`` tokens' keys and values (length, kv_heads, head_dim) of ``layer``
        along the block table ``block_ids`` (a gathered copy)."""
        table = torch.as_tensor(block_ids, dtype=torch.int64, device=self.keys[layer].device)
        if length > table.numel() * self.block_size:
            raise ValueError(
                f"{length} tokens asked for from a table of {table.numel()} block(s) of "
                f"{self.block_size}."
            )
        keys = self.keys[layer][:, table].flatten(1, 2)[:, :length].transpose(0, 1)
        values = self.values[layer][:, table].flatten(1, 2)[:, :length].transpose(0, 1)
        return keys.contiguous(), values.contiguous()
