"""AsyncGenerationEngine: the scheduler loop in a background thread, fed from threads and asyncio."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest
import torch

from shardspeed.inference.v2 import build_hf_engine
from shardspeed.inference.v2.scheduler import (
    AsyncGenerationEngine,
    EngineLoopError,
    RaggedScheduler,
    SamplingParams,
)
from tests.inference.v2 import hf_models
from tests.inference.v2.fake_engine import FakeEngine, hashed_logits

pytestmark = pytest.mark.timeout(120)
WAIT = 60.0  # seconds any single token may take before a test fails instead of hanging


def _engine():  # noqa: ANN202
    config = {
        "state_manager": {
            "kv_block_size": 8,
            "max_context": 512,
            "memory_config": {"mode": "allocate", "size": 64},
        }
    }
    return build_hf_engine(hf_models.build("llama", seed=0), config)


def _requests() -> list[tuple[list[int], SamplingParams]]:
    out = []
    for i in range(12):
        prompt = hf_models.tokens(4 + 9 * i, seed=300 + i).tolist()
        extra = {"do_sample": True, "temperature": 0.8, "top_p": 0.9, "top_k": 20} if i % 3 else {}
        out.append((prompt, SamplingParams(max_new_tokens=3 + 2 * i, seed=i, **extra)))
    return out


def _sync_reference(work: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    sched = RaggedScheduler(_engine(), token_budget=64)
    uids = [sched.add_request(p, s) for p, s in work]
    outputs = sched.run_to_completion()
    return [outputs[u] for u in uids]


def test_threads_and_asyncio_give_the_synchronous_tokens() -> None:
    work = _requests()
    expected = _sync_reference(work)
    engine = _engine()
    with AsyncGenerationEngine(engine, token_budget=64) as gen:
        results: dict[int, list[int]] = {}
        streamed: dict[int, list[int]] = {}

        def client(i: int) -> None:
            handle = gen.submit(*work[i])
            if i % 2:
                streamed[i] = list(handle.tokens(timeout=WAIT))
            results[i] = handle.result(timeout=WAIT)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT)
        assert not any(t.is_alive() for t in threads)

        async def consume(i: int) -> tuple[list[int], str | None]:
            handle = gen.submit(*work[i])
            seen = [event async for event in handle]
            assert all(not e.finished for e in seen[:-1]) and seen[-1].finished
            return [e.token for e in seen], handle.finish_reason

        async def main() -> list[tuple[list[int], str | None]]:
            return await asyncio.wait_for(asyncio.gather(*(consume(i) for i in range(6, 12))), WAIT)

        from_asyncio = asyncio.run(main())
    for i in range(6):
        assert results[i] == expected[i], i
        if i % 2:
            assert streamed[i] == expected[i]
    for i, (tokens, reason) in zip(range(6, 12), from_asyncio, strict=True):
        assert tokens == expected[i], i
        assert reason == "length"
    assert engine.free_blocks == engine.total_blocks and engine.n_tracked_sequences == 0


def test_shutdown_joins_the_thread_and_ends_unfinished_handles() -> None:
    engine = FakeEngine(hashed_logits(50))
    gen = AsyncGenerationEngine(engine)
    done = gen.submit([1, 2, 3], SamplingParams(max_new_tokens=2))
    assert len(done.result(timeout=WAIT)) == 2 and done.finish_reason == "length"
    gate = threading.Event()
    original_put = engine.put

    def slow_put(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        gate.wait(WAIT)
        return original_put(*args, **kwargs)

    engine.put = slow_put  # type: ignore[method-assign]
    pending = gen.submit([4, 5], SamplingParams(max_new_tokens=200))
    time.sleep(0.05)
    stopper = threading.Thread(target=gen.shutdown)
    stopper.start()
    gate.set()
    stopper.join(WAIT)
    assert not stopper.is_alive() and not gen._thread.is_alive() and not gen.running
    with pytest.raises(EngineLoopError, match="shut down"):
        pending.result(timeout=WAIT)
    with pytest.raises(RuntimeError, match="shut down"):
        gen.submit([1], SamplingParams(max_new_tokens=1))
    assert engine.free_blocks == engine.total_blocks and not engine.history


def test_a_loop_exception_reaches_every_waiting_handle() -> None:
    engine = FakeEngine(hashed_logits(50))
    calls = {"n": 0}
    original_put = engine.put

    def failing_put(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("device lost")
        return original_put(*args, **kwargs)

    engine.put = failing_put  # type: ignore[method-assign]
    gen = AsyncGenerationEngine(engine)
    handles = [gen.submit([i + 1, 2], SamplingParams(max_new_tokens=100)) for i in range(4)]

    async def consume_async() -> None:
        async for _ in handles[0]:
            pass

    with pytest.raises(EngineLoopError, match="device lost") as info:
        asyncio.run(asyncio.wait_for(consume_async(), WAIT))
    assert isinstance(info.value.__cause__, RuntimeError)
    for handle in handles[1:]:
        with pytest.raises(EngineLoopError, match="device lost"):
            handle.result(timeout=WAIT)
    with pytest.raises(EngineLoopError, match="device lost"):
        gen.submit([1], SamplingParams(max_new_tokens=1))
    gen.shutdown(timeout=WAIT)
    assert not gen._thread.is_alive()


def test_abort_and_synchronous_errors() -> None:
    engine = FakeEngine(hashed_logits(50), total_blocks=8, kv_block_size=4)
    permits = threading.Semaphore(3)  # the loop may run 3 steps before the abort is queued
    original_put = engine.put

    def metered_put(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        assert permits.acquire(timeout=WAIT)
        return original_put(*args, **kwargs)

    engine.put = metered_put  # type: ignore[method-assign]
    with AsyncGenerationEngine(engine) as gen:
        with pytest.raises(ValueError, match="KV blocks"):
            gen.submit(list(range(30)), SamplingParams(max_new_tokens=10))
        handle = gen.submit([1, 2, 3], SamplingParams(max_new_tokens=25))
        stream = handle.tokens(timeout=WAIT)
        first = [next(stream) for _ in range(3)]
        # The loop now waits for a permit, so uid 7 cannot finish between the two submits.
        gen.submit([1], SamplingParams(max_new_tokens=1), uid=7)
        with pytest.raises(ValueError, match="uid 7 is in use"):
            gen.submit([1], SamplingParams(max_new_tokens=1), uid=7)
        handle.abort()
        for _ in range(100):
            permits.release()
        rest = list(stream)
        assert handle.finish_reason == "abort" and len(first + rest) < 25
        # The loop keeps serving after an abort, and the aborted request's blocks came back.
        assert gen.submit([9, 9], SamplingParams(max_new_tokens=4)).result(timeout=WAIT)
        deadline = time.monotonic() + WAIT
        while engine.history and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.free_blocks == engine.total_blocks and not engine.history


def test_handle_wait_times_out_instead_of_hanging() -> None:
    engine = FakeEngine(hashed_logits(50))
    gate = threading.Event()
    original_put = engine.put

    def gated_put(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        gate.wait(WAIT)
        return original_put(*args, **kwargs)

    engine.put = gated_put  # type: ignore[method-assign]
    with AsyncGenerationEngine(engine) as gen:
        handle = gen.submit(torch.tensor([1, 2]), SamplingParams(max_new_tokens=3))
        with pytest.raises(TimeoutError, match="no token within 0.05 s"):
            handle.result(timeout=0.05)
        gate.set()
        assert len(handle.result(timeout=WAIT)) == 3 and handle.finish_reason == "length"


def test_concurrent_submits_and_aborts_end_every_handle_and_free_every_block() -> None:
    engine = FakeEngine(hashed_logits(50), total_blocks=16, kv_block_size=4)
    with AsyncGenerationEngine(engine, token_budget=24) as gen:
        handles = []
        lock = threading.Lock()

        def client(seed: int) -> None:
            rng = random.Random(seed)
            for _ in range(25):
                prompt = [rng.randrange(50) for _ in range(rng.randint(1, 8))]
                handle = gen.submit(prompt, SamplingParams(max_new_tokens=rng.randint(1, 10)))
                with lock:
                    handles.append(handle)
                    victim = rng.choice(handles) if rng.random() < 0.3 else None
                if victim is not None:
                    victim.abort()

        threads = [threading.Thread(target=client, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT)
        reasons = []
        for handle in handles:
            tokens = handle.result(timeout=WAIT)
            reasons.append(handle.finish_reason)
            assert handle.finish_reason == "abort" or 1 <= len(tokens)
        deadline = time.monotonic() + WAIT
        while gen.scheduler.has_work and time.monotonic() < deadline:
            time.sleep(0.01)
    assert len(handles) == 100 and "abort" in reasons and "length" in reasons
    assert engine.free_blocks == engine.total_blocks and not engine.history
