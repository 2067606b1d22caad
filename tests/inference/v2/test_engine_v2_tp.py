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
