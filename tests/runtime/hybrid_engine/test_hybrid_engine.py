"""The hybrid engine (``hybrid_engine.enabled``): generation under ZeRO-3 on 2 gloo ranks."""

from __future__ import annotations

import pytest

from tests.runtime.hybrid_engine.ranks import (
    generate_case,
    lora_case,
    training_case,
)


@pytest.mark.timeout(240)
def test_generate_under_zero3_matches_the_whole_model_with_one_gather_per_module(dist_pool):
    pool = dist_pool(2)
    for rank in pool.run(generate_case, [4, 16]):
        assert rank["kind"] == "DeepSpeedHybridEngine"
        assert rank["fused"]  # a Llama decodes through shardspeed's fused decoder
        assert rank["equal"] == [True, True]
        assert rank["hooks_equal"]
        assert rank["training_mode"]  # generate leaves the model in training mode
        # one all-gather per module holding parameters, however many tokens: not per token
        assert rank["hybrid"][0] == rank["hybrid"][1]
        assert 0 < rank["hybrid"][0] <= rank["units"]
        # the training engine's hooks gather for every forward, so for every token
        assert rank["hooks"][1] > rank["hooks"][0] > rank["hybrid"][0]


@pytest.mark.timeout(240)
def test_generate_below_stage3_gathers_nothing(dist_pool):
    for rank in dist_pool(2).run(generate_case, [4], stage=2):
        assert rank["kind"] == "DeepSpeedHybridEngine"
        assert rank["equal"] == [True] and rank["fused"]
        assert rank["hybrid"] == [0]


@pytest.mark.timeout(240)
def test_unpinned_generation_gathers_through_the_hooks(dist_pool):
    pool = dist_pool(2)
    for rank in pool.run(generate_case, [4], pin_parameters=False):
        assert rank["equal"] == [True]
        assert not rank["fused"]
        assert rank["hybrid"][0] == rank["hooks"][0]  # module by module, every token


@pytest.mark.timeout(240)
def test_training_after_generate_is_unchanged(dist_pool):
    pool = dist_pool(2)
    for rank in pool.run(training_case):
        assert rank["generating"] == rank["plain"]
        assert rank["generating"][0] != rank["generating"][-1]  # it trained
        assert rank["after_training_equal"] == [True]  # generation sees the trained weights


@pytest.mark.timeout(240)
def test_lora_is_fused_for_generation_only(dist_pool):
    pool = dist_pool(2)
    for rank in pool.run(lora_case):
        assert rank["lora_layers"] == 4  # q_proj and v_proj of 2 layers
        assert rank["differs_from_base"]  # the adapters change the tokens
        assert rank["equal"] and rank["fused"]
        assert rank["base_unchanged"]


@pytest.mark.timeout(240)
def test_unwrap_model_for_generation_gathers_once(dist_pool):
    from tests.runtime.hybrid_engine.ranks import unwrap_case

    for rank in dist_pool(2).run(unwrap_case):
        assert rank["equal"]  # the whole model's greedy tokens
        assert rank["gathers"] > 0 and rank["gathers_in_generate"] == 0  # once, not per token
        assert rank["training_mode"]  # the engine's module was never switched
        assert rank["losses_equal"]  # training after it is untouched
