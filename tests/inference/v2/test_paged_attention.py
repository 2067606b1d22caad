"""Paged attention over a ragged batch equals dense SDPA over each sequence's whole keys and
values, for prefill chunks, decode tokens, several block sizes and grouped-query attention."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from shardspeed.inference.v2.ragged import (
    BlockedKVCache,
    RaggedBatchMetadata,
    SequenceDescriptor,
    paged_attention,
    ragged_sdpa_backends,
)

HEAD_DIM = 8


def _dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seen: int) -> torch.Tensor:
    """SDPA of ``q`` (n, heads, d), the tokens at positions seen .. seen+n-1, over the sequence's
    whole ``k``/``v`` (seen+n, kv_heads, d), causal at that offset."""
    n, total = q.shape[0], k.shape[0]
    mask = torch.ones(n, total, dtype=torch.bool).tril(diagonal=seen)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, enable_gqa=True
    )
    return out.transpose(0, 1)


@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_ragged_batch_matches_dense_sdpa(block_size: int, heads: int, kv_heads: int) -> None:
    torch.manual_seed(block_size * 10 + kv_heads)
    rng = random.Random(block_size)
    cache = BlockedKVCache(
        num_layers=1, num_blocks=256, block_size=block_size, kv_heads=kv_heads, head_dim=HEAD_DIM
    )
    # Fragment the free list so tables are not contiguous runs.
    junk = cache.allocator.allocate(40)
    cache.allocator.free(junk[torch.randperm(40)[:25]])
    # (cached prefix, new tokens): a first prefill, a later prefill chunk, decode tokens, a
    # prefix that ends mid-block and one that ends on a block boundary.
    plan = [(0, 13), (9, 7), (20, 1), (5, 1), (0, 1), (2 * block_size, 5), (31, 2)]
    rng.shuffle(plan)
    seqs, full_k, full_v = [], [], []
    for uid, (seen, new) in enumerate(plan):
        seq = SequenceDescriptor(uid)
        k = torch.randn(seen + new, kv_heads, HEAD_DIM)
        v = torch.randn(seen + new, kv_heads, HEAD_DIM)
        if seen:  # earlier steps already cached the prefix
            cache.reserve(seq, seen)
            cache.write(0, seq.slots(seen, block_size), k[:seen], v[:seen])
            seq.pre_forward(seen)
            seq.post_forward()
        cache.reserve(seq, new)
        seqs.append(seq)
        full_k.append(k)
        full_v.append(v)

    meta = RaggedBatchMetadata.build(
        [s.seen_tokens for s in seqs], [n for _, n in plan], [s.block_ids for s in seqs], block_size
    )
    assert meta.positions.tolist() == [p for seen, n in plan for p in range(seen, seen + n)]
    expected_slots = torch.cat(
        [s.slots(n, block_size) for s, (_, n) in zip(seqs, plan, strict=True)]
    )
    assert torch.equal(meta.slots, expected_slots)
    # The layer writes the new tokens' keys/values by slot, then attends.
    new_k = torch.cat([k[seen:] for k, (seen, _) in zip(full_k, plan, strict=True)])
    new_v = torch.cat([v[seen:] for v, (seen, _) in zip(full_v, plan, strict=True)])
    cache.write(0, meta.slots, new_k, new_v)
    q = torch.randn(meta.num_tokens, heads, HEAD_DIM)
    out = paged_attention(q, cache.keys[0], cache.values[0], meta)

    assert out.shape == q.shape
    start = 0
    for (seen, new), k, v in zip(plan, full_k, full_v, strict=True):
        ref = _dense_reference(q[start : start + new], k, v, seen)
        torch.testing.assert_close(out[start : start + new], ref, rtol=0, atol=1e-5)
        start += new


def test_decode_step_reuses_cache_after_prefill() -> None:
    """Prefill then three decode steps through the same cache equal one dense pass."""
    torch.manual_seed(3)
    bs, heads, kvh = 4, 4, 2
    cache = BlockedKVCache(1, 16, bs, kvh, HEAD_DIM)
    seq = SequenceDescriptor(0)
    total = 9
    k, v, q = (
        torch.randn(total, kvh, HEAD_DIM),
        torch.randn(total, kvh, HEAD_DIM),
        torch.randn(total, heads, HEAD_DIM),
    )
    outs = []
    for lo, hi in ((0, 6), (6, 7), (7, 8), (8, 9)):
        cache.reserve(seq, hi - lo)
        meta = RaggedBatchMetadata.build([seq.seen_tokens], [hi - lo], [seq.block_ids], bs)
        cache.write(0, meta.slots, k[lo:hi], v[lo:hi])
        outs.append(paged_attention(q[lo:hi], cache.keys[0], cache.values[0], meta))
        seq.pre_forward(hi - lo)
        seq.post_forward()
    torch.testing.assert_close(torch.cat(outs), _dense_reference(q, k, v, 0), rtol=0, atol=1e-5)


def test_metadata_and_shape_errors() -> None:
    with pytest.raises(ValueError, match="sequence 1: 9 tokens do not fit its 2 block"):
        RaggedBatchMetadata.build([0, 5], [3, 4], [[0], [1, 2]], 4)
    with pytest.raises(ValueError, match="new_tokens >= 1"):
        RaggedBatchMetadata.build([0], [0], [[0]], 4)
    with pytest.raises(ValueError, match="one entry per sequence"):
        RaggedBatchMetadata.build([0], [1, 1], [[0]], 4)
    meta = RaggedBatchMetadata.build([0], [2], [[0]], 4)
    cache = torch.zeros(3, 2, 4, HEAD_DIM)  # (kv_heads, blocks, block_size, head_dim)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        paged_attention(torch.zeros(2, 4, HEAD_DIM), cache, cache, meta)
    with pytest.raises(ValueError, match="query has 3 tokens"):
        paged_attention(torch.zeros(3, 3, HEAD_DIM), cache, cache, meta)


def test_ragged_forward_keeps_sdpa_off_cudnn_on_cuda() -> None:
    """cuDNN's SDPA kernel builds a plan per new shape (about half a second each on an H200),
    and a ragged batch has a new shape at almost every step: on CUDA the ragged forward lets
    SDPA choose only flash, memory-efficient or math. Elsewhere nothing changes."""
    flags = (
        torch.backends.cuda.cudnn_sdp_enabled,
        torch.backends.cuda.flash_sdp_enabled,
        torch.backends.cuda.mem_efficient_sdp_enabled,
        torch.backends.cuda.math_sdp_enabled,
    )
    before = [flag() for flag in flags]
    assert before[0]  # torch's default: cuDNN allowed
    with ragged_sdpa_backends(torch.device("cuda", 0)):
        assert [flag() for flag in flags] == [False, True, True, True]
    assert [flag() for flag in flags] == before
    with ragged_sdpa_backends(torch.device("cpu")):
        assert [flag() for flag in flags] == before
