"""Checkpoints written by shardspeed before the restructure of its ZeRO layer and checkpoint
format (commit 7925258, tests/fixtures/shardspeed_7925258) still load, on the stage and world
size that saved them and on others: the same full fp32 masters and Adam moments bit for bit, then
the same losses and parameters as the saving job for 3 more steps."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.checkpoint.test_reshard import load_and_continue

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "shardspeed_7925258"


@pytest.mark.parametrize(
    "case,world,stage,bucket,dtype,groups",
    [
        ("stage2_fp32_groups", 2, 2, 3000, "fp32", True),
        ("stage2_fp32_groups", 4, 1, 700, "fp32", True),
        ("stage2_fp32_groups", 2, 0, 5000, "fp32", True),
        ("stage0_bf16", 2, 0, 5000, "bf16", False),
        ("stage0_bf16", 2, 2, 3000, "bf16", False),
    ],
    ids=["w2-stage2", "w4-stage1", "w2-stage0", "bf16-w2-stage0", "bf16-w2-stage2"],
)
def test_checkpoint_of_7925258_loads(dist_pool, case, world, stage, bucket, dtype, groups):
    # written before the checkpoint record: loaded unchecked, as before
    dist_pool(world).run(
        load_and_continue, str(FIXTURE / case), stage, bucket, dtype, groups, legacy=True
    )
