"""The KV block allocator: allocation, sharing by reference count, no leaks, named errors."""

from __future__ import annotations

import random

import pytest
import torch

from shardspeed.inference.v2.ragged import BlockedAllocator


def test_allocate_and_free_round_trip() -> None:
    alloc = BlockedAllocator(8)
    ids = alloc.allocate(3)
    assert ids.dtype == torch.int32 and ids.tolist() == [0, 1, 2]
    assert alloc.free_blocks == 5 and alloc.used_blocks == 3
    alloc.free(ids)
    assert alloc.free_blocks == 8
    # The most recently freed block is handed out first.
    assert alloc.allocate(1).tolist() == [2]
    assert alloc.allocate(0).numel() == 0


def test_share_keeps_block_until_last_holder_frees() -> None:
    alloc = BlockedAllocator(4)
    ids = alloc.allocate(2)
    alloc.share(ids[:1])
    assert alloc.ref_count(0) == 2 and alloc.ref_count(1) == 1
    alloc.free(ids)
    assert alloc.free_blocks == 3 and alloc.ref_count(0) == 1
    alloc.free([0])
    assert alloc.free_blocks == 4 and alloc.ref_count(0) == 0


def test_over_allocation_names_counts_and_takes_nothing() -> None:
    alloc = BlockedAllocator(4)
    alloc.allocate(3)
    with pytest.raises(ValueError, match="cannot allocate 2 KV blocks: 1 of 4 are free"):
        alloc.allocate(2)
    assert alloc.free_blocks == 1
    with pytest.raises(ValueError, match="num_blocks"):
        alloc.allocate(-1)
    with pytest.raises(ValueError, match="at least 1 block"):
        BlockedAllocator(0)


def test_double_free_names_the_block_and_changes_nothing() -> None:
    alloc = BlockedAllocator(4)
    ids = alloc.allocate(2)
    alloc.free(ids[1:])
    with pytest.raises(ValueError, match="KV block 1 is already free"):
        alloc.free(ids)  # block 0 is valid but must not be freed by the refused call
    assert alloc.ref_count(0) == 1 and alloc.free_blocks == 3
    # The same id twice in one call, held once: also a double free.
    with pytest.raises(ValueError, match="KV block 0 is freed 2 times but has 1 holder"):
        alloc.free([0, 0])
    assert alloc.ref_count(0) == 1


def test_unknown_ids_are_named() -> None:
    alloc = BlockedAllocator(4)
    alloc.allocate(1)
    with pytest.raises(ValueError, match="unknown KV block id 7"):
        alloc.free([0, 7])
    with pytest.raises(ValueError, match="unknown KV block id -1"):
        alloc.free(-1)
    with pytest.raises(ValueError, match="unknown KV block id 4"):
        alloc.share([4])
    with pytest.raises(ValueError, match="cannot share KV block 3: it is free"):
        alloc.share([3])
    with pytest.raises(TypeError, match="integers"):
        alloc.free([0.0])  # type: ignore[list-item]
    assert alloc.ref_count(0) == 1


def test_randomized_allocate_share_free_never_leaks() -> None:
    """1,000 random steps against a model of who holds what: counts always agree, no block is
    handed out while held, and freeing every holder returns the free count to the total."""
    rng = random.Random(1234)
    total = 64
    alloc = BlockedAllocator(total)
    holders: list[list[int]] = []  # each holder's block list (a sequence's table)
    refused = 0
    for _ in range(1000):
        op = rng.random()
        if op < 0.45:
            n = rng.randint(0, 12)
            if n > alloc.free_blocks:
                with pytest.raises(ValueError):
                    alloc.allocate(n)
                refused += 1
                continue
            ids = alloc.allocate(n).tolist()
            held = {b for h in holders for b in h}
            assert not held & set(ids), "a held block was handed out again"
            assert len(set(ids)) == n
            holders.append(ids)
        elif op < 0.65 and holders:
            # A new sequence shares a prefix of an existing one.
            src = rng.choice(holders)
            prefix = src[: rng.randint(0, len(src))]
            alloc.share(prefix)
            holders.append(list(prefix))
        elif holders:
            alloc.free(holders.pop(rng.randrange(len(holders))))
        refs: dict[int, int] = {}
        for h in holders:
            for b in h:
                refs[b] = refs.get(b, 0) + 1
        assert alloc.free_blocks == total - len(refs)
        for b in range(total):
            assert alloc.ref_count(b) == refs.get(b, 0)
    assert refused > 0  # the run did push against the cache's size
    for h in holders:
        alloc.free(h)
    assert alloc.free_blocks == total
    assert sorted(alloc.allocate(total).tolist()) == list(range(total))
