"""OpenAI's HTTP protocol for ``/v1/completions`` and ``/v1/chat/completions``: request models
(pydantic, strict types) and the response/chunk/error bodies the official client parses.

Requests keep OpenAI's field names and defaults (``max_tokens`` 16 for completions, unbounded
for chat; ``temperature`` 1.0, i.e. sampling unless 0). Fields OpenAI defines that this server
does not implement are refused by name when set to a non-default value, so a client never gets
silently different behaviour. ``top_k``, ``min_tokens``, ``ignore_eos`` and
``repetition_penalty`` are extensions (as vLLM's), passed through the client's ``extra_body``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

__all__ = [
    "APIError",
    "Choice",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "GenerationRequest",
    "StreamOptions",
    "chat_chunk",
    "chat_logprobs",
    "chat_response",
    "completion_chunk",
    "completion_logprobs",
    "completion_response",
    "error_body",
    "new_id",
    "usage",
]


class APIError(Exception):
    """A request error reported to the client as OpenAI's error object with ``status``."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        status: int = 400,
        kind: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.kind = kind
        self.code = code


def error_body(message: str, kind: str, param: str | None, code: str | None) -> dict[str, Any]:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class _Strict(BaseModel):
    # strict: a JSON string where a number belongs is an error, not a coercion; unknown fields
    # are ignored as OpenAI's own API does for fields a model does not use
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    """``stream_options``: ``include_usage`` adds a last chunk carrying the usage counts."""

    include_usage: bool = False


class GenerationRequest(_Strict):
    """The sampling fields both endpoints share."""

    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # int64, as OpenAI's
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    user: str | None = None
    # extensions (vLLM's names)
    top_k: int = Field(0, ge=0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    repetition_penalty: float = Field(1.0, gt=0.0, allow_inf_nan=False)

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"logit_bias keys are token ids (digit strings), got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values lie in -100..100, got {bias} for {key}")
        return value

    @field_validator("response_format")
    @classmethod
    def _plain_text(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        # ignoring a JSON request would hand back free text the client then fails to parse
        kind = (value or {}).get("type", "text")
        if kind != "text":
            raise ValueError(
                f"response_format type {kind!r} is not supported (this server has no guided "
                'decoding): leave it unset or use {"type": "text"}'
            )
        return value

    def token_bias(self) -> dict[int, float]:
        """``logit_bias`` keyed by token id."""
        return {int(key): float(bias) for key, bias in (self.logit_bias or {}).items()}

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes at most 4 non-empty strings")
        return value

    def stop_strings(self) -> list[str]:
        """``stop`` as a list."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(GenerationRequest):
    """``POST /v1/completions``: a prompt (text, or token ids) or a list of them; ``n``
    choices for each, prompt ``i``'s choices at indices ``i * n .. i * n + n - 1``."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompts(
        cls, value: str | list[int] | list[str] | list[list[int]]
    ) -> str | list[int] | list[str] | list[list[int]]:
        if isinstance(value, list) and not value:
            raise ValueError("prompt is empty")
        if isinstance(value, list) and any(isinstance(p, list) and not p for p in value):
            raise ValueError("a prompt of token ids is empty")
        return value

    def prompt_list(self) -> list[str | list[int]]:
        """``prompt`` as a list of prompts, each a string or a list of token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt[0], int):
            return [[int(t) for t in prompt]]  # type: ignore[union-attr]
        return list(prompt)  # type: ignore[arg-type]

    @field_validator("suffix")
    @classmethod
    def _unset(cls, value: Any, info: ValidationInfo) -> Any:
        if value:
            raise ValueError(f"{info.field_name} is not supported: leave it unset")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError(f"best_of={value} is not supported: leave it unset")
        return value


class ContentPart(_Strict):
    """One part of a message's content; only text parts are accepted."""

    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    """One chat message; ``content`` is a string or a list of text parts."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The message's content as one string."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(GenerationRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    functions: list[dict[str, Any]] | None = None  # tools' older name
    tool_choice: str | dict[str, Any] | None = None
    function_call: str | dict[str, Any] | None = None  # tool_choice's older name

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return value

    @field_validator("tools", "functions")
    @classmethod
    def _unset(cls, value: Any, info: ValidationInfo) -> Any:
        if value:
            raise ValueError(f"{info.field_name} is not supported: leave it unset")
        return value

    @field_validator("tool_choice", "function_call")
    @classmethod
    def _no_call(cls, value: Any, info: ValidationInfo) -> Any:
        # "none" and "auto" mean no call without tools; a forced call cannot be honoured
        if value not in (None, "none", "auto"):
            raise ValueError(
                f"{info.field_name}={value!r} asks for a tool call, which is not supported: "
                'leave it unset or use "none"'
            )
        return value

    def logprob_count(self) -> int | None:
        """How many top tokens each generated token reports (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def token_limit(self) -> int | None:
        """``max_completion_tokens`` (the newer name) or ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens else self.max_tokens


def new_id(prefix: str) -> str:
    """A response id in OpenAI's style (``cmpl-...``, ``chatcmpl-...``)."""
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's ``usage`` object."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


# (text, finish reason, logprobs object or None) of one choice
Choice = tuple[str, "str | None", "dict[str, Any] | None"]


def completion_logprobs(
    events: list[Any], token_text: Callable[[int], str], offset: int, echo: bool = False
) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object of ``events`` (token events carrying
    ``logprob`` and ``top_logprobs``), the first token's text at character ``offset``: each
    token's text, log-probability, its top tokens and the chosen one, and text offset. With
    ``echo`` the first event's ``prompt_logprobs`` come first (the first prompt token's
    log-probability and top tokens None, as OpenAI's)."""
    entries: list[tuple[int, float | None, tuple[tuple[int, float], ...]]] = []
    if echo and events and events[0].prompt_logprobs is not None:
        entries += events[0].prompt_logprobs
    entries += [(e.token, e.logprob, e.top_logprobs) for e in events]
    tokens, values, tops, offsets = [], [], [], []
    for token, logprob, top_pairs in entries:
        text = token_text(token)
        tokens.append(text)
        values.append(logprob)
        top: dict[str, float] | None = None
        if logprob is not None:
            top = {token_text(t): v for t, v in top_pairs}
            top.setdefault(text, logprob)  # the chosen token always has its entry
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(events: list[Any], token_text: Callable[[int], str]) -> dict[str, Any]:
    """The chat ``logprobs`` object of ``events``: per token its text, log-probability, UTF-8
    bytes and top tokens."""

    def entry(token: int, logprob: float | None) -> dict[str, Any]:
        text = token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {
                **entry(e.token, e.logprob),
                "top_logprobs": [entry(t, v) for t, v in e.top_logprobs],
            }
            for e in events
        ]
    }


def _body(
    rid: str, kind: str, model: str, choices: list[dict[str, Any]], counts: dict[str, int] | None
) -> dict[str, Any]:
    """The envelope every response and chunk shares."""
    return {
        "id": rid,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": counts,
    }


def completion_response(
    rid: str, model: str, choices: list[Choice], counts: dict[str, int]
) -> dict[str, Any]:
    """A whole ``text_completion`` body; ``choices`` by index."""
    made = [
        {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}
        for i, (text, finish, logprobs) in enumerate(choices)
    ]
    return _body(rid, "text_completion", model, made, counts)


def completion_chunk(
    rid: str,
    model: str,
    index: int,
    text: str | None,
    finish: str | None,
    counts: dict[str, int] | None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One streamed ``text_completion`` chunk of choice ``index``; ``text=None`` is the
    usage-only last chunk."""
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
    return _body(rid, "text_completion", model, [] if text is None else [choice], counts)


def chat_response(
    rid: str, model: str, choices: list[Choice], counts: dict[str, int]
) -> dict[str, Any]:
    """A whole ``chat.completion`` body; ``choices`` by index."""
    made = [
        {
            "index": i,
            "message": {"role": "assistant", "content": text},
            "logprobs": logprobs,
            "finish_reason": finish,
        }
        for i, (text, finish, logprobs) in enumerate(choices)
    ]
    return _body(rid, "chat.completion", model, made, counts)


def chat_chunk(
    rid: str,
    model: str,
    index: int,
    delta: dict[str, str] | None,
    finish: str | None,
    counts: dict[str, int] | None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One streamed ``chat.completion.chunk`` of choice ``index``; ``delta=None`` is the
    usage-only last chunk."""
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    return _body(rid, "chat.completion.chunk", model, [] if delta is None else [choice], counts)
