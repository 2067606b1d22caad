"""The engine side: an experiment measures its profiled steps, writes the metric file and ends;
a profile run writes the parameter counts and the activation bytes of one micro-step."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.autotuning.probe_ranks import run_experiment_engine
from tests.harness.distributed import DistributedPool


@pytest.mark.timeout(120)
def test_experiment_metric_and_profile_run(
    dist_pool: Callable[[int], DistributedPool], tmp_path: Path
) -> None:
    pool = dist_pool(1)
    metric = str(tmp_path / "m" / "metrics.json")
    section = {
        "enabled": True,
        "metric_path": metric,
        "start_profile_step": 2,
        "end_profile_step": 4,
    }
    (out,) = pool.run(run_experiment_engine, section, 4, 10)
    assert out["exited_at"] == 4  # ended right after end_profile_step, as DeepSpeed does
    m = out["metric_path"]
    assert set(m) == {"throughput", "latency", "flops"}
    assert m["throughput"] == pytest.approx(8 / m["latency"])  # samples per step / seconds
    # enabled without a metric path (a normal run of a tuned config): no probe, no exit
    (plain,) = pool.run(run_experiment_engine, {"enabled": True}, 4, 3)
    assert plain["exited_at"] is None
    info_path = str(tmp_path / "info.json")
    profile = {"enabled": True, "model_info": {"profile": True}, "model_info_path": info_path}
    runs = {micro: pool.run(run_experiment_engine, profile, micro, 3)[0] for micro in (2, 6)}
    for micro, run in runs.items():
        info = run["model_info_path"]
        assert run["exited_at"] == 1
        assert info["num_params"] == info["trainable_num_params"] == 8 * 32 + 32 + 32 + 1
        assert info["largest_layer_params"] == 8 * 32 + 32
        assert info["profiled_micro_batch_size"] == micro
    # activations scale with the micro-batch: a per-sample figure independent of it
    per_sample = [runs[m]["model_info_path"]["activation_bytes_per_sample"] for m in (2, 6)]
    assert per_sample[0] > 4 * 32 and per_sample[0] == pytest.approx(per_sample[1], rel=0.2)
