"""What ZeRO stages 0-2 communicate and hold per rank."""

from __future__ import annotations

import pytest

from tests.runtime.zero import ranks


@pytest.mark.parametrize("gas", [1, 4], ids=["gas1", "gas4"])
@pytest.mark.parametrize("stage", [0, 1, 2], ids=["stage0", "stage1", "stage2"])
@pytest.mark.parametrize("world", [2, 4], ids=["w2", "w4"])
def test_bus_volume_per_step_is_two_psi(dist_pool, world, stage, gas):
    """One all-reduce (stage 0) or reduce-scatter + all-gather (stages 1/2) of Ψ elements per
    optimizer step, whatever the accumulation: 2Ψ(N-1)/N elements of bus traffic."""
    for result in dist_pool(world).run(ranks.comm_bus_bytes_per_step, stage, gas):
        expected = 2 * result["params"] * (world - 1) / world * 4  # fp32
        assert result["bus_bytes"] == pytest.approx(expected, rel=0.05)


@pytest.mark.parametrize("world", [2, 4], ids=["w2", "w4"])
def test_partitioned_memory(dist_pool, world):
    pool = dist_pool(world)
    for stage in (1, 2):
        for held in pool.run(ranks.memory_accounting, stage):
            psi, n = held["params"], held["world"]
            # each bucket pads at most n-1 elements; a handful of buckets here
            slack = psi / n * 0.02 + 16 * n
            for key in ("exp_avg", "exp_avg_sq", "master_partition", "grad_partition"):
                assert psi / n <= held[key] <= psi / n + slack, (stage, key, held)
            # fp32: the optimizer steps the model's own chunks (no master copy), and every
            # trainable parameter lives in the flat buffers the all-gather writes into
            assert held["master_copies"] == 0 and held["params_outside_flat"] == 0, held
            if stage == 1:
                assert held["model_grads"] == psi  # stage 1 keeps full gradients
                # ... and reduces into its own chunk of them: no separate gradient partition
                assert held["grad_partition_copies"] == 0, held
            else:
                # stage 2: no full gradient survives the reducing backward, no bucket buffer
                # either (not even one kept for reuse: it would sit beside the next forward's
                # activations)
                assert held["model_grads"] == 0
                assert held["grad_partition_copies"] == held["grad_partition"], held
                assert held["bucket_buffers_after_backward"] == 0
                assert held["spare_bucket_buffers"] == 0, held
                # and the gradient partition is freed once the step has used it
                assert held["grad_partition_after_step"] == 0, held


@pytest.mark.parametrize("stage", [1, 2], ids=["stage1", "stage2"])
def test_checkpoint_resume_continues_identically(dist_pool, stage, tmp_path):
    dist_pool(2).run(ranks.checkpoint_resume, stage, str(tmp_path))
    names = sorted(p.name for p in (tmp_path / "mid").iterdir())
    assert names == [
        "manifest.json",
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]


def test_checkpoint_resume_bf16_stage2(dist_pool, tmp_path):
    dist_pool(2).run(ranks.checkpoint_resume, 2, str(tmp_path), "bf16")


@pytest.mark.parametrize("stage", [0, 1, 2], ids=["stage0", "stage1", "stage2"])
def test_safe_accessors(dist_pool, stage):
    dist_pool(2).run(ranks.accessors, stage)


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        ("quantized", "zero_quantized_gradients"),
        ("offload", "offload_optimizer"),
        ("untested", "zero_allow_untested_optimizer"),
        ("untested_allowed", ""),
    ],
)
def test_config_errors(dist_pool, case, needle):
    messages = dist_pool(2).run(ranks.config_error, 1, case)
    assert all(needle in m for m in messages) and all(bool(m) == bool(needle) for m in messages)
