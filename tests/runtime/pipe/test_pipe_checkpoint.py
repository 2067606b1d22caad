"""Pipeline checkpoints in DeepSpeed's layout (a file per layer, per stage, per ZeRO shard)
load at another pipeline and data-parallel degree and training goes on in parity."""

from __future__ import annotations

import os

import pytest

from tests.runtime.pipe import ranks


@pytest.mark.parametrize("zero_stage", [1, 0], ids=["zero1", "zero0"])
@pytest.mark.timeout(300)
def test_save_pipe2_data2_load_pipe4_and_pipe1(dist_pool, tmp_path, zero_stage):
    save_dir = str(tmp_path / "ckpt")
    loads = [4, 1] if zero_stage == 1 else [1]
    dist_pool(4).run(ranks.checkpoint_across_degrees, save_dir, zero_stage, 2, loads)
    names = sorted(os.listdir(os.path.join(save_dir, "t3")))
    assert [n for n in names if n.startswith("layer_")] == [
        f"layer_{i:02d}-model_states.pt" for i in range(5)
    ]  # the tied head (a forward_fn of the embedding) has no file of its own
    assert "mp_rank_00_model_states.pt" in names and "mp_rank_01_model_states.pt" in names
    shards = [n for n in names if n.endswith("optim_states.pt")]
    if zero_stage == 1:
        assert shards == [
            f"zero_pp_rank_{d}_mp_rank_{s:02d}_optim_states.pt" for d in (0, 1) for s in (0, 1)
        ]
        # the one reader refuses the tag with its record edited, and loads it without one
        dist_pool(4).run(ranks.record_checked, save_dir)
    else:
        assert shards == []
