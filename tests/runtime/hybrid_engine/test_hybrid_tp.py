"""Tensor-parallel generation in the hybrid engine (``inference_tp_size=2``) at ZeRO-3 on 2
gloo ranks: one group of two ranks that decodes both ranks' prompts together."""

from __future__ import annotations

import pytest

from tests.runtime.hybrid_engine.ranks_tp import (
    tp_generate_case,
    tp_size_error_case,
    tp_training_case,
)


@pytest.mark.timeout(300)
def test_tp_generation_gives_each_rank_the_whole_models_tokens(dist_pool):
    shapes = [
        [(2, 5), (2, 5)],  # equal prompt lengths
        [(2, 4), (2, 7)],  # unequal: rank 0's prompts are left-padded in the group
        [(3, 6), (1, 3)],  # unequal batch sizes and lengths
    ]
    results = dist_pool(2).run(tp_generate_case, shapes)
    for rank, result in enumerate(results):
        assert result["tp_size"] == 2
        assert result["tp"] == [True, True, True]  # every call decoded split over the group
        assert result["equal"] == [True, True, True]
        # each rank gets back only its own rows, without the group's padding
        assert result["shapes"] == [(b, n + 8) for b, n in (s[rank] for s in shapes)]
        # the view's projections are split in half (hidden 32, intermediate 64) ...
        assert result["view_q"] == (16, 32)
        assert result["view_gate"] == (32, 32)
        # ... and the trained modules stay whole, plain linears
        assert result["trained_q"] == (32, 32) and result["trained_is_linear"]
        assert result["training_mode"]


@pytest.mark.timeout(300)
def test_training_after_tp_generate_is_unchanged(dist_pool):
    for result in dist_pool(2).run(tp_training_case):
        assert result["greedy_tp"] and not result["sampled_tp"]  # sampling: whole model
        assert result["sampled_shape"] == (2, 9)
        assert result["generating"] == result["plain"]
        assert result["generating"][0] != result["generating"][-1]  # it trained
        assert result["after_training_equal"]  # TP generation sees the trained weights


@pytest.mark.timeout(120)
def test_inference_tp_size_must_divide_the_world(dist_pool):
    for message in dist_pool(2).run(tp_size_error_case, 3):
        assert "inference_tp_size=3" in message and "does not divide the world size 2" in message
