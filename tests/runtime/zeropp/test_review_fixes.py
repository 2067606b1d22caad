"""ZeRO++ edge cases: integer parameters are never quantized, a weight written with
``safe_set_full_fp32_param`` drops hpZ's stale secondary, and frozen int8 weights keep their
values when a checkpoint is reloaded at another world size."""

from __future__ import annotations

import pytest
import torch

from tests.runtime.zeropp import fix_ranks


@pytest.mark.timeout(240)
def test_integer_parameters_travel_unquantized(dist_pool):
    pool = dist_pool(4)
    assert pool.run(fix_ranks.integer_parameter_seen, {"zero_quantized_weights": True}) == [0] * 4


@pytest.mark.timeout(240)
def test_safe_set_reaches_the_next_forward_under_hpz(dist_pool):
    pool = dist_pool(4)
    for zeropp in ({}, {"zero_hpz_partition_size": 2}):
        # the zeroed weight leaves the bias alone in the output
        for gap in pool.run(fix_ranks.set_weight_then_forward, zeropp):
            assert gap < 1e-6, (zeropp, gap)


@pytest.mark.timeout(300)
def test_frozen_int8_weights_reload_at_another_world_size(dist_pool, tmp_path):
    saved = dist_pool(4).run(fix_ranks.save_frozen, str(tmp_path))[0]
    for world in (4, 2):
        loaded = dist_pool(world).run(fix_ranks.load_frozen, str(tmp_path))[0]
        for name, value in saved.items():
            assert torch.equal(loaded[name], value), (world, name)
