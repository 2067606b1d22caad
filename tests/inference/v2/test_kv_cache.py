"""The blocked KV cache: block tables, slot scatter, gather round trip, prefix sharing."""

from __future__ import annotations

import pytest
import torch

from shardspeed.inference.v2.ragged import BlockedKVCache, SequenceDescriptor


def _cache(block_size: int = 4, num_blocks: int = 16) -> BlockedKVCache:
    return BlockedKVCache(
        num_layers=2, num_blocks=num_blocks, block_size=block_size, kv_heads=2, head_dim=3
    )


def test_write_read_round_trip_across_fragmented_blocks() -> None:
    torch.manual_seed(0)
    cache = _cache()
    # Fragment the free list so sequences get non-contiguous blocks.
    filler = cache.allocator.allocate(5)
    cache.allocator.free(filler[[1, 3]])
    a, b = SequenceDescriptor(1), SequenceDescriptor(2)
    full = {uid: (torch.randn(11, 2, 3), torch.randn(11, 2, 3)) for uid in (1, 2)}
    # Sequence 1 in chunks 5, 1, 5; sequence 2 in 7, 4 (interleaved steps).
    for seq, chunks in ((a, [5, 1, 5]), (b, [7, 4])):
        for n in chunks:
            cache.reserve(seq, n)
            slots = seq.slots(n, cache.block_size)
            k, v = full[seq.uid]
            start = seq.seen_tokens
            for layer in range(2):
                cache.write(
                    layer, slots, k[start : start + n] + layer, v[start : start + n] - layer
                )
            seq.pre_forward(n)
            seq.post_forward()
    assert a.seen_tokens == 11 and len(a.block_ids) == 3
    assert a.block_ids[:2] == [3, 1]  # the two freed blocks, most recent first
    assert not set(a.block_ids) & set(b.block_ids)
    for seq in (a, b):
        for layer in range(2):
            k, v = cache.read(layer, seq.block_ids, seq.seen_tokens)
            torch.testing.assert_close(k, full[seq.uid][0] + layer, rtol=0, atol=0)
            torch.testing.assert_close(v, full[seq.uid][1] - layer, rtol=0, atol=0)
    # Slots are block * block_size + offset along the table.
    blocks = a.block_ids
    expected = [blocks[t // 4] * 4 + t % 4 for t in range(11)]
    a.seen_tokens = 0
    assert a.slots(11, 4).tolist() == expected


def test_reserve_counts_blocks_and_release_returns_them() -> None:
    cache = _cache(block_size=4, num_blocks=6)
    seq = SequenceDescriptor(7)
    assert cache.reserve(seq, 5).numel() == 2  # 5 tokens: 2 blocks
    seq.pre_forward(5)
    seq.post_forward()
    assert cache.reserve(seq, 3).numel() == 0  # 8 tokens still fit 2 blocks
    assert cache.reserve(seq, 4).numel() == 1
    assert cache.free_blocks == 3
    with pytest.raises(ValueError, match="sequence 7 holds 3 block"):
        seq.slots(8, 4)
    other = SequenceDescriptor(8)
    with pytest.raises(ValueError, match="cannot allocate 4 KV blocks: 3 of 6 are free"):
        cache.reserve(other, 16)
    assert other.block_ids == [] and cache.free_blocks == 3
    cache.release(seq)
    assert cache.free_blocks == 6 and seq.block_ids == [] and seq.seen_tokens == 0


def test_shared_prefix_blocks_outlive_their_first_holder() -> None:
    torch.manual_seed(1)
    cache = _cache(block_size=4, num_blocks=8)
    src = SequenceDescriptor(1)
    cache.reserve(src, 10)
    k, v = torch.randn(10, 2, 3), torch.randn(10, 2, 3)
    cache.write(0, src.slots(10, 4), k, v)
    src.pre_forward(10)
    src.post_forward()
    dst = SequenceDescriptor(2)
    with pytest.raises(ValueError, match="sequence 1 has 2 full block"):
        cache.share_prefix(src, dst, 3)
    cache.share_prefix(src, dst, 2)
    assert dst.seen_tokens == 8 and dst.block_ids == src.block_ids[:2]
    assert cache.free_blocks == 5
    cache.release(src)
    assert cache.free_blocks == 6  # only src's own third block came back
    got_k, got_v = cache.read(0, dst.block_ids, 8)
    torch.testing.assert_close(got_k, k[:8], rtol=0, atol=0)
    torch.testing.assert_close(got_v, v[:8], rtol=0, atol=0)
    cache.release(dst)
    assert cache.free_blocks == 8


def test_shape_errors_and_block_bytes() -> None:
    cache = _cache()
    with pytest.raises(ValueError, match=r"\(tokens, kv_heads, head_dim\)"):
        cache.write(0, torch.tensor([0, 1]), torch.zeros(2, 3, 3), torch.zeros(2, 3, 3))
    with pytest.raises(ValueError, match="block_size must be an integer >= 1"):
        BlockedKVCache(1, 4, 0, 1, 1)
    assert BlockedKVCache.block_bytes(2, 16, 4, 64, torch.float16) == 2 * 2 * 16 * 4 * 64 * 2
