"""benchmarks/bench_serving.py at tiny sizes: one JSON line, every mode gives Hugging Face's greedy
tokens for every request in every round, and each mode's figures are its median round."""

from __future__ import annotations

import pytest

from tests.benchmarks.tiny_run import tiny_run


@pytest.mark.timeout(240)
def test_tiny_run_serves_hf_greedy_tokens_in_every_round() -> None:
    out = tiny_run("bench_serving.py", 220)
    assert out["rounds"] == 2 and out["workload"]["requests"] == 6
    results = out["results"]
    assert set(results) == {"shardspeed_v2", "hf_static", "shardspeed_v1_fused"}
    for mode, figures in results.items():
        assert figures["greedy_equal_hf"] == 6, mode  # the minimum over both rounds
        rounds = figures["throughput_rounds"]
        assert len(rounds) == 2 and figures["throughput_tok_s"] == min(rounds), mode
        assert len(figures["vs_hf_rounds"]) == 2, mode
        assert figures["ttft_ms_p50"] <= figures["ttft_ms_p99"], mode
    assert results["hf_static"]["vs_hf_rounds"] == [1.0, 1.0]
    # v2 without graphs: every step one eager forward; 6 requests need at least a step each
    v2 = results["shardspeed_v2"]
    assert v2["eager_forwards"] == v2["steps"] >= 6 and v2["graph_replays"] == 0
