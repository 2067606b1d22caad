"""``shardspeed serve`` started as a process, driven by the official ``openai`` client: greedy
completions and chat equal Hugging Face ``generate``, streaming equals the whole response,
concurrent requests, stop strings, and malformed requests answered with OpenAI-shaped 4xx
errors while the server keeps serving."""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from tests.inference.v2.serve_model import MAX_POSITIONS, SERVED_NAME, Reference  # noqa: E402

NAME = SERVED_NAME

PROMPTS = ["w1 w2", "w5 w9 w13 w7", "w40", "w3 w3 w3 w3 w3 w3", "w11 w12 w13", "w59 w0 w17"]


@pytest.mark.timeout(300)
def test_completions_greedy_equal_hf_generate(client: Any, reference: Reference) -> None:
    for prompt in PROMPTS[:3]:
        ids = reference.prompt_ids(prompt)
        generated = reference.generate_ids(ids, 10)
        out = client.completions.create(model=NAME, prompt=prompt, max_tokens=10, temperature=0)
        choice = out.choices[0]
        assert choice.text == reference.text(ids, 10)
        assert out.usage.prompt_tokens == len(ids)
        assert out.usage.completion_tokens == len(generated)
        assert out.usage.total_tokens == len(ids) + len(generated)
        assert choice.finish_reason == ("stop" if generated[-1] == 3 else "length")
        assert out.object == "text_completion" and out.model == NAME


@pytest.mark.timeout(300)
def test_completions_prompt_as_token_ids(client: Any, reference: Reference) -> None:
    ids = reference.prompt_ids(PROMPTS[1])
    out = client.completions.create(model=NAME, prompt=ids, max_tokens=6, temperature=0)
    assert out.choices[0].text == reference.text(ids, 6)


@pytest.mark.timeout(300)
def test_chat_greedy_equals_hf_generate(client: Any, reference: Reference) -> None:
    messages = [
        {"role": "system", "content": "w7 w8"},
        {"role": "user", "content": "w4 w5 w6"},
    ]
    ids = reference.chat_ids(messages)
    generated = reference.generate_ids(ids, 12)
    out = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=12, temperature=0
    )
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == reference.text(ids, 12)
    assert out.usage.prompt_tokens == len(ids)
    assert out.usage.completion_tokens == len(generated)
    # the newer limit name is honoured the same way
    again = client.chat.completions.create(
        model=NAME, messages=messages, max_completion_tokens=3, temperature=0
    )
    assert again.choices[0].message.content == reference.text(ids, 3)


@pytest.mark.timeout(300)
def test_streaming_equals_whole_response(client: Any, reference: Reference) -> None:
    prompt = PROMPTS[3]
    whole = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0)
    chunks = list(
        client.completions.create(
            model=NAME, prompt=prompt, max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    pieces = [c.choices[0].text for c in chunks if c.choices]
    assert len(pieces) > 2  # really streamed, not one blob
    assert (
        "".join(pieces) == whole.choices[0].text == reference.text(reference.prompt_ids(prompt), 12)
    )
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and set(finishes[:-1]) == {None}
    assert (
        chunks[-1].choices == []
        and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    )

    messages = [{"role": "user", "content": "w9 w10"}]
    chat_whole = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=10, temperature=0
    )
    stream = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chat_chunks = list(stream)
    assert chat_chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chat_chunks if c.choices)
    assert text == chat_whole.choices[0].message.content
    assert [c for c in chat_chunks if c.choices][-1].choices[0].finish_reason == (
        chat_whole.choices[0].finish_reason
    )
    assert chat_chunks[-1].usage.prompt_tokens == chat_whole.usage.prompt_tokens


@pytest.mark.timeout(300)
def test_eight_concurrent_requests(client: Any, reference: Reference) -> None:
    prompts = [PROMPTS[i % len(PROMPTS)] + f" w{20 + i}" for i in range(8)]
    lengths = [4 + 2 * i for i in range(8)]

    def ask(i: int) -> str:
        if i % 2:
            out = client.completions.create(
                model=NAME, prompt=prompts[i], max_tokens=lengths[i], temperature=0
            )
            return str(out.choices[0].text)
        stream = client.completions.create(
            model=NAME, prompt=prompts[i], max_tokens=lengths[i], temperature=0, stream=True
        )
        return "".join(c.choices[0].text for c in stream if c.choices)

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(ask, range(8)))
    want = [
        reference.text(reference.prompt_ids(p), n) for p, n in zip(prompts, lengths, strict=True)
    ]
    assert got == want


@pytest.mark.timeout(300)
def test_stop_strings(client: Any, reference: Reference) -> None:
    prompt = PROMPTS[2]
    full = reference.text(reference.prompt_ids(prompt), 12)
    words = full.split(" ")
    stop = words[3]  # cut before the 4th word's first occurrence
    want = full[: full.index(stop)]
    out = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=12, temperature=0, stop=[stop, "never-seen"]
    )
    assert out.choices[0].text == want and out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens < 12
    # a stop string spanning two tokens: the first one's text must be held back, not streamed
    across = f"{words[1]} {words[2]}"
    want = full[: full.index(across)]
    stream = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=12, temperature=0, stop=across, stream=True
    )
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.timeout(300)
def test_seeded_sampling_repeats(client: Any) -> None:
    def ask(seed: int) -> str:
        out = client.completions.create(
            model=NAME, prompt="w8 w9", max_tokens=12, temperature=1.5, top_p=0.95, seed=seed,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert out.usage.completion_tokens == 12  # ignore_eos reached the engine
        return str(out.choices[0].text)

    first = ask(7)
    assert ask(7) == first
    assert {ask(seed) for seed in (1, 2, 3)} != {first}  # the seed is used


def _post(server: str, path: str, body: Any, raw: bytes | None = None) -> httpx.Response:
    content = raw if raw is not None else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    return httpx.post(f"{server}/v1/{path}", content=content, headers=headers, timeout=30.0)


@pytest.mark.timeout(300)
def test_malformed_requests_get_openai_errors(server: str, client: Any) -> None:
    chat = {"model": NAME, "messages": [{"role": "user", "content": "w1"}], "max_tokens": 2}
    comp = {"model": NAME, "prompt": "w1 w2", "max_tokens": 2}
    cases: list[tuple[str, Any, bytes | None, int, str | None, str]] = [
        ("chat/completions", None, b"{not json", 400, None, "JSON"),
        ("chat/completions", {"model": NAME}, None, 400, "messages", "messages"),
        ("completions", {"model": NAME, "max_tokens": 2}, None, 400, "prompt", "prompt"),
        ("completions", {**comp, "max_tokens": "2"}, None, 400, "max_tokens", "max_tokens"),
        ("completions", {**comp, "temperature": "hot"}, None, 400, "temperature", "temperature"),
        ("chat/completions", {**chat, "messages": "w1"}, None, 400, "messages", "messages"),
        ("chat/completions", {**chat, "n": 0}, None, 400, "n", "greater than or equal to 1"),
        ("completions", {**comp, "prompt": [[5, 6], []]}, None, 400, "prompt", "empty"),
        ("completions", {**comp, "max_tokens": MAX_POSITIONS}, None, 400, "max_tokens", "context"),
        ("completions", {**comp, "model": "gpt-9"}, None, 404, "model", "gpt-9"),
        ("completions", {**comp, "stop": ["a", "b", "c", "d", "e"]}, None, 400, "stop", "stop"),
    ]
    for path, body, raw, status, param, words in cases:
        reply = _post(server, path, body, raw)
        assert reply.status_code == status, (body, reply.text)
        error = reply.json()["error"]
        assert error["param"] == param, (body, error)
        assert words in error["message"], (body, error)
        assert error["type"] in ("invalid_request_error", "not_found_error")
    # the official client maps them to its exception classes
    with pytest.raises(openai.BadRequestError, match="less than or equal to 128"):
        client.chat.completions.create(model=NAME, messages=chat["messages"], n=129)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="w1")
    # and the server still answers
    assert httpx.get(f"{server}/health", timeout=10.0).json()["status"] == "ok"
    out = client.completions.create(model=NAME, prompt="w1 w2", max_tokens=3, temperature=0)
    assert out.usage.completion_tokens >= 1


@pytest.mark.timeout(120)
def test_models_lists_the_served_name(client: Any) -> None:
    assert [m.id for m in client.models.list().data] == [NAME]


class _Recording:
    """The real generation engine, remembering the handles it gave out."""

    def __init__(self, generator: Any) -> None:
        self.generator = generator
        self.handles: list[Any] = []

    def submit(self, prompt_ids: list[int], params: Any) -> Any:
        handle = self.generator.submit(prompt_ids, params)
        self.handles.append(handle)
        return handle

    def abort(self, uid: int) -> None:
        self.generator.abort(uid)


@pytest.mark.timeout(300)
def test_a_client_leaving_aborts_its_request(model_dir: Path) -> None:
    """What a dropped streaming connection does to the request's generator (closing it) stops
    the request in the engine and frees its KV blocks, long before max_tokens."""
    from shardspeed.inference.v2.serving.generation import ServingContext, run_request
    from shardspeed.inference.v2.serving.server import load_generator

    cache = {"kv_block_size": 8, "memory_config": {"mode": "allocate", "size": 80}}
    loaded = load_generator(str(model_dir), engine_config={"state_manager": cache})
    try:
        backend = _Recording(loaded.generator)
        context = ServingContext(
            backend, loaded.tokenizer, NAME, loaded.max_context, loaded.params_factory
        )
        params = loaded.params_factory(max_new_tokens=400, ignore_eos=True)

        async def read_one_piece_then_leave() -> None:
            pieces = run_request(context, [5, 6], params, [])
            await pieces.__anext__()
            await pieces.aclose()  # type: ignore[attr-defined]

        asyncio.run(read_one_piece_then_leave())
        # the metrics count it once, as aborted, and keep nothing of it
        assert context.metrics.finished["abort"] == 1 and not context.metrics._open
        [handle] = backend.handles
        tokens = handle.result(timeout=60)
        assert handle.finish_reason == "abort" and len(tokens) < 400
        engine = loaded.engine
        deadline = time.monotonic() + 30
        while engine.free_blocks != engine.total_blocks and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.free_blocks == engine.total_blocks
    finally:
        loaded.shutdown()
