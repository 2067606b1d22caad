"""Ragged batching's data structures: the KV block allocator, the blocked KV cache and its
per-sequence block tables, and paged attention over them."""

from shardspeed.inference.v2.ragged.blocked_allocator import BlockedAllocator
from shardspeed.inference.v2.ragged.kv_cache import BlockedKVCache, SequenceDescriptor
from shardspeed.inference.v2.ragged.paged_attention import (
    RaggedBatchMetadata,
    paged_attention,
    ragged_sdpa_backends,
)

__all__ = [
    "BlockedAllocator",
    "BlockedKVCache",
    "RaggedBatchMetadata",
    "SequenceDescriptor",
    "paged_attention",
    "ragged_sdpa_backends",
]
