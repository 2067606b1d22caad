"""DeepSpeed-Ulysses ``DistributedAttention`` on 2 and 4 gloo ranks: exact against attention
over the whole sequence in one process."""

from __future__ import annotations

import inspect

import pytest
import torch

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


def test_public_path_and_signature():
    """DeepSpeed's path and constructor: the class the rank tests exercise, with DeepSpeed's
    parameter names and defaults (scatter heads, dim 2; gather sequence, dim 0)."""
    cls = shardspeed.sequence.layer.DistributedAttention
    assert cls is ulysses_ranks.DistributedAttention
    params = inspect.signature(cls.__init__).parameters
    assert list(params) == [
        "self",
        "local_attention",
        "sequence_process_group",
        "scatter_idx",
        "gather_idx",
        "sp_stream",
    ]
    assert (params["scatter_idx"].default, params["gather_idx"].default) == (2, 0)
    layer = cls(torch.nn.Identity(), None)
    assert isinstance(layer, torch.nn.Module) and isinstance(layer.local_attn, torch.nn.Identity)
