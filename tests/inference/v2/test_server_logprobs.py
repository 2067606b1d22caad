"""Log-probabilities from ``shardspeed serve`` (the package's server process, the official
``openai`` client): legacy completions' ``logprobs`` and chat's ``logprobs``/``top_logprobs``
equal the log-softmax of Hugging Face's own logits, whole and streamed, with OpenAI's shapes;
bad values are 400s naming the field."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from tests.inference.v2.serve_model import SERVED_NAME as NAME  # noqa: E402
from tests.inference.v2.serve_model import Reference  # noqa: E402


def _expected(reference: Reference, ids: list[int], new: int) -> tuple[list[int], torch.Tensor]:
    """HF's greedy tokens after ``ids`` and the log-softmax at each of their positions."""
    tokens = reference.generate_ids(ids, new)
    with torch.no_grad():
        logits = reference.model(torch.tensor([ids + tokens])).logits[0].float()
    return tokens, logits[len(ids) - 1 : len(ids) - 1 + len(tokens)].log_softmax(dim=-1)


def _word(reference: Reference, token: int) -> str:
    return str(reference.tokenizer.decode([token]))


@pytest.mark.timeout(300)
def test_completion_logprobs_equal_hf(client: Any, reference: Reference) -> None:
    prompt = "w5 w9 w13 w7"
    ids = reference.prompt_ids(prompt)
    tokens, want = _expected(reference, ids, 7)
    out = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=7, temperature=0, logprobs=2
    )
    lp = out.choices[0].logprobs
    assert lp.tokens == [_word(reference, t) for t in tokens]
    for step, token in enumerate(tokens):
        assert lp.token_logprobs[step] == pytest.approx(float(want[step, token]), abs=1e-4)
        top_values, top_ids = want[step].topk(2)
        top = lp.top_logprobs[step]
        assert set(top) == {_word(reference, int(t)) for t in top_ids}  # greedy: sampled is top-1
        for t, v in zip(top_ids.tolist(), top_values.tolist(), strict=True):
            assert top[_word(reference, t)] == pytest.approx(v, abs=1e-4)
    lengths = [len(t) for t in lp.tokens]
    assert lp.text_offset == [sum(lengths[:i]) for i in range(len(lengths))]
    # streamed: the chunks' logprobs put together are the whole response's
    chunks = [
        c
        for c in client.completions.create(
            model=NAME, prompt=prompt, max_tokens=7, temperature=0, logprobs=2, stream=True
        )
        if c.choices
    ]
    assert len(chunks) > 2
    joined: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for c in chunks:
        for key in joined:
            joined[key] += getattr(c.choices[0].logprobs, key)
    assert joined == {k: getattr(lp, k) for k in joined}
    # without logprobs there are none
    plain = client.completions.create(model=NAME, prompt=prompt, max_tokens=3, temperature=0)
    assert plain.choices[0].logprobs is None


@pytest.mark.timeout(300)
def test_chat_logprobs_equal_hf(client: Any, reference: Reference) -> None:
    messages = [{"role": "user", "content": "w4 w5 w6"}]
    ids = reference.chat_ids(messages)
    tokens, want = _expected(reference, ids, 6)
    out = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = out.choices[0].logprobs.content
    assert [e.token for e in content] == [_word(reference, t) for t in tokens]
    for step, entry in enumerate(content):
        assert entry.logprob == pytest.approx(float(want[step, tokens[step]]), abs=1e-4)
        assert entry.bytes == list(entry.token.encode("utf-8"))
        top_values, top_ids = want[step].topk(3)
        assert [e.token for e in entry.top_logprobs] == [_word(reference, int(t)) for t in top_ids]
        for e, v in zip(entry.top_logprobs, top_values.tolist(), strict=True):
            assert e.logprob == pytest.approx(v, abs=1e-4)
    # logprobs without top_logprobs: each token's own, no alternatives
    bare = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=6, temperature=0, logprobs=True
    )
    assert [e.top_logprobs for e in bare.choices[0].logprobs.content] == [[]] * len(tokens)
    streamed = [
        e.token
        for c in client.chat.completions.create(
            model=NAME, messages=messages, max_tokens=6, temperature=0, logprobs=True, stream=True
        )
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert streamed == [e.token for e in content]


@pytest.mark.timeout(300)
def test_echo_with_prompt_logprobs_equal_hf(client: Any, reference: Reference) -> None:
    """What lm-eval's loglikelihood asks of an OpenAI-compatible server: the prompt as token
    ids, echo, logprobs=1, one new token; every prompt token after the first gets HF's
    log-probability given the ones before it."""
    ids = reference.prompt_ids("w5 w9 w13 w7 w2 w2 w40")
    with torch.no_grad():
        want = reference.model(torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)
    [generated] = reference.generate_ids(ids, 1)
    out = client.completions.create(
        model=NAME, prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True
    )
    choice = out.choices[0]
    prompt_text = reference.tokenizer.decode(ids)
    assert choice.text == prompt_text + reference.tokenizer.decode([generated])
    lp = choice.logprobs
    assert lp.tokens == [_word(reference, t) for t in [*ids, generated]]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for t in range(1, len(ids)):
        assert lp.token_logprobs[t] == pytest.approx(float(want[t - 1, ids[t]]), abs=1e-4)
        best = int(want[t - 1].argmax())
        top = lp.top_logprobs[t]  # the most likely token, and the prompt's own
        assert set(top) == {_word(reference, best), _word(reference, ids[t])}
        assert top[_word(reference, best)] == pytest.approx(float(want[t - 1, best]), abs=1e-4)
    assert lp.token_logprobs[-1] == pytest.approx(float(want[-1, generated]), abs=1e-4)
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 1
    # streamed: the first chunk carries the prompt and its log-probabilities
    chunks = [
        c
        for c in client.completions.create(
            model=NAME,
            prompt=ids,
            max_tokens=4,
            temperature=0,
            logprobs=1,
            echo=True,
            stream=True,
        )  # fmt: skip
        if c.choices
    ]
    assert chunks[0].choices[0].text.startswith(prompt_text)
    streamed = [t for c in chunks for t in c.choices[0].logprobs.token_logprobs]
    assert streamed[: len(ids)] == lp.token_logprobs[: len(ids)]
    # echo without logprobs: the text only, a string prompt given back as it was
    plain = client.completions.create(
        model=NAME, prompt="w8 w9", max_tokens=3, temperature=0, echo=True
    )
    tail = reference.text(reference.prompt_ids("w8 w9"), 3)
    assert plain.choices[0].text == "w8 w9" + tail and plain.choices[0].logprobs is None


@pytest.mark.timeout(120)
def test_bad_logprobs_are_400s(server: str) -> None:
    chat = {"model": NAME, "messages": [{"role": "user", "content": "w1"}], "max_tokens": 2}
    comp = {"model": NAME, "prompt": "w1 w2", "max_tokens": 2}
    cases = [
        ("chat/completions", {**chat, "top_logprobs": 2}, "top_logprobs", "logprobs: true"),
        ("chat/completions", {**chat, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "20"),
        ("completions", {**comp, "logprobs": 21}, "logprobs", "20"),
        ("completions", {**comp, "suffix": "w3"}, "suffix", "not supported"),
        (
            "chat/completions",
            {**chat, "response_format": {"type": "json_object"}},
            "response_format",
            "'json_object' is not supported",
        ),
        ("chat/completions", {**chat, "functions": [{"name": "f"}]}, "functions", "supported"),
        ("chat/completions", {**chat, "tool_choice": "required"}, "tool_choice", "tool call"),
        ("chat/completions", {**chat, "function_call": {"name": "f"}}, "function_call", "tool"),
        (
            "completions",
            {**comp, "response_format": {"type": "json_schema", "json_schema": {}}},
            "response_format",
            "'json_schema' is not supported",
        ),
    ]
    for path, body, param, words in cases:
        reply = httpx.post(
            f"{server}/v1/{path}",
            content=json.dumps(body).encode(),
            headers={"content-type": "application/json"},
            timeout=30.0,
        )
        assert reply.status_code == 400, (body, reply.text)
        error = reply.json()["error"]
        assert error["param"] == param and words in error["message"], (body, error)
    # plain text, asked for in so many words, is served
    text = {**chat, "response_format": {"type": "text"}, "tool_choice": "none"}
    reply = httpx.post(f"{server}/v1/chat/completions", json=text, timeout=30.0)
    assert reply.status_code == 200, reply.text
