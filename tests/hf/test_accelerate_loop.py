"""An Accelerate training loop with ``DeepSpeedPlugin`` on shardspeed, 2 ranks on CPU (torchrun).

``scripts/accelerate_loop.py`` runs the same loop (``accelerator.accumulate`` over 2
micro-batches, clipping, AdamW) plainly (DDP) and with the plugin at ZeRO 2 and 3, then
``save_state`` and ``load_state`` into a fresh model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.hf.conftest import launch_cmd, rank_env, run_launched

RTOL, ATOL = 1e-5, 1e-6


@pytest.mark.timeout(180)
def test_accelerate_deepspeed_plugin_matches_plain_loop(compat_site: Path, tmp_path: Path) -> None:
    run_launched(
        launch_cmd("torchrun", "accelerate_loop.py", str(tmp_path)),
        rank_env(compat_site),
        timeout=150,
    )
    results = json.loads((tmp_path / "accelerate.json").read_text())
    plain = results["plain"]
    assert plain["distributed_type"] == "DistributedType.MULTI_CPU"
    # 32 samples, 2 ranks, micro-batch 2, 2 micro-batches per step
    assert len(plain["micro_losses"]) == 8 and plain["optimizer_steps"] == 4
    worst = 0.0
    for case in ("z2", "z3"):
        result = results[case]
        assert result["distributed_type"] == "DistributedType.DEEPSPEED"
        assert result["engine"] == "DeepSpeedEngine"
        assert result["optimizer_steps"] == plain["optimizer_steps"]
        assert result["micro_losses"] == pytest.approx(plain["micro_losses"], rel=RTOL, abs=ATOL)
        assert result["score"] == pytest.approx(plain["score"], rel=RTOL)
        worst = max(
            worst,
            *(
                abs(a - b)
                for a, b in zip(result["micro_losses"], plain["micro_losses"], strict=True)
            ),
        )
    for case in ("plain", "z2", "z3"):
        # save_state / load_state round trip (DeepSpeed: the engine's checkpoint) bit for bit
        assert results[case]["loaded_state_score"] == results[case]["score"], case
    for held in results["z3"]["loaded_bytes"]:
        assert 0 < held["held"] <= held["full"] // 2 + 64 * 4 * 32
    print(f"accelerate loop: largest |loss - plain loss| over 8 micro-batches: {worst:.3g}")
