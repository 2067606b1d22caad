"""``AsyncGenerationEngine``: the scheduler loop in one background thread, fed by any number of
threads or asyncio tasks.

Callers ``submit`` a prompt and get a :class:`RequestHandle` at once; the loop thread alone
touches the scheduler and the engine (commands reach it through a queue under one lock), steps
while there is work and sleeps on a condition when there is none. A handle's tokens can be read
synchronously (``tokens()``, ``result()``) or with ``async for``; an exception in the loop ends
every unfinished handle with an :class:`EngineLoopError` (its cause the original exception), so
no consumer waits forever.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, Literal

import torch

from shardspeed.inference.v2.scheduler.requests import TokenEvent
from shardspeed.inference.v2.scheduler.sampling import SamplingParams
from shardspeed.inference.v2.scheduler.scheduler import RaggedScheduler

__all__ = ["AsyncGenerationEngine", "EngineLoopError", "RequestHandle"]

HandleFinish = Literal["stop", "length", "abort"]


class EngineLoopError(RuntimeError):
    """The generation loop stopped (an exception in it, or a shutdown) before this request
    finished; ``__cause__`` holds the loop's exception where there was one."""


def _wake_future(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class RequestHandle:
    """One submitted request: its ``uid`` and the token events the loop delivers to it."""

    def __init__(self, uid: int, owner: AsyncGenerationEngine) -> None:
        self.uid = uid
        self._owner = owner
        self._cond = threading.Condition()
        self._events: list[TokenEvent] = []
        self._finish: HandleFinish | None = None
        self._error: BaseException | None = None
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    # ------------------------------------------------------------------ state (loop thread)
    def _update(
        self, event: TokenEvent | None = None, finish: HandleFinish | None = None,
        error: BaseException | None = None,
    ) -> None:  # fmt: skip
        """Record a token, a finish or an error and wake every waiter."""
        with self._cond:
            if self.done:
                return
            if event is not None:
                self._events.append(event)
                if event.finished:
                    finish = event.finish_reason
            self._finish = finish
            self._error = error
            waiters, self._waiters = self._waiters, []
            self._cond.notify_all()
        for loop, future in waiters:
            try:
                loop.call_soon_threadsafe(_wake_future, future)
            except RuntimeError:
                pass  # the consumer's event loop is closed: nobody waits any more

    # ------------------------------------------------------------------ consumers
    @property
    def done(self) -> bool:
        """Finished, aborted or failed."""
        return self._finish is not None or self._error is not None

    @property
    def finish_reason(self) -> HandleFinish | None:
        """ "stop", "length" or "abort" once the request ended normally."""
        return self._finish

    def abort(self) -> None:
        """Ask the loop to drop this request (the handle then ends with "abort")."""
        self._owner.abort(self.uid)

    def _get(self, index: int, timeout: float | None) -> TokenEvent | None:
        """Event ``index``, waiting for it; None once the request ended before it."""
        with self._cond:
            if not self._cond.wait_for(lambda: index < len(self._events) or self.done, timeout):
                raise TimeoutError(
                    f"request {self.uid}: no token within {timeout} s; raise the timeout or "
                    "check that the engine is running."
                )
            if index < len(self._events):
                return self._events[index]
            if self._error is not None:
                raise self._error
            return None

    def events(self, timeout: float | None = None) -> Iterator[TokenEvent]:
        """The request's token events as they come (``timeout``: most seconds to wait for each;
        TimeoutError past it)."""
        index = 0
        while (event := self._get(index, timeout)) is not None:
            index += 1
            yield event

    def tokens(self, timeout: float | None = None) -> Iterator[int]:
        """The request's tokens as they come."""
        for event in self.events(timeout):
            yield event.token

    def result(self, timeout: float | None = None) -> list[int]:
        """All of the request's tokens, once it ended (an aborted request's tokens so far)."""
        return list(self.tokens(timeout))

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        return self._aiter()

    async def _aiter(self) -> AsyncIterator[TokenEvent]:
        loop = asyncio.get_running_loop()
        index = 0
        while True:
            with self._cond:
                ready = index < len(self._events) or self.done
                if not ready:
                    future: asyncio.Future[None] = loop.create_future()
                    self._waiters.append((loop, future))
            if not ready:
                await future
                continue
            event = self._get(index, 0)
            if event is None:
                return
            index += 1
            yield event

    async def aresult(self) -> list[int]:
        """``result()`` for asyncio code."""
        return [event.token async for event in self]


class AsyncGenerationEngine:
    """Runs a :class:`RaggedScheduler` over ``engine`` (an ``InferenceEngineV2``, or a scheduler
    already built) in one background thread. ``token_budget``/``eos_token_ids`` go to the
    scheduler it builds. Use as a context manager or call ``shutdown``."""

    def __init__(
        self,
        engine: Any,
        token_budget: int | None = None,
        eos_token_ids: int | Sequence[int] | None = None,
    ) -> None:
        if isinstance(engine, RaggedScheduler):
            if token_budget is not None or eos_token_ids is not None:
                raise ValueError(
                    "token_budget/eos_token_ids configure a scheduler built here; pass them to "
                    "the RaggedScheduler given instead."
                )
            self.scheduler = engine
        else:
            self.scheduler = RaggedScheduler(
                engine, token_budget=token_budget, eos_token_ids=eos_token_ids
            )
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._inbox: list[tuple[str, int, Any]] = []
        self._handles: dict[int, RequestHandle] = {}
        self._next_uid = 0
        self._stopping = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._loop, name="shardspeed-v2-generation", daemon=True
        )
        self._thread.start()

    def __enter__(self) -> AsyncGenerationEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    def running(self) -> bool:
        """Whether the loop thread is alive and accepting requests."""
        return self._thread.is_alive() and not self._stopping and self._error is None

    def submit(
        self,
        prompt_ids: Sequence[int] | torch.Tensor,
        params: SamplingParams | None = None,
        uid: int | None = None,
    ) -> RequestHandle:
        """Queue a request and return its handle at once; ValueError here (not in the loop) for
        a request that can never run, RuntimeError once the engine stopped."""
        params = SamplingParams() if params is None else params
        if isinstance(prompt_ids, torch.Tensor):
            prompt = [int(t) for t in prompt_ids.reshape(-1).tolist()]
        else:
            prompt = [int(t) for t in prompt_ids]
        self.scheduler.check_request(prompt, params)
        with self._lock:
            self._check_running()
            if uid is None:
                while self._next_uid in self._handles:
                    self._next_uid += 1
                uid = self._next_uid
                self._next_uid += 1
            elif uid in self._handles:
                raise ValueError(f"uid {uid} is in use by an unfinished request; pick another.")
            handle = RequestHandle(uid, self)
            self._handles[uid] = handle
            self._inbox.append(("add", uid, (prompt, params)))
            self._wake.notify()
        return handle

    def abort(self, uid: int) -> None:
        """Drop request ``uid`` (no effect once it ended); its handle ends with "abort"."""
        with self._lock:
            self._inbox.append(("abort", uid, None))
            self._wake.notify()

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the loop and join its thread; requests not finished end with EngineLoopError."""
        with self._lock:
            self._stopping = True
            self._wake.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise RuntimeError(f"the generation thread did not stop within {timeout} s.")

    def _check_running(self) -> None:
        if self._error is not None:
            raise EngineLoopError(
                f"the generation loop failed ({self._error!r}); build a new engine."
            ) from self._error
        if self._stopping:
            raise RuntimeError("the generation engine is shut down; build a new one.")

    # ------------------------------------------------------------------ the loop thread
    def _loop(self) -> None:
        failure: BaseException | None = None
        try:
            while True:
                with self._lock:
                    while not (self._inbox or self._stopping or self.scheduler.has_work):
                        self._wake.wait()
                    if self._stopping:
                        break
                    commands, self._inbox = self._inbox, []
                for kind, uid, payload in commands:
                    self._apply(kind, uid, payload)
                if self.scheduler.has_work:
                    for event in self.scheduler.step():
                        self._deliver(event)
        except BaseException as exc:  # noqa: BLE001 - every consumer must hear of it
            failure = exc
        self._close(failure)

    def _apply(self, kind: str, uid: int, payload: Any) -> None:
        """Carry out one command from a caller."""
        if kind == "add":
            prompt, params = payload
            try:
                self.scheduler.add_request(prompt, params, uid=uid)
            except ValueError as exc:
                self._end(uid, error=exc)
        else:
            self.scheduler.abort(uid)
            self._end(uid, finish="abort")

    def _deliver(self, event: TokenEvent) -> None:
        with self._lock:
            handle = self._handles.get(event.uid)
            if event.finished:
                self._handles.pop(event.uid, None)
        if handle is not None:
            handle._update(event)

    def _end(
        self, uid: int, finish: HandleFinish | None = None, error: BaseException | None = None
    ) -> None:
        with self._lock:
            handle = self._handles.pop(uid, None)
        if handle is not None:
            handle._update(finish=finish, error=error)

    def _close(self, failure: BaseException | None) -> None:
        """End every unfinished handle and free the engine's blocks of unfinished requests."""
        with self._lock:
            self._error = failure
            self._stopping = True
            handles, self._handles = self._handles, {}
            self._inbox = []
        if failure is None:
            error = EngineLoopError("the generation engine was shut down before this finished.")
        else:
            error = EngineLoopError(f"the generation loop failed: {failure!r}")
            error.__cause__ = failure
        for uid, handle in handles.items():
            if failure is None:
                self.scheduler.abort(uid)
            handle._update(error=error)
