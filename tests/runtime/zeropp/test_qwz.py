"""ZeRO++ qwZ (``zero_quantized_weights``) and ``zero_quantized_nontrainable_weights`` on 4 gloo
ranks seen as 2 nodes of 2."""

from __future__ import annotations

import pytest
import torch

from shardspeed.runtime.comm.quantize import INT8
from tests.runtime.zeropp import weights_ranks

QWZ = {"zero_quantized_weights": True}
GATHER = "all_gather_into_tensor/4"
CHECK_BYTES = 2 * 8 * 4  # the module agreement's 2-element int64 all-gather per fetch
WORLD = 4


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("bf16", "ratio"), [(False, 0.25), (True, 0.5)], ids=["fp32", "bf16"])
def test_gather_bytes_are_int8_and_scales(dist_pool, bf16, ratio):
    base = dist_pool(WORLD).run(weights_ranks.phase_volumes, {}, 2, bf16=bf16)[0]
    mine = dist_pool(WORLD).run(weights_ranks.phase_volumes, QWZ, 2, bf16=bf16)[0]
    units, full = mine["units"], mine["full_nbytes"]
    payloads = sum(WORLD * INT8.payload_nbytes(chunk) for chunk in mine["chunks"])
    # int8 codes + an fp32 scale per 256-element block, each shard padded to whole blocks
    assert ratio < payloads / full < ratio * 1.2
    for plain, phases in zip(base["phases"], mine["phases"], strict=True):
        for phase in ("forward", "backward"):  # each unit gathered once per pass
            assert plain[phase][GATHER]["bytes"] == units * CHECK_BYTES + full
            assert phases[phase][GATHER]["bytes"] == units * CHECK_BYTES + payloads
            assert phases[phase][GATHER]["count"] == plain[phase][GATHER]["count"]
        assert (
            phases["backward"]["reduce_scatter_tensor/4"]
            == (plain["backward"]["reduce_scatter_tensor/4"])
        )
        assert phases["step"] == plain["step"]
    # the weights computed with are quantized: close to, not equal to, the exact run's
    assert mine["loss"] != base["loss"]
    assert mine["loss"] == pytest.approx(base["loss"], rel=1e-2)


@pytest.mark.timeout(60)
def test_kept_gathers_are_exact(dist_pool):
    for result in dist_pool(WORLD).run(weights_ranks.exact_gathers_under_qwz):
        # the hooks gathered every unit quantized, and that changed values
        assert result["lossy_before"] and result["lossy_values_differ"]
        # the module state dict and a saved checkpoint hold the exact primary values
        assert result["state_dict_exact"] and result["checkpoint_exact"]
        assert not result["lossy_after_state_dict"]
        # GatheredParameters(modifier_rank=0): the edit lands, no other element is quantized
        assert result["edit_exact"] and result["others_exact"]


@pytest.mark.timeout(60)
def test_frozen_weights_are_stored_quantized(dist_pool):
    for result in dist_pool(WORLD).run(weights_ranks.quantized_frozen_weights):
        for flat in result["stored"]:
            # frozen and trained parameters never share a buffer
            assert len(set(flat["frozen"])) == 1
            assert flat["quantized"] == flat["frozen"][0]
            if flat["quantized"]:
                assert flat["shard_nbytes"] == flat["payload_nbytes"]
        base = next(f for f in result["stored"] if f["frozen"] == [True, True])
        assert base["shard_nbytes"] < 0.27 * base["fp32_nbytes"]
        assert result["frozen_names"] == ["base.bias", "base.weight", "head.weight"]
        assert result["frozen_equal_round_trip"] and result["frozen_changed_by_quantization"]
        assert result["adapter_trained"] and result["bias_trained"]


@pytest.mark.timeout(60)
def test_zero_init_accepts_the_quantized_keys(dist_pool):
    assert all(dist_pool(WORLD).run(weights_ranks.init_accepts_quantized_keys))


@pytest.mark.timeout(120)
def test_parameter_offload_gathers_the_same_values(dist_pool, tmp_path):
    # a swapped shard is read back, then gathered quantized (or sent as its stored payload)
    keys = {**QWZ, "zero_quantized_nontrainable_weights": True}
    on_device = dist_pool(WORLD).run(weights_ranks.adapter_run, keys)
    offload = {"device": "nvme", "nvme_path": str(tmp_path)}
    swapped = dist_pool(WORLD).run(weights_ranks.adapter_run, keys, offload_param=offload)
    for base, mine in zip(on_device, swapped, strict=True):
        assert mine["loss"] == base["loss"]
        for name, value in base["params"].items():
            assert torch.equal(mine["params"][name], value), name
