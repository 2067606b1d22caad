"""The 1-bit optimizers exchange all their parameters' compressed tensors of a step in one
batch: 4 collectives per step, not 4 per parameter (the small GPT has 10+ parameters)."""

from __future__ import annotations

import pytest

from tests.runtime.onebit.ranks import train

CASES = {
    "OneBitAdam": {"lr": 3e-3, "freeze_step": 2},
    "ZeroOneAdam": {"lr": 3e-3, "var_freeze_step": 4, "var_update_scaler": 2},
    "OneBitLamb": {"lr": 3e-3, "freeze_step": 2},
}


@pytest.mark.timeout(300)
def test_one_batched_exchange_per_step(dist_pool):
    pool = dist_pool(2)
    for kind, params in CASES.items():
        for record in pool.run(train, kind, params, 8):
            exchanged = [v for v in record["volume"] if "all_to_all_single" in v]
            assert len(exchanged) >= 4, (kind, record["volume"])
            for volume in exchanged:
                assert volume["all_to_all_single"]["count"] == 1, (kind, volume)
                assert volume["all_gather"]["count"] == 3, (kind, volume)
