"""The server's operations side: ``/metrics`` read by Prometheus's own parser counts each
request's tokens, finish reason and latencies exactly, and ``--api-key`` (or
``SHARDSPEED_API_KEY``) guards the ``/v1`` routes while ``/health`` and ``/metrics`` stay open."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from shardspeed.inference.v2.serving.metrics import Histogram  # noqa: E402
from tests.inference.v2.serve_model import (  # noqa: E402
    SERVED_NAME,
    Reference,
    start_server,
    stop_server,
)

NAME = SERVED_NAME


def _scrape(server: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``/metrics`` by (name, labels other than model_name), parsed by
    Prometheus's client library."""
    parser = pytest.importorskip("prometheus_client.parser")
    reply = httpx.get(f"{server}/metrics", timeout=10.0)
    assert reply.status_code == 200
    assert reply.headers["content-type"].startswith("text/plain; version=0.0.4")
    out = {}
    for family in parser.text_string_to_metric_families(reply.text):
        for sample in family.samples:
            assert sample.labels.pop("model_name") == NAME
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def _delta(before: dict[Any, float], after: dict[Any, float], name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after[key] - before.get(key, 0.0)


@pytest.mark.timeout(300)
def test_metrics_count_tokens_reasons_and_latencies(server: str, client: Any) -> None:
    before = _scrape(server)
    prompt = [5, 9, 13, 7, 21, 30, 4]
    out = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == 5
    after = _scrape(server)
    m = "shardspeed:"
    assert _delta(before, after, m + "prompt_tokens_total") == 7
    assert (m + "prefix_cache_hits_total", ()) in after
    assert _delta(before, after, m + "generation_tokens_total") == 5
    assert _delta(before, after, m + "request_success_total", finished_reason="length") == 1
    assert _delta(before, after, m + "request_success_total", finished_reason="stop") == 0
    assert _delta(before, after, m + "time_to_first_token_seconds_count") == 1
    assert _delta(before, after, m + "inter_token_latency_seconds_count") == 4
    assert _delta(before, after, m + "e2e_request_latency_seconds_count") == 1
    e2e = _delta(before, after, m + "e2e_request_latency_seconds_sum")
    ttft = _delta(before, after, m + "time_to_first_token_seconds_sum")
    itl = _delta(before, after, m + "inter_token_latency_seconds_sum")
    assert 0 < ttft <= e2e and itl <= e2e
    assert (
        after[(m + "e2e_request_latency_seconds_bucket", (("le", "+Inf"),))]
        == after[(m + "e2e_request_latency_seconds_count", ())]
    )
    assert after[(m + "num_requests_running", ())] == 0
    assert after[(m + "num_requests_waiting", ())] == 0
    assert 0.0 <= after[(m + "kv_cache_usage_perc", ())] <= 1.0
    # a stop string ends a streamed request as "stop"
    stream = client.completions.create(
        model=NAME, prompt="w1 w2", max_tokens=30, temperature=0, stream=True,
        stop=["w"],  # every word starts with it: the first token's text stops it
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in stream) == ""
    again = _scrape(server)
    assert _delta(after, again, m + "request_success_total", finished_reason="stop") == 1
    assert _delta(after, again, m + "e2e_request_latency_seconds_count") == 1


def test_histogram_buckets_are_upper_bounds_inclusive() -> None:
    histogram = Histogram((0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 1.0, 3.0):
        histogram.observe(value)
    lines = histogram.lines("h", 'model_name="m"')
    assert lines[:3] == [
        'h_bucket{model_name="m",le="0.1"} 2',
        'h_bucket{model_name="m",le="1.0"} 4',
        'h_bucket{model_name="m",le="+Inf"} 5',
    ]
    assert lines[3:] == ['h_sum{model_name="m"} 4.65', 'h_count{model_name="m"} 5']


@pytest.mark.timeout(300)
def test_api_key_guards_the_v1_routes(model_dir: Path, reference: Reference) -> None:
    proc, url = start_server(model_dir, env_extra={"SHARDSPEED_API_KEY": "sekrit-1"})
    try:
        good = openai.OpenAI(base_url=f"{url}/v1", api_key="sekrit-1", max_retries=0)
        ids = reference.prompt_ids("w1 w2")
        out = good.completions.create(model=NAME, prompt="w1 w2", max_tokens=4, temperature=0)
        assert out.choices[0].text == reference.text(ids, 4)
        bad = openai.OpenAI(base_url=f"{url}/v1", api_key="sekrit-2", max_retries=0)
        with pytest.raises(openai.AuthenticationError, match="API key"):
            bad.completions.create(model=NAME, prompt="w1 w2", max_tokens=4)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        bare = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": NAME, "messages": [{"role": "user", "content": "w1"}]},
            timeout=10.0,
        )
        assert bare.status_code == 401
        assert bare.json()["error"]["code"] == "invalid_api_key"
        # probes and scrapers need no key
        assert httpx.get(f"{url}/health", timeout=10.0).status_code == 200
        assert httpx.get(f"{url}/metrics", timeout=10.0).status_code == 200
    finally:
        stop_server(proc)


def test_the_key_is_asked_everywhere_but_health_and_metrics(model_dir: Path) -> None:
    """Deny by default, under a root path too; an empty key refuses to start."""
    from starlette.testclient import TestClient

    from shardspeed.inference.v2.serving.app import build_app
    from shardspeed.inference.v2.serving.cli import main
    from shardspeed.inference.v2.serving.generation import ServingContext
    from shardspeed.inference.v2.serving.server import load_generator

    cache = {"memory_config": {"mode": "allocate", "size": 16}}
    loaded = load_generator(str(model_dir), engine_config={"state_manager": cache})
    try:
        context = ServingContext(
            loaded.generator, loaded.tokenizer, NAME, loaded.max_context,
            loaded.params_factory, api_key="k3y",
        )  # fmt: skip
        for root in ("", "/api"):
            http = TestClient(build_app(context), root_path=root)
            assert http.get(f"{root}/health").status_code == 200
            assert http.get(f"{root}/metrics").status_code == 200
            for path in ("/v1/models", "/nowhere", "/health/../v1/models"):
                assert http.get(f"{root}{path}").status_code == 401, (root, path)
            keyed = {"Authorization": "Bearer k3y"}
            assert http.get(f"{root}/v1/models", headers=keyed).status_code == 200
            assert http.get(f"{root}/nowhere", headers=keyed).status_code == 404
    finally:
        loaded.shutdown()
    with pytest.raises(ValueError, match="API key is empty"):
        main(["--model", str(model_dir), "--api-key", " "])


@pytest.mark.timeout(300)
def test_serve_a_serialized_engine_with_its_tokenizer(
    model_dir: Path, reference: Reference, tmp_path: Path
) -> None:
    """``shardspeed serve --model <folder serialize() wrote> --tokenizer <HF folder>`` answers
    with Hugging Face's greedy tokens; without ``--tokenizer`` it stops at once, naming it."""
    from shardspeed.inference.v2 import build_hf_engine

    folder = tmp_path / "serialized"
    build_hf_engine(str(model_dir)).serialize(folder)
    with pytest.raises(AssertionError, match="pass --tokenizer"):
        start_server(folder)
    proc, url = start_server(folder, "--tokenizer", str(model_dir))
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        ids = reference.prompt_ids("w5 w9 w13")
        out = client.completions.create(model=NAME, prompt="w5 w9 w13", max_tokens=8, temperature=0)
        assert out.choices[0].text == reference.text(ids, 8)
    finally:
        stop_server(proc)
