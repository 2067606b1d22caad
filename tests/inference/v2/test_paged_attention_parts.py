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


def test_metadata_goes_to_the_device_in_two_copies() -> None:
    """Built on the host, a batch's metadata (its parts' too) reaches the device as one buffer
    of integers and one of masks: every tensor as built, in its place."""
    from shardspeed.inference.v2.ragged.paged_attention import _INT_FIELDS, _moved

    seen, new = [5, 0, 9, 2, 0], [1, 7, 1, 3, 2]
    tables = [[0, 1], [2, 3], [4, 5, 6], [7, 8], [9]]
    host = RaggedBatchMetadata.build(seen, new, tables, 4)
    assert host.parts and host.last_rows is not None
    moved = _moved(host, "cpu")  # the copy path, on the host
    pairs = [(host, moved)] + [
        (a, b) for (_, a), (_, b) in zip(host.parts, moved.parts, strict=True)
    ]
    storages = set()
    for a, b in pairs:
        for name in (*_INT_FIELDS, "mask", "last_rows"):
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None) == (y is None), name
            if x is not None:
                assert torch.equal(x, y) and x.shape == y.shape, name
                storages.add((y.dtype, y.untyped_storage().data_ptr()))
        assert (a.decode, a.fresh, a.new_counts, a.max_position) == (
            b.decode,
            b.fresh,
            b.new_counts,
            b.max_position,
        )
    for (i, _), (j, _) in zip(host.parts, moved.parts, strict=True):
        assert torch.equal(i, j)
    assert {dtype for dtype, _ in storages} == {torch.int64, torch.bool}
    assert len(storages) == 2  # one buffer of integers, one of masks
    # an accelerator's build takes that path: the same shapes on the meta device
    on_meta = RaggedBatchMetadata.build(seen, new, tables, 4, device="meta")
    assert on_meta.positions.device.type == "meta"
    assert [p.block_tables.shape for _, p in on_meta.parts] == [
        p.block_tables.shape for _, p in host.parts
    ]
