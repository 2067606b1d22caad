"""ZeRO-Offload of the optimizer (``zero_optimization.offload_optimizer``) at stages 1-3:
training equals the same stage without offload, and NVMe offload keeps the optimizer state in
files, not memory, between steps."""

from __future__ import annotations

import pytest

from tests.runtime.offload import offload_ranks
from tests.runtime.parity import run_parity

STEPS = 10


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world", [1, 2], ids=["w1", "w2"])
def test_cpu_offload_matches_single_process(dist_pool, world, stage):
    """Stages 1-3 with the optimizer offloaded to host memory (DeepSpeedCPUAdam) match one
    process on the global batch: losses, parameters and Adam moments every step, with gradient
    accumulation and clipping."""
    zero = {"offload_optimizer": {"device": "cpu"}, "stage3_param_persistence_threshold": 0}
    losses = dist_pool(world).run(
        run_parity,
        "gpt",
        2,
        1.0,
        STEPS,
        stage=stage,
        atol=1e-5,
        config_extra={"zero_optimization": zero},
    )
    assert sum(losses[0][-3:]) < sum(losses[0][:3])


@pytest.mark.parametrize("world", [1, 2], ids=["w1", "w2"])
def test_stage3_cpu_offload_of_parameters_and_optimizer(dist_pool, world):
    """Stage 3 with offload_param and offload_optimizer on the host matches one process (on
    this CPU-only machine the host is the device: this checks the configuration path and that
    nothing is copied or lost, not a transfer)."""
    zero = {
        "offload_param": {"device": "cpu"},
        "offload_optimizer": {"device": "cpu"},
        "stage3_param_persistence_threshold": 0,
    }
    losses = dist_pool(world).run(
        run_parity,
        "gpt",
        2,
        1.0,
        STEPS,
        stage=3,
        atol=1e-5,
        config_extra={"zero_optimization": zero},
    )
    assert sum(losses[0][-3:]) < sum(losses[0][:3])


def test_offload_builds_the_cpu_optimizer(dist_pool, tmp_path):
    kinds = dist_pool(2).run(offload_ranks.optimizer_kind, 2, "nvme", str(tmp_path))
    assert kinds == ["DeepSpeedCPUAdam", "DeepSpeedCPUAdam"]


def test_client_optimizer_needs_a_cpu_kind(dist_pool):
    pool = dist_pool(2)
    refused = pool.run(offload_ranks.client_optimizer_check, True)
    assert all("ZeRORuntimeException" in m and "zero_force_ds_cpu_optimizer" in m for m in refused)
    assert pool.run(offload_ranks.client_optimizer_check, False) == ["", ""]


@pytest.mark.parametrize(
    ("world", "stage", "ratio", "sub_group"),
    [
        (2, 1, 1.0, 0),
        (1, 2, 1.0, 0),
        (2, 2, 1.0, 0),
        (2, 3, 1.0, 3000),
        (1, 3, 0.5, 3000),
        (2, 3, 0.5, 3000),
    ],
    ids=["stage1", "stage2-w1", "stage2", "stage3-subgroups", "stage3-half-w1", "stage3-half"],
)
def test_nvme_offload_matches_and_frees_the_state(
    dist_pool, tmp_path, world, stage, ratio, sub_group
):
    results = dist_pool(world).run(
        offload_ranks.nvme_trains_like_no_offload, stage, str(tmp_path), ratio, sub_group
    )
    for result in results:
        reference = result["state_reference"]  # Adam's two moments, in memory without offload
        assert reference > 0
        # each file is padded to whole 4 KiB blocks (direct I/O)
        padding = result["files"] * 4096
        if ratio == 1.0:
            assert result["state_in_memory"] == 0
            assert reference <= result["bytes_on_disk"] <= reference + padding
        else:  # about half the moments on disk, the rest in memory
            assert 0 < result["state_in_memory"] < reference
            on_disk = reference - result["state_in_memory"]
            assert on_disk <= result["bytes_on_disk"] <= on_disk + padding
            assert on_disk == pytest.approx(reference * ratio, rel=0.35)


@pytest.mark.parametrize("stage", [2, 3])
def test_checkpoints_load_across_offload(dist_pool, tmp_path, stage):
    curves = dist_pool(2).run(offload_ranks.checkpoints_cross_offload, stage, str(tmp_path))
    assert all(len(curve) == 3 for curve in curves)  # each rank: four equal curves


@pytest.mark.parametrize("optimizer", [True, False], ids=["and-optimizer", "params-only"])
@pytest.mark.parametrize("world", [1, 2], ids=["w1", "w2"])
def test_stage3_parameter_offload_to_nvme(dist_pool, tmp_path, world, optimizer):
    """ZeRO-Infinity: stage 3's parameter shards (and the optimizer state) in files between
    uses; training equals no offload, and between steps no shard holds memory."""
    results = dist_pool(world).run(
        offload_ranks.nvme_trains_like_no_offload,
        3,
        str(tmp_path),
        1.0,
        3000,
        2,
        True,
        optimizer,
    )
    for result in results:
        assert result["shards_reference"] > 0
        assert result["shards_in_memory"] == 0
        assert result["bytes_on_disk"] >= result["shards_reference"] + (
            result["state_reference"] if optimizer else 0
        )
        assert (result["state_in_memory"] == 0) == optimizer


@pytest.mark.parametrize(("stage", "params"), [(2, False), (3, True)], ids=["state", "shards"])
def test_a_full_disk_is_refused_before_training(dist_pool, tmp_path, stage, params):
    """A 1 MiB filesystem cannot take the swap files: initialize stops with the folder, the
    free and the needed bytes named, before any state is written."""
    from tests.runtime.swap.conftest import mounted_tmpfs

    target = tmp_path / "tiny"
    target.mkdir()
    with mounted_tmpfs(target, "size=1M") as why:
        if why is not None:
            pytest.skip(why)
        messages = dist_pool(2).run(offload_ranks.full_disk_message, stage, str(target), params)
    # every rank stops; the one (or ones) that hit the full disk name it, the free and the
    # needed bytes, the others say another rank failed
    assert all(messages), messages
    assert any(str(target) in m and "free" in m for m in messages), messages
    assert all(str(target) in m or "another rank failed" in m for m in messages), messages


@pytest.mark.parametrize("world", [1, 2], ids=["w1", "w2"])
def test_init_built_model_trains_from_nvme(dist_pool, tmp_path, world):
    dist_pool(world).run(offload_ranks.init_built_model_offloaded, str(tmp_path))


@pytest.mark.parametrize("stage", [2, 3])
def test_offload_states_round_trip(dist_pool, stage):
    """engine.offload_states / reload_states (only 'cpu', as DeepSpeed): training continues
    bit-identically, and get_state_devices reports where each kind is (the host here)."""
    for devices in dist_pool(2).run(offload_ranks.offload_states_round_trip, stage):
        refusals = devices.pop("refusals")
        assert all(found in ([], ["cpu"]) for found in devices.values()), devices
        assert devices["optim_states"] == ["cpu"]
        if stage == 3:
            assert devices["lp_params"] == ["cpu"]
        assert "only 'cpu' is supported" in refusals[0]
        assert len(refusals) == (2 if stage < 3 else 1)
        if stage < 3:
            assert "lp_params" in refusals[1]
