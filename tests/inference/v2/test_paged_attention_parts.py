"""Paged attention of a batch mixing decode tokens and prompt chunks runs per group."""

from __future__ import annotations

import torch

from shardspeed.inference.v2.ragged.paged_attention import RaggedBatchMetadata, paged_attention


def test_mixed_batch_runs_per_group_with_the_same_result() -> None:
    torch.manual_seed(0)
    block, kv_heads, heads, dim = 4, 2, 4, 8
    cache_k = torch.randn(kv_heads, 16, block, dim)
    cache_v = torch.randn(kv_heads, 16, block, dim)
    seen, new = [5, 0, 9, 2], [1, 7, 1, 3]
    tables = [[0, 1], [2, 3], [4, 5, 6], [7, 8]]
    split = RaggedBatchMetadata.build(seen, new, tables, block)
    whole = RaggedBatchMetadata.build(seen, new, tables, block, split=False)
    assert not whole.parts
    assert [p.query_index.shape for _, p in split.parts] == [(2, 1), (2, 7)]
    assert sorted(torch.cat([i for i, _ in split.parts]).tolist()) == list(range(sum(new)))
    query = torch.randn(sum(new), heads, dim)
    torch.testing.assert_close(
        paged_attention(query, cache_k, cache_v, split),
        paged_attention(query, cache_k, cache_v, whole),
        atol=1e-6,
        rtol=0,
    )
    # all decode or all prompt: nothing to split
    assert not RaggedBatchMetadata.build([1, 2], [1, 1], tables[:2], block).parts
    assert not RaggedBatchMetadata.build([0, 0], [3, 7], tables[:2], block).parts
