"""UlyssesSPAttentionHF on 2 and 4 gloo ranks: output slices and q/k/v gradients equal torch
sdpa over the whole sequence (fp32), in every mode the head counts lead to: Ulysses (MHA, GQA,
MQA, key/value heads replicated), Ulysses x ring, and pure ring; sdpa and eager cores; causal
and not; the sequence length changing between calls."""

from __future__ import annotations

import pytest

from tests.runtime.sequence_parallel import attention_ranks

# (world, query heads, key/value heads, the mode the layout must pick)
CASES = [
    (2, 4, 4, "ulysses"),  # MHA
    (2, 4, 2, "ulysses"),  # GQA
    (2, 4, 1, "ulysses"),  # MQA: the one kv head replicated to both ranks
    (2, 3, 3, "ring"),  # 3 heads do not split over 2 ranks
    (4, 4, 4, "ulysses"),
    (4, 4, 2, "ulysses"),  # GQA, kv 2 < sp 4: replicated x2
    (4, 8, 2, "ulysses"),
    (4, 4, 1, "ulysses"),  # MQA, replicated x4
    (4, 6, 2, "ulysses x ring"),  # u=2 x r=2
    (4, 3, 3, "ring"),
    (4, 6, 3, "ring"),  # GQA by head grouping inside the ring
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("world", "q_heads", "kv_heads", "mode"), CASES)
def test_split_sequence_equals_whole(dist_pool, world, q_heads, kv_heads, mode):
    modes = dist_pool(world).run(attention_ranks.attention_equals_whole, q_heads, kv_heads, [4, 2])
    assert modes == [mode] * world


@pytest.mark.timeout(120)
def test_sequence_subgroups_split_consecutive_ulysses_ranks(dist_pool):
    """sp 4 as Ulysses 2 x ring 2: Ulysses peers consecutive, the ring across the pairs."""
    results = dist_pool(4).run(attention_ranks.subgroup_ranks, 2)
    assert results == [
        ([0, 1], [0, 2]),
        ([0, 1], [1, 3]),
        ([2, 3], [0, 2]),
        ([2, 3], [1, 3]),
    ]
