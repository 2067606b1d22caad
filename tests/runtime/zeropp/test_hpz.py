"""ZeRO++ hpZ (``zero_hpz_partition_size``): secondary shards inside groups of consecutive ranks,
on 4 gloo ranks seen as 2 nodes of 2."""

from __future__ import annotations

import pytest
import torch

from tests.runtime.zeropp import ranks, weights_ranks

HPZ = {"zero_hpz_partition_size": 2}
GATHER = "all_gather_into_tensor"
#: the module agreement's check before every fetch: a 2-element int64 all-gather over the world
CHECK_BYTES = 2 * 8 * 4


@pytest.mark.timeout(120)
def test_hpz_alone_is_exact(dist_pool):
    plain = dist_pool(4).run(ranks.train, {}, 3, node=2)
    hpz = dist_pool(4).run(ranks.train, HPZ, 3, node=2)
    for base, mine in zip(plain, hpz, strict=True):
        assert mine["loss"] == base["loss"]  # bit for bit
        for name, value in base["params"].items():
            assert torch.equal(mine["params"][name], value), name


@pytest.mark.timeout(120)
@pytest.mark.parametrize("qwz", [False, True], ids=["hpz", "hpz+qwz"])
def test_backward_gathers_stay_in_the_node(dist_pool, qwz):
    keys = {**HPZ, "zero_quantized_weights": True} if qwz else HPZ
    base = dist_pool(4).run(weights_ranks.phase_volumes, {}, 2)[0]
    mine = dist_pool(4).run(weights_ranks.phase_volumes, keys, 2)[0]
    units, full = mine["units"], mine["full_nbytes"]
    # every flat keeps a secondary shard of half its full buffer
    assert mine["secondary_nbytes"] * 2 == full
    for plain, phases in zip(base["phases"], mine["phases"], strict=True):
        backward = phases["backward"]
        # over the world only the agreement checks remain; the parameters come from the node,
        # unquantized (qwZ's dequantized values are copied as they are)
        assert backward[f"{GATHER}/4"] == {
            "count": units,
            "bytes": units * CHECK_BYTES,
            "bus_bytes": pytest.approx(units * CHECK_BYTES * 0.75),
        }
        assert backward[f"{GATHER}/2"]["count"] == units
        assert backward[f"{GATHER}/2"]["bytes"] == full
        # the reduce-scatter and the step are unchanged
        assert backward["reduce_scatter_tensor/4"] == plain["backward"]["reduce_scatter_tensor/4"]
        assert phases["step"] == plain["step"]
        if not qwz:  # the forward is plain ZeRO-3's
            assert phases["forward"] == plain["forward"]


@pytest.mark.timeout(60)
def test_secondary_is_dropped_when_the_primary_changes(dist_pool):
    result = dist_pool(4).run(weights_ranks.secondary_follows_primary)[0]
    assert result["after_backward"] == [True, True, True]
    assert result["sizes_ok"]
    assert result["after_step"] == [False, False, False]
    assert result["after_forward"] == [True, True, True]
    # GatheredParameters(modifier_rank=0) on layer a: only a's unit changed
    assert result["after_modifier"] == [False, True, True]
    assert result["after_load"] == [False, False, False]


@pytest.mark.timeout(60)
def test_hpz_with_parameter_offload_is_refused_by_name(dist_pool):
    messages = dist_pool(4).run(weights_ranks.hpz_with_offload_refused)
    for message in messages:
        assert "zero_hpz_partition_size" in message and "offload_param" in message
