"""The slicing arithmetic of AutoTP, without ranks."""

from __future__ import annotations

import pytest
import torch

from shardspeed.runtime.tensor_parallel.partition import HeadLayout, Slice, split_range


def test_split_range_covers_the_size_in_grain_multiples():
    assert [split_range(192, 2, r, 64) for r in range(2)] == [(0, 128), (128, 192)]
    assert [split_range(128, 4, r, 64) for r in range(4)] == [
        (0, 32),
        (32, 64),
        (64, 96),
        (96, 128),
    ]
    assert [split_range(251, 4, r) for r in range(4)] == [
        (0, 63),
        (63, 126),
        (126, 189),
        (189, 251),
    ]


def test_gqa_with_fewer_kv_heads_than_ranks_shares_the_right_head():
    # 8 query heads, 2 key/value heads, 4 ranks: ranks 0-1 read kv head 0, ranks 2-3 kv head 1
    layouts = [HeadLayout(8, 2, 4, 4, rank) for rank in range(4)]
    assert [layout.kv_slice(0).pieces for layout in layouts] == [
        ((0, 4),),
        ((0, 4),),
        ((4, 8),),
        ((4, 8),),
    ]
    assert [layout.q_slice(0).pieces for layout in layouts] == [
        ((0, 8),),
        ((8, 16),),
        ((16, 24),),
        ((24, 32),),
    ]
    assert all(layout.local_q_heads == 2 and layout.local_kv_heads == 1 for layout in layouts)


def test_fused_qkv_slice_takes_q_k_and_v_pieces():
    layout = HeadLayout(4, 4, 2, 2, 1)  # GPT-2 style: c_attn rows [q(8) | k(8) | v(8)]
    assert layout.fused_qkv_slice(0).pieces == ((4, 8), (12, 16), (20, 24))
    full = torch.arange(24.0)[:, None]
    assert layout.fused_qkv_slice(0).take(full).flatten().tolist() == [
        4,
        5,
        6,
        7,
        12,
        13,
        14,
        15,
        20,
        21,
        22,
        23,
    ]
    assert Slice(1, ((1, 3),)).take(torch.eye(4)).shape == (4, 2)


def test_heads_that_do_not_fit_are_errors():
    with pytest.raises(ValueError, match="does not divide the model's 6 attention heads"):
        HeadLayout(6, 6, 8, 4, 0)
    with pytest.raises(ValueError, match="3 key/value heads do not fit"):
        HeadLayout(12, 3, 8, 2, 0)
