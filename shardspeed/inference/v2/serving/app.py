"""The Starlette application: OpenAI's ``/v1/completions`` and ``/v1/chat/completions`` (whole
responses or server-sent events with ``stream``), ``/v1/models``, ``/health`` and Prometheus's
``/metrics``; with an API key, the ``/v1`` routes ask for it.

Every error a client can cause is a 4xx JSON body in OpenAI's shape naming the field at fault;
the server keeps serving after it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from shardspeed.inference.v2.serving.auth import APIKeyAuth
from shardspeed.inference.v2.serving.generation import (
    Choices,
    Piece,
    ServingContext,
    merge_pieces,
    run_requests,
    sampling_kwargs,
)
from shardspeed.inference.v2.serving.metrics import CONTENT_TYPE
from shardspeed.inference.v2.serving.protocol import (
    APIError,
    ChatCompletionRequest,
    Choice,
    CompletionRequest,
    GenerationRequest,
    chat_chunk,
    chat_logprobs,
    chat_response,
    completion_chunk,
    completion_logprobs,
    completion_response,
    error_body,
    new_id,
    usage,
)
from shardspeed.utils.logging import logger

__all__ = ["build_app"]


def _error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(error_body(exc.message, exc.kind, exc.param, exc.code), exc.status)


def _from_validation(exc: ValidationError) -> APIError:
    """The first pydantic error as an APIError naming its field (``messages.0.role``)."""
    first = exc.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        return APIError(f"the request body is not valid JSON: {first['msg']}")
    loc = [str(part) for part in first["loc"]]
    where = ".".join(loc) if loc else "request body"
    message = first["msg"].removeprefix("Value error, ")
    return APIError(f"{where}: {message}", param=loc[0] if loc else None)


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    body = await request.body()
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise _from_validation(exc) from exc


def _sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n"


async def _collect(pieces: AsyncIterator[Piece]) -> tuple[str, str | None, int, list[Any]]:
    """One choice's whole text, finish reason, completion tokens and token events."""
    parts: list[str] = []
    events: list[Any] = []
    finish: str | None = None
    count = 0
    async for piece in pieces:
        parts.append(piece.text)
        events += piece.tokens
        finish, count = piece.finish_reason or finish, piece.completion_tokens
    return "".join(parts), finish, count, events


async def _collect_all(
    choices: Choices, logprobs: Callable[[list[Any]], dict[str, Any]] | None
) -> tuple[list[Choice], int]:
    """Every choice in order (its logprobs object made by ``logprobs`` when asked) and their
    completion tokens in all. When one fails, or the handler is cancelled, the others are
    cancelled and every unfinished choice is aborted."""
    tasks = [asyncio.ensure_future(_collect(stream)) for stream in choices.streams]
    try:
        results = await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        choices.abort_unfinished()
    made: list[Choice] = [
        (text, finish, logprobs(events) if logprobs else None)
        for text, finish, _, events in results
    ]
    return made, sum(r[2] for r in results)


# chunk(index, piece or None for the usage-only chunk, usage): one streamed chunk
_Chunk = Callable[[int, "Piece | None", "dict[str, int] | None"], dict[str, Any]]


class _ChoicesResponse(StreamingResponse):
    """Server-sent events that abort every unfinished choice once the response ends, however
    it ends (done, client gone before or while streaming, send failed)."""

    def __init__(self, content: AsyncIterator[str], choices: Choices) -> None:
        super().__init__(content, media_type="text/event-stream")
        self._choices = choices

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._choices.abort_unfinished()


def _stream(
    choices: Choices,
    chunk: _Chunk,
    prompt_tokens: int,
    include_usage: bool,
    first: list[dict[str, Any]] | None = None,
) -> StreamingResponse:
    """Server-sent events: one chunk per text piece of any choice, each choice's finish reason
    on its last, a usage chunk when asked, then ``[DONE]``. An engine failure mid-stream
    becomes an error event."""

    async def events() -> AsyncIterator[str]:
        counts = [0] * len(choices.streams)
        for event in first or []:
            yield _sse(event)
        try:
            async for index, piece in merge_pieces(choices.streams):
                counts[index] = piece.completion_tokens
                if piece.text or piece.finish_reason:
                    yield _sse(chunk(index, piece, None))
        except Exception as exc:  # noqa: BLE001 - reported to the client, then logged
            logger.exception("serving: generation failed")
            yield _sse(error_body(str(exc), "server_error", None, None))
            return
        if include_usage:
            yield _sse(chunk(0, None, usage(prompt_tokens, sum(counts))))
        yield _sse("[DONE]")

    return _ChoicesResponse(events(), choices)


def _prompt_ids(context: ServingContext, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, list):
        vocab = len(context.tokenizer)
        bad = [t for t in prompt if not 0 <= int(t) < vocab]
        if bad:
            raise APIError(
                f"prompt: token ids {bad[:4]} are outside the vocabulary", param="prompt"
            )
        return [int(t) for t in prompt]
    ids = list(context.tokenizer(str(prompt))["input_ids"])
    if not ids:
        raise APIError("prompt: the prompt has no tokens", param="prompt")
    return ids


# most choices (prompts x n) one request may ask for
MAX_CHOICES = 1024


def _jobs(
    context: ServingContext,
    body: GenerationRequest,
    prompts: list[list[int]],
    limit: int | None,
    field: str,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
) -> list[tuple[list[int], Any]]:
    """(prompt ids, sampling params) of every choice: ``body.n`` per prompt, prompt by prompt.
    With a seed, choice ``j`` of a prompt samples with seed + j (as vLLM), so the ``n``
    choices differ and each repeats."""
    if len(prompts) * body.n > MAX_CHOICES:
        raise APIError(
            f"{len(prompts)} prompts x n={body.n} is {len(prompts) * body.n} choices, over the "
            f"{MAX_CHOICES} one request may ask for: send fewer prompts or a smaller n",
            param="n",
        )
    vocab = len(context.tokenizer)
    outside = [t for t in body.token_bias() if t >= vocab]
    if outside:
        raise APIError(
            f"logit_bias: token ids {outside[:4]} are outside the vocabulary of {vocab} tokens",
            param="logit_bias",
        )
    jobs = []
    for ids in prompts:
        kwargs = sampling_kwargs(body, limit, len(ids), context.max_context, field)
        kwargs.update(logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        for j in range(body.n):
            seed = None if body.seed is None else body.seed + j
            jobs.append((ids, context.params_factory(**{**kwargs, "seed": seed})))
    return jobs


def _decode(context: ServingContext, ids: list[int]) -> str:
    """The text of a prompt given as token ids (what ``echo`` returns for it)."""
    return str(context.tokenizer.decode(ids))


def _token_text(context: ServingContext) -> Callable[[int], str]:
    """A token's own text, as its logprobs entries show it."""

    def text(token: int) -> str:
        return str(context.tokenizer.decode([token]))

    return text


def _chat_ids(context: ServingContext, request: ChatCompletionRequest) -> list[int]:
    tokenizer = context.tokenizer
    if getattr(tokenizer, "chat_template", None) is None:
        raise APIError(
            "this model's tokenizer has no chat template: use /v1/completions instead",
            param="messages",
        )
    messages = [{"role": m.role, "content": m.text()} for m in request.messages]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - a template may reject a conversation (roles)
        raise APIError(
            f"messages: the chat template refused them: {exc}", param="messages"
        ) from exc
    # the template writes the special tokens (BOS) itself
    return list(tokenizer(str(text), add_special_tokens=False)["input_ids"])


def build_app(context: ServingContext) -> Starlette:
    """The ASGI application serving ``context``'s engine."""

    async def completions(request: Request) -> Response:
        body: CompletionRequest = await _parse(request, CompletionRequest)
        context.check_model(body.model)
        given = body.prompt_list()
        prompts = [_prompt_ids(context, prompt) for prompt in given]
        # echo: each choice starts with its prompt (and, with logprobs, the prompt's)
        echoes = (
            [p if isinstance(p, str) else _decode(context, p) for p in given] if body.echo else []
        )
        scored = body.logprobs if body.echo else None
        jobs = _jobs(context, body, prompts, body.max_tokens, "prompt", body.logprobs, scored)
        choices = run_requests(context, jobs, body.stop_strings())
        rid = new_id("cmpl")
        # each prompt is counted once, whatever n (as OpenAI's usage)
        prompt_tokens = sum(len(ids) for ids in prompts)
        token_text = _token_text(context)
        wants_logprobs = body.logprobs is not None

        def echoed(index: int) -> str:
            return echoes[index // body.n] if body.echo else ""

        if body.stream:
            include = bool(body.stream_options and body.stream_options.include_usage)
            offsets = [0] * len(jobs)  # each choice's token text so far, for text_offset
            started = [False] * len(jobs)

            def chunk(index: int, piece: Piece | None, counts: Any) -> dict[str, Any]:
                if piece is None:
                    return completion_chunk(rid, body.model, 0, None, None, counts)
                first, started[index] = not started[index], True
                text = (echoed(index) if first else "") + piece.text
                logprobs = None
                if wants_logprobs:
                    logprobs = completion_logprobs(
                        piece.tokens, token_text, offsets[index], echo=body.echo and first
                    )
                    offsets[index] += sum(len(t) for t in logprobs["tokens"])
                return completion_chunk(
                    rid, body.model, index, text, piece.finish_reason, None, logprobs
                )

            return _stream(choices, chunk, prompt_tokens, include)

        whole = partial(completion_logprobs, token_text=token_text, offset=0, echo=body.echo)
        made, count = await _collect_all(choices, whole if wants_logprobs else None)
        if body.echo:
            made = [(echoed(i) + text, f, lp) for i, (text, f, lp) in enumerate(made)]
        return JSONResponse(completion_response(rid, body.model, made, usage(prompt_tokens, count)))

    async def chat(request: Request) -> Response:
        body: ChatCompletionRequest = await _parse(request, ChatCompletionRequest)
        context.check_model(body.model)
        ids = _chat_ids(context, body)
        logprob_count = body.logprob_count()
        jobs = _jobs(context, body, [ids], body.token_limit(), "messages", logprob_count)
        choices = run_requests(context, jobs, body.stop_strings())
        rid = new_id("chatcmpl")
        token_text = _token_text(context)
        wants = None if logprob_count is None else partial(chat_logprobs, token_text=token_text)
        if body.stream:
            include = bool(body.stream_options and body.stream_options.include_usage)

            def chunk(index: int, piece: Piece | None, counts: Any) -> dict[str, Any]:
                if piece is None:
                    return chat_chunk(rid, body.model, 0, None, None, counts)
                delta = {"content": piece.text} if piece.text else {}
                found = wants(piece.tokens) if wants else None
                return chat_chunk(rid, body.model, index, delta, piece.finish_reason, None, found)

            opening = {"role": "assistant", "content": ""}
            first = [chat_chunk(rid, body.model, i, opening, None, None) for i in range(body.n)]
            return _stream(choices, chunk, len(ids), include, first)
        made, count = await _collect_all(choices, wants)
        return JSONResponse(chat_response(rid, body.model, made, usage(len(ids), count)))

    async def models(request: Request) -> Response:
        card = {
            "id": context.model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "shardspeed",
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def health(request: Request) -> Response:
        if not getattr(context.backend, "running", True):  # the generation loop has stopped
            body = {"status": "error", "model": context.model_name}
            return JSONResponse(body, status_code=503)
        return JSONResponse({"status": "ok", "model": context.model_name})

    async def metrics(request: Request) -> Response:
        return Response(context.metrics.render(context.backend), media_type=CONTENT_TYPE)

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return _error_response(exc)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(error_body(message, kind, None, None), exc.status_code)

    async def server_error(request: Request, exc: Exception) -> Response:
        logger.error("serving: %s failed: %r", request.url.path, exc)
        return JSONResponse(error_body(str(exc), "server_error", None, None), 500)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
    ]
    handlers: dict[Any, Any] = {
        APIError: api_error,
        HTTPException: http_error,
        Exception: server_error,
    }
    middleware = []
    if context.api_key is not None:
        middleware.append(Middleware(APIKeyAuth, key=context.api_key))
    return Starlette(routes=routes, exception_handlers=handlers, middleware=middleware)
