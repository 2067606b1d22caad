"""MiCS (``zero_optimization.mics_shard_size``): ZeRO-3 sharded within groups of 2 ranks and
replicated across them, on 4 gloo ranks, equals the single-process reference step by step."""

from __future__ import annotations

import pytest

from tests.runtime.zero import mics_ranks


@pytest.mark.parametrize(("kind", "gas", "clip"), [("gpt", 1, 1.0), ("mlp", 2, 0.0)])
def test_mics_equals_single_process(dist_pool, kind: str, gas: int, clip: float):
    losses = dist_pool(4).run(mics_ranks.parity, kind, gas, clip)
    assert losses[0] == losses[-1]


def test_each_rank_holds_half_the_model_with_shard_groups_of_two(dist_pool):
    held = dist_pool(4).run(mics_ranks.shard_bytes)
    for rank in held:
        # padding to the group size aside, a shard of 2 ranks, not of the world's 4
        assert rank["total"] / 2 <= rank["held"] <= rank["total"] / 2 + 64


@pytest.mark.timeout(240)
def test_checkpoints_resume_with_and_without_mics(dist_pool, tmp_path):
    """Saved under MiCS (4 ranks, groups of 2: one group's ranks write the shards), resumed in
    parity at plain stage 2 on 2 ranks; and a stage-3 checkpoint of 4 ranks resumed under
    MiCS (optimizer state equal after load, then the same losses and weights)."""
    from tests.checkpoint import test_reshard as reshard

    mics = tmp_path / "mics"
    dist_pool(4).run(reshard.save_and_continue, str(mics), 3, 3000, "fp32", False, 2)
    shards = sorted(p.name for p in (mics / "mid").glob("zero_pp_rank_*_optim_states.pt"))
    assert shards == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]
    dist_pool(2).run(reshard.load_and_continue, str(mics), 2, 5000, "fp32")
    plain = tmp_path / "plain"
    dist_pool(4).run(reshard.save_and_continue, str(plain), 3, 3000, "fp32")
    dist_pool(4).run(reshard.load_and_continue, str(plain), 3, 3000, "fp32", mics=2)


def test_models_built_by_mics_init(dist_pool):
    mics, reference, fraction = dist_pool(4).run(mics_ranks.built_by_mics_init)[0]
    assert 0.45 <= fraction <= 0.55  # half per rank: shard groups of 2, not the world's 4
    assert mics == pytest.approx(reference, rel=1e-5)
