"""Muon at ZeRO stages 0-3 on 2 gloo ranks equals one process with torch.optim.Muon + AdamW;
checkpoints move between stages; bf16 and ZeRO-Offload run."""

from __future__ import annotations

import pytest

from tests.runtime.muon.muon_ranks import (
    run_bf16_smoke,
    run_muon_parity,
    run_nvme_offload,
    run_offload,
    run_resume_across_stages,
)


@pytest.mark.timeout(600)
def test_ten_steps_match_torch_muon_at_every_stage(dist_pool):
    pool = dist_pool(2)
    for stage in (0, 1, 2, 3):
        results = pool.run(run_muon_parity, stage, timeout_s=240)
        losses = results[0]["losses"]
        assert len(losses) == 10 and losses[-1] < losses[0], (stage, losses)
        tagged = results[0]["tagged"]
        # the tiny GPT's hidden matrices go to Muon, its norms and biases to AdamW
        assert tagged["blocks.0.attn.qkv.weight"] and not tagged["blocks.0.attn.qkv.bias"]
        assert not tagged["ln_f.weight"]


@pytest.mark.timeout(300)
def test_one_rank_takes_the_collective_free_path(dist_pool):
    # at world size 1 a chunk is its whole buffer: no gather, no deal, no reduce-scatter (the
    # path a single GPU takes at stages 1-3), still torch's numbers
    pool = dist_pool(1)
    for stage in (1, 2, 3):
        results = pool.run(run_muon_parity, stage, 4, timeout_s=240)
        assert len(results[0]["losses"]) == 4, stage


@pytest.mark.timeout(300)
def test_gather_placement_matches_too(dist_pool):
    results = dist_pool(2).run(run_muon_parity, 2, 4, "gather", timeout_s=240)
    assert len(results[0]["losses"]) == 4


@pytest.mark.timeout(400)
@pytest.mark.parametrize("first,second", [(1, 3), (3, 0)], ids=["1to3", "3to0"])
def test_checkpoint_resumes_at_another_stage(dist_pool, tmp_path, first, second):
    compared = dist_pool(2).run(
        run_resume_across_stages, str(tmp_path), first, second, timeout_s=300
    )
    assert compared == [4, 4]


@pytest.mark.timeout(300)
def test_bf16_trains(dist_pool):
    losses = dist_pool(2).run(run_bf16_smoke, 2, timeout_s=240)[0]
    assert sum(losses[-3:]) < sum(losses[:3])


@pytest.mark.timeout(300)
def test_cpu_optimizer_offload_equals_no_offload(dist_pool):
    dist_pool(2).run(run_offload, 2, timeout_s=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("in_memory", [False, True], ids=["swapped", "in_memory"])
def test_nvme_offload_and_momentum_in_memory(dist_pool, tmp_path, in_memory):
    names = dist_pool(2).run(run_nvme_offload, str(tmp_path), in_memory, timeout_s=240)[0]
    assert any("exp_avg" in n for n in names), names  # AdamW's moments are swapped either way
    assert any("momentum_buffer" in n for n in names) is not in_memory, names
