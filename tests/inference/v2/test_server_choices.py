"""Several choices in one response from ``shardspeed serve`` (the package's server process,
the official ``openai`` client): a list of prompts, ``n`` choices per prompt, both together,
whole and streamed; seeded choices repeat and differ from each other; a refused prompt in a
list refuses the whole request and leaves none of its choices running."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from tests.inference.v2.serve_model import SERVED_NAME as NAME  # noqa: E402
from tests.inference.v2.serve_model import Reference  # noqa: E402

PROMPTS = ["w1 w2", "w5 w9 w13 w7", "w40 w41 w2"]


class _Recording:
    """The real generation engine, remembering the handles it gave out."""

    running = True

    def __init__(self, generator: Any) -> None:
        self.generator = generator
        self.handles: list[Any] = []

    def submit(self, prompt_ids: list[int], params: Any) -> Any:
        self.handles.append(self.generator.submit(prompt_ids, params))
        return self.handles[-1]

    def abort(self, uid: int) -> None:
        self.generator.abort(uid)


def _all_aborted(handles: list[Any], max_tokens: int) -> None:
    """Every request of ``handles`` ended by an abort, long before ``max_tokens``."""
    for handle in handles:
        tokens = handle.result(timeout=60)
        assert handle.finish_reason == "abort" and len(tokens) < max_tokens


def _streamed(chunks: list[Any]) -> tuple[dict[int, str], dict[int, list[Any]]]:
    """Each choice's text and its finish reasons, chunk by chunk, by index."""
    texts: dict[int, str] = defaultdict(str)
    finishes: dict[int, list[Any]] = defaultdict(list)
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            finishes[choice.index].append(choice.finish_reason)
    return dict(texts), dict(finishes)


@pytest.mark.timeout(300)
def test_prompt_list_times_n_greedy(client: Any, reference: Reference) -> None:
    ids = [reference.prompt_ids(p) for p in PROMPTS]
    want = [reference.text(i, 8) for i in ids]
    counts = [len(reference.generate_ids(i, 8)) for i in ids]
    out = client.completions.create(model=NAME, prompt=PROMPTS, n=2, max_tokens=8, temperature=0)
    # prompt i's choices at indices 2i and 2i + 1, greedy: both equal its HF generate
    assert [c.index for c in out.choices] == list(range(6))
    assert [c.text for c in out.choices] == [w for w in want for _ in range(2)]
    assert out.usage.prompt_tokens == sum(len(i) for i in ids)  # each prompt counted once
    assert out.usage.completion_tokens == 2 * sum(counts)
    # prompts given as lists of token ids
    as_ids = client.completions.create(model=NAME, prompt=ids, max_tokens=8, temperature=0)
    assert [c.text for c in as_ids.choices] == want

    stream = client.completions.create(
        model=NAME, prompt=PROMPTS, n=2, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    texts, finishes = _streamed(chunks)
    assert texts == {c.index: c.text for c in out.choices}
    for c in out.choices:  # every choice ends once, with the whole response's reason
        assert finishes[c.index][-1] == c.finish_reason
        assert set(finishes[c.index][:-1]) <= {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2 * sum(counts)


@pytest.mark.timeout(300)
def test_n_seeded_choices_repeat_and_differ(client: Any) -> None:
    messages = [{"role": "user", "content": "w4 w5"}]

    def chat(n: int, seed: int, stream: bool = False) -> list[str]:
        kwargs: dict[str, Any] = {
            "model": NAME, "messages": messages, "n": n, "max_tokens": 10,
            "temperature": 1.5, "seed": seed, "extra_body": {"ignore_eos": True},
        }  # fmt: skip
        if not stream:
            out = client.chat.completions.create(**kwargs)
            assert out.usage.completion_tokens == 10 * n
            return [c.message.content for c in sorted(out.choices, key=lambda c: c.index)]
        texts: dict[int, str] = defaultdict(str)
        roles: dict[int, str] = {}
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
                if c.delta.role:
                    roles[c.index] = c.delta.role
        assert roles == {i: "assistant" for i in range(n)}  # every choice opens with its role
        return [texts[i] for i in range(n)]

    three = chat(3, seed=11)
    assert len(set(three)) == 3  # the choices sample with different seeds
    assert chat(3, seed=11) == three  # and repeat
    assert chat(3, seed=11, stream=True) == three
    # choice j samples as a single request seeded seed + j
    assert [chat(1, seed=11 + j)[0] for j in range(3)] == three


@pytest.mark.timeout(300)
def test_a_refused_prompt_leaves_no_choice_running(model_dir: Path) -> None:
    from shardspeed.inference.v2.serving.generation import ServingContext, run_requests
    from shardspeed.inference.v2.serving.protocol import APIError
    from shardspeed.inference.v2.serving.server import load_generator

    cache = {"kv_block_size": 8, "memory_config": {"mode": "allocate", "size": 16}}
    loaded = load_generator(str(model_dir), engine_config={"state_manager": cache})
    try:
        backend = _Recording(loaded.generator)
        submitted = backend.handles
        context = ServingContext(
            backend, loaded.tokenizer, NAME, loaded.max_context, loaded.params_factory
        )
        fits = loaded.params_factory(max_new_tokens=100, ignore_eos=True)
        # 16 blocks of 8 tokens hold 128: the third prompt can never fit
        jobs = [([5, 6], fits), ([7, 8], fits), (list(range(4, 140)), fits)]
        with pytest.raises(APIError, match="KV blocks"):
            run_requests(context, jobs, [])
        assert len(submitted) == 2
        _all_aborted(submitted, 100)
        assert context.metrics.prompt_tokens == 0  # a refused request counts for nothing

        async def two_streams_then_leave() -> None:
            from shardspeed.inference.v2.serving.generation import merge_pieces

            streams = run_requests(context, jobs[:2], []).streams
            merged = merge_pieces(streams)
            await merged.__anext__()
            await merged.aclose()  # type: ignore[attr-defined]

        submitted.clear()
        asyncio.run(two_streams_then_leave())
        assert len(submitted) == 2
        _all_aborted(submitted, 100)  # leaving the merged stream aborts every choice
        assert context.metrics.finished["abort"] == 2 and not context.metrics._open
    finally:
        loaded.shutdown()


@pytest.mark.timeout(300)
def test_a_stream_whose_client_is_gone_aborts_every_choice(model_dir: Path) -> None:
    """The ASGI app driven directly: a streamed chat request with n=3 whose client disconnects
    right after sending it; every choice is aborted long before max_tokens, whichever point the
    response had reached."""
    import json

    from shardspeed.inference.v2.serving.app import build_app
    from shardspeed.inference.v2.serving.generation import ServingContext
    from shardspeed.inference.v2.serving.server import load_generator

    loaded = load_generator(
        str(model_dir),
        engine_config={"state_manager": {"memory_config": {"mode": "allocate", "size": 256}}},
    )
    try:
        backend = _Recording(loaded.generator)
        context = ServingContext(
            backend, loaded.tokenizer, NAME, loaded.max_context, loaded.params_factory
        )
        app = build_app(context)
        body = json.dumps({
            "model": NAME, "messages": [{"role": "user", "content": "w1"}], "n": 3,
            "max_tokens": 400, "stream": True, "ignore_eos": True,
        }).encode()  # fmt: skip
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
            "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
            "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2),
        }  # fmt: skip
        messages = iter([{"type": "http.request", "body": body, "more_body": False}])

        async def receive() -> dict[str, Any]:
            message = next(messages, None)
            if message is None:
                await asyncio.sleep(0.05)
                return {"type": "http.disconnect"}
            return message

        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)
            if message["type"] == "http.response.body":
                raise OSError("the client is gone")

        async def call() -> None:
            try:
                await app(scope, receive, send)
            except OSError:
                pass

        asyncio.run(call())
        assert len(backend.handles) == 3 and sent[0]["status"] == 200
        _all_aborted(backend.handles, 400)
        # each choice counted once, as aborted, whether its stream had started or not
        assert context.metrics.finished["abort"] == 3 and not context.metrics._open
    finally:
        loaded.shutdown()


@pytest.mark.timeout(120)
def test_too_many_choices_and_a_seed_past_int64_are_400s(client: Any) -> None:
    with pytest.raises(openai.BadRequestError, match="choices") as caught:
        client.completions.create(model=NAME, prompt=["w1"] * 9, n=128, max_tokens=1)
    assert caught.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError, match="seed"):
        client.completions.create(model=NAME, prompt="w1", max_tokens=1, seed=2**63)


def test_health_is_503_once_the_generation_loop_stopped(model_dir: Path) -> None:
    from starlette.testclient import TestClient

    from shardspeed.inference.v2.serving.app import build_app
    from shardspeed.inference.v2.serving.generation import ServingContext
    from shardspeed.inference.v2.serving.server import load_generator

    cache = {"memory_config": {"mode": "allocate", "size": 16}}
    loaded = load_generator(str(model_dir), engine_config={"state_manager": cache})
    context = ServingContext(
        loaded.generator, loaded.tokenizer, NAME, loaded.max_context, loaded.params_factory
    )
    with TestClient(build_app(context)) as http:
        assert http.get("/health").status_code == 200
        loaded.shutdown()  # the loop thread ends
        reply = http.get("/health")
        assert reply.status_code == 503 and reply.json()["status"] == "error"
