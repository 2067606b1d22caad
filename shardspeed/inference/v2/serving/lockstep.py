"""Serving a tensor-parallel engine: every rank makes the same ``put``/``flush`` calls.

With AutoTP each rank holds a shard of the model and of the KV cache, and every forward pass is
a collective. Rank 0 runs the HTTP server and the scheduler over a :class:`LockstepEngine`:
each call that changes the engine (``put``/``put_scored``, ``flush``, ``clear_prefix_cache``)
is first broadcast to the other ranks, which run :func:`follow` (the same call on their own
engine, in the same order) until rank 0 broadcasts the stop. Reads (``query``,
``free_blocks``, ...) need no message: every rank's block tables change only through those
calls, so they are the same on every rank. While idle, rank 0 broadcasts a no-op every
``heartbeat_s`` seconds, so a follower's wait never runs into the process group's timeout.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from shardspeed import comm
from shardspeed.utils.logging import logger

__all__ = ["LockstepEngine", "follow"]

_PUT, _FLUSH, _CLEAR = "put_scored", "flush", "clear_prefix_cache"
_NOOP, _STOP = "noop", "stop"
# InferenceEngineV2's attributes that only read its state (the same on every rank)
_READS = frozenset({
    "free_blocks", "total_blocks", "kv_block_size", "max_context", "config", "model",
    "cached_blocks", "evicted_blocks", "n_tracked_sequences", "prefix_index_size", "tracked",
    "seen_tokens", "prefix_match", "get_remaining_block_capacity", "query", "can_schedule",
    "computed_tokens", "prefix_hit_tokens", "vocab_size",
})  # fmt: skip
HEARTBEAT_S = 60.0
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _broadcast(command: tuple[Any, ...] | None, device: torch.device | None) -> tuple[Any, ...]:
    """Rank 0's ``command``, on every rank (``device``: the engine's, for NCCL: the thread that
    sends may not have it current)."""
    box = [command]
    comm.broadcast_object_list(box, src=0, device=device)
    assert box[0] is not None
    return box[0]


def _comm_device(engine: Any) -> torch.device | None:
    """The device a broadcast for ``engine`` goes through: its GPU, None on CPU (gloo)."""
    device = torch.device(getattr(getattr(engine, "model", None), "device", "cpu"))
    return device if device.type == "cuda" else None


class LockstepEngine:
    """Rank 0's view of a tensor-parallel ``InferenceEngineV2``: its changing calls reach every
    rank first; everything else is read from the local engine."""

    def __init__(self, engine: Any, heartbeat_s: float = HEARTBEAT_S) -> None:
        if comm.get_rank() != 0:
            raise RuntimeError("LockstepEngine runs on rank 0; the other ranks run follow().")
        self.engine = engine
        self._device = _comm_device(engine)
        # one broadcast + call at a time, whichever thread (generation loop, heartbeat) makes it
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self.heartbeats = 0
        self._stopped = threading.Event()
        self._heartbeat = threading.Thread(
            target=self._beat, args=(heartbeat_s,), name="shardspeed-tp-heartbeat", daemon=True
        )
        self._heartbeat.start()

    def __getattr__(self, name: str) -> Any:
        # only what reads the engine: a call that changed it here alone would put the ranks
        # out of step, so a new changing method must be broadcast above before it is reached
        if name not in _READS:
            raise AttributeError(
                f"LockstepEngine has no {name!r}: only the engine's reads "
                f"({', '.join(sorted(_READS))}) and its broadcast calls (put, put_scored, flush, "
                "clear_prefix_cache) reach the tensor-parallel engine"
            )
        return getattr(self.engine, name)

    def _send(self, command: tuple[Any, ...]) -> None:
        if self._stopped.is_set():
            raise RuntimeError("the tensor-parallel engine was stopped")
        _broadcast(command, self._device)
        self._last = time.monotonic()

    def _run(self, command: tuple[Any, ...], call: Any) -> Any:
        """Broadcast ``command``, then make ``call()`` here. A ValueError is the engine's own
        check, raised on every rank alike; anything else (out of memory mid-forward, a lost
        peer) may have left the ranks out of step, so the job is ended at once: the launcher
        then stops every rank, instead of the followers waiting for a collective that never
        comes."""
        with self._lock:
            self._send(command)
            try:
                return call()
            except ValueError:
                raise
            except BaseException:
                logger.critical(
                    "serving rank 0: %s failed outside the engine's checks; the ranks may be "
                    "out of step, ending the tensor-parallel job",
                    command[0],
                    exc_info=True,
                )
                os._exit(1)

    def put(
        self,
        batch_uids: Iterable[int],
        batch_tokens: Iterable[torch.Tensor | Sequence[int]],
        do_checks: bool = True,
    ) -> torch.Tensor:
        """``engine.put`` on every rank (the logits are gathered on each)."""
        return self.put_scored(batch_uids, batch_tokens, (), do_checks)[0]

    def put_scored(
        self,
        batch_uids: Iterable[int],
        batch_tokens: Iterable[torch.Tensor | Sequence[int]],
        scored_uids: Iterable[int],
        do_checks: bool = True,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """``engine.put_scored`` on every rank (what ``put`` is, with nothing scored)."""
        uids = [int(u) for u in batch_uids]
        tokens = [torch.as_tensor(t).cpu() for t in batch_tokens]
        scored = [int(u) for u in scored_uids]
        return self._run(  # type: ignore[no-any-return]
            (_PUT, uids, tokens, scored, do_checks),
            lambda: self.engine.put_scored(uids, tokens, scored, do_checks=do_checks),
        )

    def flush(self, uid: int) -> None:
        """``engine.flush`` on every rank."""
        self._run((_FLUSH, int(uid)), lambda: self.engine.flush(uid))

    def clear_prefix_cache(self) -> int:
        """``engine.clear_prefix_cache`` on every rank."""
        return int(self._run((_CLEAR,), self.engine.clear_prefix_cache))

    def _beat(self, every: float) -> None:
        while not self._stopped.wait(min(every, 5.0)):
            if time.monotonic() - self._last < every:
                continue
            with self._lock:
                if not self._stopped.is_set():
                    self._send((_NOOP,))
                    self.heartbeats += 1

    def stop(self, timeout: float = 30.0) -> None:
        """Release the other ranks from :func:`follow` (once). When a call still holds the
        engine after ``timeout`` seconds (a stuck generation thread) the followers are left to
        the launcher, which stops the whole job once this rank exits."""
        if not self._lock.acquire(timeout=timeout):
            logger.error("serving rank 0: the engine stayed busy; not releasing the other ranks")
            self._stopped.set()
            return
        try:
            if self._stopped.is_set():
                return
            _broadcast((_STOP,), self._device)
            self._stopped.set()
        finally:
            self._lock.release()
        self._heartbeat.join(timeout=10)


def follow(engine: Any) -> int:
    """On a rank other than 0: make rank 0's engine calls on ``engine`` until it stops;
    returns how many calls ran. A call that raises here raised on rank 0 too (the same checks
    on the same state), so it is logged and the loop goes on. SIGINT and SIGTERM are ignored
    meanwhile: rank 0 gets them too and ends this loop once its server has shut down (the
    launcher kills a rank that outlives its job)."""
    main = threading.current_thread() is threading.main_thread()
    saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in _SIGNALS} if main else {}
    try:
        return _follow(engine)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _follow(engine: Any) -> int:
    calls = 0
    device = _comm_device(engine)
    while True:
        command = _broadcast(None, device)
        kind = command[0]
        if kind == _STOP:
            return calls
        if kind == _NOOP:
            continue
        calls += 1
        try:
            if kind == _PUT:
                _, uids, tokens, scored, do_checks = command
                engine.put_scored(uids, tokens, scored, do_checks=do_checks)
            elif kind == _FLUSH:
                engine.flush(command[1])
            elif kind == _CLEAR:
                engine.clear_prefix_cache()
            else:
                raise RuntimeError(f"unknown tensor-parallel command {kind!r}")
        except (ValueError, RuntimeError) as exc:
            logger.warning(
                "serving rank %d: %s failed as on rank 0: %s", comm.get_rank(), kind, exc
            )
