"""InferenceEngineV2 with AutoTP on 2 real gloo ranks equals tp 1."""

from __future__ import annotations

import pytest

from tests.inference.v2 import tp_ranks

FAMILIES = ["llama", "qwen2", "mixtral", "gpt2"]


@pytest.mark.timeout(300)
def test_tp2_matches_tp1(dist_pool):
    results = dist_pool(2).run(tp_ranks.tp_parity, FAMILIES)
    for per_rank in results:
        for family in FAMILIES:
            figures = per_rank[family]
            assert figures["max_err"] < 1e-4, (family, figures)
            assert figures["tokens_equal"], (family, figures)
            # each rank's cache holds its half of the kv heads (GQA: 2 of 4 or 1 of 2)
            assert figures["cache_kv_heads"] * 2 == figures["model_kv_heads"], figures


@pytest.mark.timeout(300)
def test_lockstep_serving_keeps_every_rank_in_step(dist_pool):
    """Serving with tp 2: rank 0's engine calls reach the follower in order (with heartbeats
    while idle and a refused call on both), and both ranks end in the same engine state."""
    first, second = dist_pool(2).run(tp_ranks.lockstep_serving, 0.2)
    assert "KV" in first["refused"] or "max_context" in first["refused"], first
    assert second["calls"] == 9  # 5 puts, flush, refused put, put, clear
    assert first["heartbeats"] >= 3  # ~6 while idle 1.2 s at 0.2 s
    assert first["reads"] and "_state" in first["blocked"]  # reads pass, the rest do not
    for key in ("free_blocks", "tracked", "seen"):
        assert first[key] == second[key], key
    assert first["tracked"] == [True, False] and first["seen"] == 9 + 4 + 1


@pytest.mark.timeout(300)
def test_tp2_serialize_loads_back_each_ranks_shard(dist_pool, tmp_path):
    """``serialize`` on 2 ranks writes DeepSpeed's per-rank file names; each rank's
    ``build_engine_from_ds_checkpoint`` gives bitwise the logits the engine gave before, and
    loading at another tp size names the saved one."""
    families = ["llama", "gpt2", "llama:bfloat16"]
    results = dist_pool(2).run(tp_ranks.serialize_round_trip, str(tmp_path), families)
    for per_rank in results:
        for family in families:
            figures = per_rank[family]
            assert figures["equal"], (family, figures)
            assert {
                "config.json",
                "params_rank_0_of_2.pt",
                "params_rank_1_of_2.pt",
                "metadata_rank_0_of_2.json",
                "metadata_rank_1_of_2.json",
            } <= set(figures["files"]), figures
            assert "tp_size=2" in figures["refused"], figures
            # each shard comes back in the dtype it was saved in
            assert figures["dtype"] == ("torch.bfloat16" if "bf" in family else "torch.float32")
