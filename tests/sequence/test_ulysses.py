"""DeepSpeed-Ulysses ``DistributedAttention`` on 2 and 4 gloo ranks: exact against attention
over the whole sequence in one process."""

from __future__ import annotations

import pytest

import shardspeed
from tests.sequence import ulysses_ranks


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_split_sequence_attention_is_exact(dist_pool, world: int, causal: bool):
    errors = dist_pool(world).run(ulysses_ranks.split_sequence_equals_whole, causal)
    assert max(errors) < 1e-5


def test_heads_not_divisible_are_refused(dist_pool):
    message = dist_pool(2).run(ulysses_ranks.indivisible_heads_refused)[0]
    assert "divisible by the sequence-parallel size 2" in message


def test_public_path():
    assert shardspeed.sequence.layer.DistributedAttention is not None
