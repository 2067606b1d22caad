"""ZeRO-Inference: a Hugging Face Llama run forward (and greedy ``generate``) through
``shardspeed.initialize`` at ZeRO stage 3 without an optimizer, its parameter shards offloaded
to host memory or to NVMe files, equals the plain model; between uses each rank holds only its
shard, off the module (in host memory, or in swap files and not in memory)."""

from __future__ import annotations

import pytest

from tests.inference import zero_ranks

TIMEOUT_S = 120


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_zero3_parameter_offload_forward_equals_plain_model(dist_pool, tmp_path, device):
    folder = str(tmp_path) if device == "nvme" else None
    results = dist_pool(2).run(zero_ranks.zero_inference, device, folder, timeout_s=TIMEOUT_S)
    for result in results:
        assert result["optimizer"] is None
        assert result["max_err"] < 1e-5, result
        assert result["tokens_equal"], result
        # after the forward every module parameter is released: its storage holds no bytes
        assert result["param_bytes_on_module"] == 0, result
        # each rank's shards are half the model (padded to the world size)
        assert result["full_bytes"] / 2 <= result["shard_bytes"] < result["full_bytes"] / 2 + 64
        if device == "cpu":
            assert result["shard_devices"] == ["cpu"]
            assert result["shard_bytes_in_memory"] == result["shard_bytes"], result
        else:
            assert result["shard_bytes_in_memory"] == 0, result
            assert result["swap_files"] > 0, result
            assert result["swap_bytes"] >= result["shard_bytes"], result
