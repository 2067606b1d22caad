"""Logit bias and penalties through the server and the official ``openai`` client: OpenAI's
``logit_bias``, ``frequency_penalty`` and ``presence_penalty`` and vLLM's
``repetition_penalty`` give Hugging Face ``generate``'s greedy tokens with the same settings, and
out-of-range values get a 400 naming the field."""

from __future__ import annotations

from typing import Any

import pytest
from transformers.generation.logits_process import LogitsProcessorList

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from tests.inference.v2.hf_models import OpenAIPenalties  # noqa: E402
from tests.inference.v2.serve_model import SERVED_NAME, Reference  # noqa: E402

NAME = SERVED_NAME
PROMPT = "w11 w12 w13"  # greedy repeats w18 a lot


def _ids(out: Any, reference: Reference) -> list[int]:
    """A completion's token ids (the word-level tokenizer maps words back one to one)."""
    return list(reference.tokenizer(out.choices[0].text, add_special_tokens=False)["input_ids"])


@pytest.mark.timeout(300)
def test_logit_bias_and_penalties_equal_hf_generate(client: Any, reference: Reference) -> None:
    ids = reference.prompt_ids(PROMPT)
    plain = reference.generate_ids(ids, 12)
    word = reference.tokenizer.convert_tokens_to_ids("w20")
    cases: list[tuple[dict[str, Any], dict[str, Any]]] = [
        # a +100 bias makes greedy pick that token every time
        ({"logit_bias": {str(word): 100}}, {"sequence_bias": {(word,): 100.0}}),
        ({"logit_bias": {str(plain[0]): -100}}, {"sequence_bias": {(plain[0],): -100.0}}),
        (
            {"frequency_penalty": 1.5, "presence_penalty": 0.5},
            {"logits_processor": LogitsProcessorList([OpenAIPenalties(len(ids), 1.5, 0.5)])},
        ),
        ({"extra_body": {"repetition_penalty": 1.8}}, {"repetition_penalty": 1.8}),
    ]
    for ours, theirs in cases:
        expected = reference.generate_ids(ids, 12, **theirs)
        assert expected != plain, ours  # the setting changes this prompt's greedy tokens
        out = client.completions.create(
            model=NAME, prompt=PROMPT, max_tokens=12, temperature=0, **ours
        )
        text = str(reference.tokenizer.decode(expected, skip_special_tokens=True))
        assert out.choices[0].text == text, ours
    out = client.completions.create(
        model=NAME, prompt=PROMPT, max_tokens=5, temperature=0, logit_bias={str(word): 100}
    )
    assert _ids(out, reference) == [word] * 5
    # chat takes them too
    messages = [{"role": "user", "content": "w4 w4 w4"}]
    chat_ids = reference.chat_ids(messages)
    expected = reference.generate_ids(chat_ids, 8, repetition_penalty=1.8)
    out = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=8, temperature=0,
        extra_body={"repetition_penalty": 1.8},
    )  # fmt: skip
    assert out.choices[0].message.content == reference.tokenizer.decode(
        expected, skip_special_tokens=True
    )


@pytest.mark.timeout(300)
def test_out_of_range_bias_and_penalties_get_400(server: str) -> None:
    base = {"model": NAME, "prompt": "w1 w2", "max_tokens": 2}
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"logit_bias": {"w5": 1}}, "logit_bias", "token ids"),
        ({"logit_bias": {"5": 101}}, "logit_bias", "-100..100"),
        ({"logit_bias": {"999999": 1}}, "logit_bias", "outside the vocabulary"),
        ({"presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
        ({"frequency_penalty": -2.5}, "frequency_penalty", "greater than or equal to -2"),
        ({"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
    ]
    for extra, param, words in cases:
        reply = httpx.post(f"{server}/v1/completions", json={**base, **extra}, timeout=30.0)
        assert reply.status_code == 400, (extra, reply.text)
        error = reply.json()["error"]
        assert error["param"] == param and words in error["message"], (extra, error)
    assert httpx.get(f"{server}/health", timeout=10.0).json()["status"] == "ok"
