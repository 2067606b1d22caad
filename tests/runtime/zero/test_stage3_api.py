"""ZeRO stage 3 behaviour on real gloo ranks: what each rank holds between and during uses,
evaluation, the full state dict and ``GatheredParameters``."""

from __future__ import annotations

import pytest
from torch import nn

from shardspeed.config import DeepSpeedConfig
from shardspeed.runtime.zero.rules import check_zero_config
from shardspeed.utils import (
    get_z3_leaf_modules,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules,
    z3_leaf_module,
)
from tests.runtime.zero import stage3_ranks


@pytest.mark.parametrize("world", [2, 4], ids=["w2", "w4"])
def test_only_shards_between_uses(dist_pool, world):
    dist_pool(world).run(stage3_ranks.shards_between_uses)


def test_eval_state_dict_and_gathered_parameters(dist_pool):
    dist_pool(2).run(stage3_ranks.eval_state_dict_and_gathered_edits)


@pytest.mark.parametrize(
    ("keys", "named"),
    [
        ({"zero_hpz_partition_size": 2}, "zero_hpz_partition_size"),
        ({"zero_quantized_weights": True}, "zero_quantized_weights"),
        ({"zero_quantized_gradients": True}, "zero_quantized_gradients"),
    ],
)
def test_zeropp_keys_are_stage3_only(keys, named):
    # accepted at stage 3 (tests/runtime/zeropp/ trains with them), refused by name below it
    config = DeepSpeedConfig({"train_batch_size": 1, "zero_optimization": {"stage": 3, **keys}})
    check_zero_config(config)
    with pytest.raises(ValueError, match=f"{named}.*needs ZeRO stage 3"):
        DeepSpeedConfig({"train_batch_size": 1, "zero_optimization": {"stage": 2, **keys}})


@pytest.mark.parametrize(
    ("stage", "keys", "named"),
    [
        (2, {"offload_param": {"device": "cpu"}}, "offload_param.device.*needs ZeRO stage 3"),
        (2, {"mics_shard_size": 2}, "mics_shard_size.*needs ZeRO stage 3"),
        (3, {"offload_param": {"device": "nvme"}}, "offload_param.nvme_path is required"),
        (0, {"offload_optimizer": {"device": "cpu"}}, "needs ZeRO stage 1, 2 or 3"),
        (
            3,
            {"offload_optimizer": {"device": "nvme", "nvme_path": "/no/such/folder"}},
            "not an existing folder",
        ),
    ],
)
def test_offload_misconfigurations_name_the_fix(stage, keys, named):
    # refused when the config is parsed (a stage rule DeepSpeed applies there) or at initialize
    with pytest.raises(ValueError, match=named):
        zero = {"stage": stage, **keys}
        check_zero_config(DeepSpeedConfig({"train_batch_size": 1, "zero_optimization": zero}))


@pytest.mark.parametrize("world", [2, 4], ids=["w2", "w4"])
def test_init_builds_the_model_partitioned(dist_pool, world):
    for result in dist_pool(world).run(stage3_ranks.init_builds_partitioned):
        print(
            f"zero.Init world {world}: "
            + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in result.items())
        )
        # the peak while building is this rank's share plus about one module (the largest
        # holds 2.25 MiB here), far under the full model (2x or 4x the share)
        assert result["peak"] < result["held"] + 8 * 2**20, result


def test_init_model_trains_like_a_normal_build(dist_pool):
    dist_pool(2).run(stage3_ranks.init_trains_like_a_normal_build)


@pytest.mark.timeout(120)
def test_divergent_branches_fail_fast_naming_modules(dist_pool):
    messages = dist_pool(2).run(stage3_ranks.divergent_branches_fail_fast)
    for message in messages:
        assert "rank 0: forward of router.a" in message, message
        assert "rank 1: forward of router.b" in message, message
        assert "set_z3_leaf_modules" in message


@pytest.mark.parametrize("via_config", [False, True], ids=["by_class", "config_names"])
def test_leaf_module_gathers_its_subtree(dist_pool, via_config):
    dist_pool(2).run(stage3_ranks.leaf_module_makes_branches_work, via_config)


def test_external_parameter_saves_and_is_zero_param(dist_pool, tmp_path):
    dist_pool(2).run(stage3_ranks.external_parameter_is_gathered, str(tmp_path))


def test_leaf_marks_by_class_name_suffix_and_unset():
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReLU(), nn.Linear(2, 2)))
    assert set_z3_leaf_modules(model, [nn.ReLU]) == [model[1][0]]
    assert set_z3_leaf_modules(model, ["torch.nn.modules.linear.Linear"]) == [
        model[0],
        model[1][1],
    ]
    assert get_z3_leaf_modules(model) == [model[0], model[1][0], model[1][1]]
    assert unset_z3_leaf_modules(model, ["Linear"]) == [model[0], model[1][1]]
    assert set_z3_leaf_modules_by_suffix(model, ["1.1"]) == [model[1][1]]
    assert set_z3_leaf_modules_by_name(model, ["1"]) == [model[1]]
    assert z3_leaf_module(model[1]) and not z3_leaf_module(model[0])
    with pytest.raises(ValueError, match="no module of the model matches"):
        set_z3_leaf_modules_by_name(model, ["missing"])
    assert set_z3_leaf_modules(model, ["Missing"], raise_if_not_found=False) == []


def test_live_parameters_stay_within_the_budget(dist_pool):
    """The root's 1000 elements stay gathered while a 272-element layer runs: 1272 at once.
    A frozen layer is released after its backward, not held to the end of it."""
    pool = dist_pool(2)
    for result in pool.run(stage3_ranks.live_parameters_budget, 1300):
        assert result["peak"] <= 1300, result
    for result in pool.run(stage3_ranks.live_parameters_budget, 1100):
        assert result == {"error": 1.0}


def test_prefetch_gathers_the_next_module_ahead(dist_pool):
    pool = dist_pool(2)
    for seen in pool.run(stage3_ranks.prefetch_runs_ahead, 50_000_000):
        assert "NOT_AVAILABLE" not in seen, seen
    for seen in pool.run(stage3_ranks.prefetch_runs_ahead, 0):  # prefetching off
        assert set(seen.split(",")) == {"NOT_AVAILABLE"}, seen


def test_changing_module_order_is_followed(dist_pool):
    for changes in dist_pool(2).run(stage3_ranks.changing_order_stays_correct):
        assert changes >= 3


def test_tiled_linear_under_init(dist_pool):
    dist_pool(2).run(stage3_ranks.tiled_linear_under_init)


def test_reuse_distance_keeps_a_reused_module_gathered(dist_pool):
    pool = dist_pool(2)
    assert pool.run(stage3_ranks.reuse_keeps_gathered, 1_000_000_000)[0] == (
        "AVAILABLE,NOT_AVAILABLE"
    )
    # the two calls are back to back; a distance of 0 keeps nothing
    assert pool.run(stage3_ranks.reuse_keeps_gathered, 0)[0] == "NOT_AVAILABLE,NOT_AVAILABLE"


def test_parameters_created_after_initialize_are_refused(dist_pool):
    for messages in dist_pool(2).run(stage3_ranks.new_parameters_are_refused):
        assert len(messages) == 2
        assert "late_scale" in messages[0] and "neither partitioned nor updated" in messages[0]
        assert "1.extra" in messages[1] and "__init__" in messages[1]


def test_subpackages_resolve_from_the_top_level_module():
    """``deepspeed.zero.Init`` and friends, written after a bare ``import deepspeed``."""
    import subprocess
    import sys

    code = (
        "import shardspeed as ds; "
        "print(ds.zero.Init.__name__, ds.zero.GatheredParameters.__name__, "
        "ds.checkpoint.__name__, ds.monitor.__name__, ds.launcher.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [
        "Init",
        "GatheredParameters",
        "shardspeed.checkpoint",
        "shardspeed.monitor",
        "shardspeed.launcher",
    ]
