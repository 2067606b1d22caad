"""benchmarks/bench_server_http.py at tiny sizes: one JSON line, the server over HTTP gives every
request the tokens the in-process engine gives, in every round."""

from __future__ import annotations

import pytest

from tests.benchmarks.tiny_run import tiny_run

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")


@pytest.mark.timeout(240)
def test_tiny_run_streams_the_in_process_tokens() -> None:
    out = tiny_run("bench_server_http.py", 220)
    assert out["benchmark"] == "server_http" and out["rounds"] == 2
    assert out["tokens_equal"] == 6  # the minimum over both rounds
    for mode in ("in_process", "http"):
        figures = out["results"][mode]
        assert figures["tokens"] == out["results"]["in_process"]["tokens"], mode
        assert len(figures["throughput_rounds"]) == 2, mode
        assert figures["ttft_ms_p50"] <= figures["ttft_ms_p99"], mode
    assert len(out["http_vs_in_process_rounds"]) == 2
