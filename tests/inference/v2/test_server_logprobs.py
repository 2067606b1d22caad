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


@pytest.mark.timeout(120)
def test_bad_logprobs_are_400s(server: str) -> None:
    chat = {"model": NAME, "messages": [{"role": "user", "content": "w1"}], "max_tokens": 2}
    comp = {"model": NAME, "prompt": "w1 w2", "max_tokens": 2}
    cases = [
        ("chat/completions", {**chat, "top_logprobs": 2}, "top_logprobs", "logprobs: true"),
        ("chat/completions", {**chat, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "20"),
        ("completions", {**comp, "logprobs": 21}, "logprobs", "20"),
        ("completions", {**comp, "echo": True}, "echo", "not supported"),
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
