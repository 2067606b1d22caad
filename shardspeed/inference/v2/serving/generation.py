"""One request's life between the HTTP layer and the generation engine: prompt tokens and
limits checked, sampling parameters built, tokens streamed back as text pieces.

The engine is anything shaped like :class:`~shardspeed.inference.v2.scheduler.AsyncGenerationEngine`
(:class:`GenerationBackend`): ``submit(prompt_ids, params)`` returns a handle with a ``uid`` whose
token events (``token``, ``finished``, ``finish_reason``) are read with ``async for``, and
``abort(uid)`` stops a request early (a stop string, a client that went away).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from shardspeed.inference.v2.serving.detokenizer import TextAssembler
from shardspeed.inference.v2.serving.metrics import ServingMetrics
from shardspeed.inference.v2.serving.protocol import APIError, GenerationRequest

__all__ = [
    "Choices",
    "GenerationBackend",
    "Piece",
    "ServingContext",
    "merge_pieces",
    "run_request",
    "run_requests",
    "sampling_kwargs",
]


class GenerationBackend(Protocol):
    """What the server needs of the generation engine."""

    def submit(self, prompt_ids: list[int], params: Any) -> Any: ...

    def abort(self, uid: int) -> None: ...


@dataclass
class ServingContext:
    """Everything a request handler needs: the engine, the tokenizer, the served names, the
    context length and the ``SamplingParams`` class the engine takes."""

    backend: GenerationBackend
    tokenizer: Any
    model_name: str
    max_context: int
    params_factory: Callable[..., Any]
    aliases: frozenset[str] = field(default_factory=frozenset)
    api_key: str | None = None
    metrics: ServingMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = ServingMetrics(self.model_name)

    def check_model(self, name: str) -> None:
        """404 unless ``name`` is the served model's name (or the path it was loaded from)."""
        if name != self.model_name and name not in self.aliases:
            raise APIError(
                f"model {name!r} does not exist: this server serves {self.model_name!r}",
                param="model",
                status=404,
                code="model_not_found",
            )


@dataclass
class Piece:
    """A piece of generated text; ``finish_reason`` is set on the last one. ``tokens``: the
    engine's events of the tokens read since the previous piece (their log-probabilities when
    the request asked for them)."""

    text: str
    finish_reason: str | None
    completion_tokens: int
    tokens: list[Any] = field(default_factory=list)


def sampling_kwargs(
    request: GenerationRequest,
    limit: int | None,
    prompt_len: int,
    max_context: int,
    field: str,
) -> dict[str, Any]:
    """``SamplingParams`` keyword arguments for ``request``; ``limit`` is its ``max_tokens``
    (None: the rest of the context). ``field`` names the prompt's field in errors."""
    room = max_context - prompt_len
    if room < 1:
        raise APIError(
            f"{field} is {prompt_len} tokens; the model's context is {max_context} tokens, "
            "which leaves no room to generate: shorten it",
            param=field,
        )
    if limit is None:
        limit = room
    elif limit > room:
        name = "max_tokens"
        raise APIError(
            f"{name}={limit} plus the prompt's {prompt_len} tokens exceeds the model's context "
            f"of {max_context} tokens: ask for at most {room}",
            param=name,
        )
    greedy = request.temperature == 0.0
    return {
        "max_new_tokens": limit,
        "min_new_tokens": min(request.min_tokens, limit),
        "temperature": 1.0 if greedy else request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "do_sample": not greedy,
        "seed": request.seed,
        "ignore_eos": request.ignore_eos,
        "logit_bias": request.token_bias(),
        "repetition_penalty": request.repetition_penalty,
        "frequency_penalty": request.frequency_penalty,
        "presence_penalty": request.presence_penalty,
    }


def _abort(backend: GenerationBackend, uid: int) -> None:
    try:
        backend.abort(uid)
    except (KeyError, ValueError):
        pass  # the request finished between its last event and the abort


def run_request(
    context: ServingContext, prompt_ids: list[int], params: Any, stops: list[str]
) -> AsyncIterator[Piece]:
    """Submit one request now (so a refusal is an error before any response starts) and
    return the async iterator of its text pieces."""
    return run_requests(context, [(prompt_ids, params)], stops).streams[0]


@dataclass
class Choices:
    """The submitted choices of one response: their text-piece streams, in order, and
    :meth:`abort_unfinished`, which stops every choice still generating whatever its stream's
    state (an async generator never started never runs its own cleanup)."""

    context: ServingContext
    handles: list[Any]
    streams: list[AsyncIterator[Piece]]

    def abort_unfinished(self) -> None:
        """Abort every choice whose request has not ended."""
        for handle in self.handles:
            if not getattr(handle, "done", False):
                _abort(self.context.backend, handle.uid)
            self.context.metrics.ended(handle.uid, "abort")  # unless counted already


def run_requests(
    context: ServingContext, jobs: list[tuple[list[int], Any]], stops: list[str]
) -> Choices:
    """Submit every (prompt ids, params) job now; their streams of text pieces in order. When
    the engine refuses one (or fails), those already submitted are aborted and the refusal is
    the error: a response has all its choices or none."""
    handles: list[Any] = []
    try:
        for prompt_ids, params in jobs:
            handles.append(context.backend.submit(prompt_ids, params))
    except Exception as exc:
        for handle in handles:
            _abort(context.backend, handle.uid)
        if isinstance(exc, ValueError):  # the scheduler refuses a request that can never run
            field = "logit_bias" if str(exc).startswith("logit_bias") else "max_tokens"
            raise APIError(str(exc), param=field) from exc
        raise
    for handle, (prompt_ids, _) in zip(handles, jobs, strict=True):
        context.metrics.submitted(handle.uid, len(prompt_ids))
    return Choices(context, handles, [_pieces(context, handle, stops) for handle in handles])


async def merge_pieces(streams: list[AsyncIterator[Piece]]) -> AsyncIterator[tuple[int, Piece]]:
    """(index, piece) of every stream as each piece comes, whichever stream it is from. Leaving
    early (or an error in one) closes every stream, which aborts their requests."""
    if len(streams) == 1:
        async for piece in streams[0]:
            yield 0, piece
        return
    queue: asyncio.Queue[tuple[int, Piece | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[Piece]) -> None:
        try:
            async for piece in stream:
                queue.put_nowait((index, piece))
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            queue.put_nowait((index, exc))
        finally:
            queue.put_nowait((index, None))

    tasks = [asyncio.ensure_future(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()  # a stream cancelled mid-read closes, aborting its request
        await asyncio.gather(*tasks, return_exceptions=True)


async def _pieces(context: ServingContext, handle: Any, stops: list[str]) -> AsyncIterator[Piece]:
    """Yield one request's text as it is generated (its tokens and latencies counted in the
    metrics). Leaving early (the consumer closes this generator: client gone) aborts the
    request in the engine."""
    text = TextAssembler(context.tokenizer, stops)
    metrics = context.metrics
    count = 0
    done = False
    reason = "abort"  # unless it ends otherwise
    ended_at = 0.0  # when the engine made its last token (0: unknown, now)
    read: list[Any] = []  # token events since the last piece
    try:
        async for event in handle:
            stamp = float(getattr(event, "emitted_at", 0.0))
            metrics.token(handle.uid, stamp)
            count += 1
            read.append(event)
            last = bool(event.finished)
            out, stopped = text.add(int(event.token), last)
            if stopped:
                reason = "stop"
                yield Piece(out, "stop", count, read)
                return  # ``done`` stays False: the engine is still generating it
            if last:
                done = True
                reason, ended_at = event.finish_reason or "stop", stamp
                yield Piece(out, reason, count, read)
                return
            if out:
                yield Piece(out, None, count, read)
                read = []
        done = True  # the handle ended without a finished event (aborted elsewhere)
        yield Piece("", "abort", count, read)
    finally:
        metrics.ended(handle.uid, reason, ended_at)
        if not done:
            _abort(context.backend, handle.uid)
