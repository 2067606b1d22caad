"""The scheduler's batch composition, preemption, stops and bookkeeping over a stand-in engine
(``fake_engine.FakeEngine``: real block accounting, logits from a hash of each history)."""

from __future__ import annotations

import random

import pytest
import torch

from shardspeed.inference.v2.scheduler import RaggedScheduler, SamplingParams, TokenEvent
from tests.inference.v2.fake_engine import FakeEngine, hashed_logits

VOCAB = 50


def _engine(**kw: int) -> FakeEngine:
    return FakeEngine(hashed_logits(VOCAB), **kw)


def _alone(prompt: list[int], params: SamplingParams) -> list[int]:
    sched = RaggedScheduler(_engine(total_blocks=256))
    uid = sched.add_request(prompt, params)
    return sched.run_to_completion()[uid]


def test_splitfuse_chunks_and_decodes_share_steps() -> None:
    engine = _engine()
    sched = RaggedScheduler(engine, token_budget=16)
    a = sched.add_request(list(range(1, 6)), SamplingParams(max_new_tokens=20))
    events = sched.step()
    assert [(c.uid, c.length, c.samples) for c in sched.last_step] == [(a, 5, True)]
    assert [e.uid for e in events] == [a]
    long_prompt = [(7 * i) % VOCAB for i in range(40)]
    b = sched.add_request(long_prompt, SamplingParams(max_new_tokens=3))
    shapes = []
    for _ in range(3):
        events = sched.step()
        shapes.append([(c.uid, c.start, c.length, c.samples) for c in sched.last_step])
        # Only the step holding the prompt's last chunk yields a token for b.
        assert (b in [e.uid for e in events]) == (shapes[-1][-1][3])
    assert shapes == [
        [(a, 5, 1, True), (b, 0, 15, False)],
        [(a, 6, 1, True), (b, 15, 15, False)],
        [(a, 7, 1, True), (b, 30, 10, True)],
    ]
    assert all(c.is_decode for c in sched.last_step[:1])
    outputs = sched.run_to_completion()
    assert len(outputs[b]) == 2  # one already came with the last chunk
    roomy = RaggedScheduler(_engine())
    ua = roomy.add_request(list(range(1, 6)), SamplingParams(max_new_tokens=20))
    ub = roomy.add_request(long_prompt, SamplingParams(max_new_tokens=3))
    ref = roomy.run_to_completion()
    assert ref[ub][1:] == outputs[b]
    assert ref[ua] == _alone(list(range(1, 6)), SamplingParams(max_new_tokens=20))
    assert engine.free_blocks == engine.total_blocks


def _preemption_workload() -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(3)
    out = []
    for i in range(8):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 9))]
        params = SamplingParams(
            max_new_tokens=rng.randint(6, 24 - len(prompt) + 1),
            do_sample=i % 2 == 1,
            temperature=0.8,
            top_p=0.9,
            top_k=20,
            seed=100 + i,
        )
        out.append((prompt, params))
    return out


def test_preemption_under_a_tiny_cache_keeps_every_output() -> None:
    work = _preemption_workload()
    tight = _engine(total_blocks=6, kv_block_size=4)
    sched = RaggedScheduler(tight, token_budget=8)
    uids = [sched.add_request(p, s) for p, s in work]
    peak_running = 0
    outputs: dict[int, list[int]] = {}
    while sched.has_work:
        for e in sched.step():
            outputs.setdefault(e.uid, []).append(e.token)
        peak_running = max(peak_running, sched.num_running)
        assert tight.free_blocks >= 0
    assert sched.num_preemptions > 0
    assert peak_running > 1
    for uid, (prompt, params) in zip(uids, work, strict=True):
        assert outputs[uid] == _alone(prompt, params), uid
        assert len(outputs[uid]) == params.max_new_tokens
    assert tight.free_blocks == tight.total_blocks and not tight.history


def test_randomized_thousand_requests_with_aborts_leak_nothing() -> None:
    rng = random.Random(0)
    engine = _engine(total_blocks=24, kv_block_size=4)
    sched = RaggedScheduler(engine, token_budget=24, max_sequences=12)
    live: set[int] = set()
    added = aborted = finished = 0
    while added < 1000 or sched.has_work:
        for _ in range(rng.randint(0, 4)):
            if added < 1000:
                prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))]
                params = SamplingParams(
                    max_new_tokens=rng.randint(1, 8),
                    do_sample=rng.random() < 0.5,
                    seed=rng.randrange(2**31),  # not torch's global generator: repeatable
                    stop_token_ids=[rng.randrange(VOCAB)],
                )
                live.add(sched.add_request(prompt, params))
                added += 1
        if live and rng.random() < 0.15:
            uid = rng.choice(sorted(live))
            assert sched.abort(uid)
            live.discard(uid)
            aborted += 1
        for e in sched.step():
            assert e.uid in live
            if e.finished:
                live.discard(e.uid)
                finished += 1
        assert engine.free_blocks + sum(len(t) for t in engine.tables.values()) == 24
    assert aborted > 50 and finished > 500 and aborted + finished == 1000
    assert sched.num_preemptions > 0
    assert engine.free_blocks == engine.total_blocks and not engine.history and not live
    assert sched.num_running == sched.num_waiting == 0


def _scripted(first: int, second: int) -> FakeEngine:
    """Logits whose best token is ``first`` and second best ``second``, always."""

    def fn(history: list[int]) -> torch.Tensor:
        logits = torch.zeros(VOCAB)
        logits[first], logits[second] = 10.0, 5.0
        return logits

    return FakeEngine(fn)


def test_stop_tokens_eos_min_new_tokens_and_ignore_eos() -> None:
    def run(params: SamplingParams, eos: list[int] | None = None) -> list[TokenEvent]:
        engine = _scripted(3, 5)
        sched = RaggedScheduler(engine, eos_token_ids=eos)
        sched.add_request([1, 2], params)
        events = []
        while sched.has_work:
            events += sched.step()
        assert engine.free_blocks == engine.total_blocks
        return events

    def summary(events: list[TokenEvent]) -> tuple[list[int], str | None]:
        assert [e.finished for e in events] == [False] * (len(events) - 1) + [True]
        return [e.token for e in events], events[-1].finish_reason

    assert summary(run(SamplingParams(max_new_tokens=4))) == ([3, 3, 3, 3], "length")
    assert summary(run(SamplingParams(max_new_tokens=4), eos=[3])) == ([3], "stop")
    assert summary(run(SamplingParams(max_new_tokens=4, min_new_tokens=2), eos=[3])) == (
        [5, 5, 3],
        "stop",
    )
    assert summary(run(SamplingParams(max_new_tokens=4, ignore_eos=True), eos=[3])) == (
        [3, 3, 3, 3],
        "length",
    )
    assert summary(
        run(SamplingParams(max_new_tokens=4, ignore_eos=True, stop_token_ids=[3]), eos=[3])
    ) == ([3], "stop")
    assert summary(run(SamplingParams(max_new_tokens=4, min_new_tokens=1, stop_token_ids=[3]))) == (
        [5, 3],
        "stop",
    )
    assert summary(run(SamplingParams(max_new_tokens=1), eos=[5])) == ([3], "length")


def test_stop_token_suppression_is_per_request_in_one_batch() -> None:
    """Suppression before min_new_tokens is applied to each request's own row of the step's
    logits: greedy and sampled requests that need it never draw a stop token, a batch-mate that
    does not need it stops at once."""
    sched = RaggedScheduler(_scripted(3, 5), eos_token_ids=[3])
    held = sched.add_request([1, 2], SamplingParams(max_new_tokens=4, min_new_tokens=2))
    free = sched.add_request([4, 2], SamplingParams(max_new_tokens=4))
    sampled = sched.add_request(
        [6, 2], SamplingParams(max_new_tokens=3, min_new_tokens=3, do_sample=True, top_k=1, seed=0)
    )
    assert sched.run_to_completion() == {held: [5, 5, 3], free: [3], sampled: [5, 5, 5]}


def test_request_too_big_names_sizes() -> None:
    sched = RaggedScheduler(_engine(total_blocks=6, kv_block_size=4, max_context=40))
    with pytest.raises(ValueError, match=r"7 KV blocks of 4 tokens .*25 tokens.* has 6"):
        sched.add_request(list(range(20)), SamplingParams(max_new_tokens=6))
    sched.add_request(list(range(20)), SamplingParams(max_new_tokens=5))  # 24 tokens: fits
    with pytest.raises(ValueError, match=r"45 tokens of context .*max_context is 40"):
        RaggedScheduler(_engine(max_context=40)).add_request(
            list(range(30)), SamplingParams(max_new_tokens=16)
        )
    with pytest.raises(ValueError, match="empty prompt"):
        sched.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="uid 5 is in use"):
        sched.add_request([1], SamplingParams(max_new_tokens=2), uid=5)
        sched.add_request([1], SamplingParams(max_new_tokens=2), uid=5)
    with pytest.raises(ValueError, match="max_ragged_batch_size"):

        class _Limits:
            max_ragged_batch_size, max_ragged_sequence_count = 32, 4

        eng = _engine()
        eng.config = type("C", (), {"state_manager": _Limits()})()  # type: ignore[attr-defined]
        RaggedScheduler(eng, token_budget=64)


def test_abort_mid_generation_frees_blocks() -> None:
    engine = _engine()
    sched = RaggedScheduler(engine)
    a = sched.add_request(list(range(10)), SamplingParams(max_new_tokens=50))
    b = sched.add_request(list(range(5)), SamplingParams(max_new_tokens=3))
    for _ in range(4):
        sched.step()
    assert engine.free_blocks < engine.total_blocks and engine.tracked(a)
    assert sched.abort(a)
    assert not engine.tracked(a)
    assert not sched.abort(a)
    assert not sched.abort(b)  # finished already
    assert engine.free_blocks == engine.total_blocks and not sched.has_work
    # A waiting request aborts without ever reaching the engine.
    c = sched.add_request([1, 2], SamplingParams())
    assert sched.abort(c) and not sched.has_work and not engine.puts[-1:] == [[(c, 2)]]


class _Watched(torch.Tensor):
    """Logits that count how often they are copied to the host."""

    host_copies = 0

    def cpu(self, *args: object, **kwargs: object) -> torch.Tensor:  # type: ignore[override]
        _Watched.host_copies += 1
        return super().cpu(*args, **kwargs)  # type: ignore[arg-type]


def test_greedy_steps_pick_on_the_logits_device_and_fetch_only_token_ids(monkeypatch) -> None:
    """A step whose requests are all greedy, with nothing to adjust or report, takes its argmax
    where the logits are (stop tokens suppressed there too) and brings back no logits row; a
    step with a sampling, log-probability or penalised request brings the logits to the host.
    The tokens are the same either way."""
    engine = _scripted(3, 5)
    put = engine.put
    monkeypatch.setattr(engine, "put", lambda *a, **k: put(*a, **k).as_subclass(_Watched))
    monkeypatch.setattr(_Watched, "host_copies", 0)
    sched = RaggedScheduler(engine, eos_token_ids=[3])
    held = sched.add_request([1, 2], SamplingParams(max_new_tokens=4, min_new_tokens=2))
    free = sched.add_request([4, 2], SamplingParams(max_new_tokens=4))
    assert sched.run_to_completion() == {held: [5, 5, 3], free: [3]}
    assert _Watched.host_copies == 0
    for reads in ({"do_sample": True, "top_k": 1, "seed": 0}, {"logprobs": 1},
                  {"repetition_penalty": 1.5}):  # fmt: skip
        held = sched.add_request([1, 2], SamplingParams(max_new_tokens=4, min_new_tokens=2))
        other = sched.add_request([6, 2], SamplingParams(max_new_tokens=2, **reads))
        copies = _Watched.host_copies
        out = sched.run_to_completion()
        assert out[held] == [5, 5, 3] and len(out[other]) >= 1
        assert _Watched.host_copies > copies, reads
