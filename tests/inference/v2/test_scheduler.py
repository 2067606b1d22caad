"""The scheduler over the real ``InferenceEngineV2`` and a tiny fp32 Llama: continuous batching
with arrivals over time gives Hugging Face ``generate``'s tokens, Dynamic SplitFuse, preemption
under a tiny cache, and no leaked block over a randomized run."""

from __future__ import annotations

import functools
import random
from typing import Any

import pytest
import torch
from transformers.generation.logits_process import LogitsProcessorList

from shardspeed.inference.v2 import build_hf_engine
from shardspeed.inference.v2.scheduler import RaggedScheduler, SamplingParams
from tests.inference.v2 import hf_models

pytestmark = pytest.mark.timeout(600)

SAMPLED = {"do_sample": True, "temperature": 0.8, "top_p": 0.9, "top_k": 20}


@functools.lru_cache(maxsize=1)
def _model() -> torch.nn.Module:
    return hf_models.build("llama", seed=0)


def _engine(blocks: int = 256, block_size: int = 16, **state: object):  # noqa: ANN202
    config = {
        "state_manager": {
            "kv_block_size": block_size,
            "max_context": 512,
            "memory_config": {"mode": "allocate", "size": blocks},
            **state,
        }
    }
    return build_hf_engine(_model(), config)


def _workload() -> list[tuple[list[int], int]]:
    """16 (prompt, max_new_tokens): prompts of 3..200 tokens, outputs of 1..64."""
    rng = random.Random(29)
    lengths = [3, 200, *(rng.randint(3, 200) for _ in range(14))]
    outs = [64, 1, *(rng.randint(1, 64) for _ in range(14))]
    return [
        (hf_models.tokens(n, seed=i).tolist(), m)
        for i, (n, m) in enumerate(zip(lengths, outs, strict=True))
    ]


def _run_arriving(
    sched: RaggedScheduler, work: list[tuple[list[int], SamplingParams]], every: int = 3
) -> dict[int, list[int]]:
    """Add request i before step ``every * i`` (arrivals over time); run to the end; outputs in
    request order."""
    uids: list[int] = []
    outputs: dict[int, list[int]] = {}
    step = widest = splits = 0
    while len(uids) < len(work) or sched.has_work:
        while len(uids) < len(work) and step >= every * len(uids):
            prompt, params = work[len(uids)]
            uids.append(sched.add_request(prompt, params))
        for event in sched.step():
            outputs.setdefault(event.uid, []).append(event.token)
        widest = max(widest, len(sched.last_step))
        splits += sum(not c.samples for c in sched.last_step)
        step += 1
    # Continuous batching really mixed sequences, and SplitFuse really split prompts.
    assert widest >= 4 and splits >= 3
    return {i: outputs[u] for i, u in enumerate(uids)}


def _alone(prompt: list[int], params: SamplingParams) -> list[int]:
    sched = RaggedScheduler(_engine())
    uid = sched.add_request(prompt, params)
    return sched.run_to_completion()[uid]


def test_arrivals_over_time_greedy_equal_hf_generate() -> None:
    work = _workload()
    engine = _engine()
    sched = RaggedScheduler(engine, token_budget=96)
    outputs = _run_arriving(sched, [(p, SamplingParams(max_new_tokens=m)) for p, m in work])
    assert sched.num_steps < sum(m for _, m in work)
    model = _model()
    for i, (prompt, new) in enumerate(work):
        expected = hf_models.greedy(model, torch.tensor(prompt), new)
        assert outputs[i] == expected, f"request {i} (prompt {len(prompt)}, {new} new)"
    assert engine.free_blocks == engine.total_blocks and engine.n_tracked_sequences == 0


def test_arrivals_over_time_sampled_equal_single_request_runs() -> None:
    work = [
        (p, SamplingParams(max_new_tokens=m, seed=1000 + i, **SAMPLED))
        for i, (p, m) in enumerate(_workload())
    ]
    outputs = _run_arriving(RaggedScheduler(_engine(), token_budget=96), work)
    greedy_differs = 0
    model = _model()
    for i, (prompt, params) in enumerate(work):
        assert outputs[i] == _alone(prompt, params), f"request {i}"
        greedy_differs += outputs[i] != hf_models.greedy(
            model, torch.tensor(prompt), params.max_new_tokens
        )
    assert greedy_differs >= 4  # sampling really sampled


ADJUSTMENTS: list[dict[str, Any]] = [
    {},
    {"repetition_penalty": 1.5, "logit_bias": {7: 2.0, 30: -1.5}},
    {"frequency_penalty": 1.2, "presence_penalty": 0.7},
    {"repetition_penalty": 0.8, "frequency_penalty": -0.5, "presence_penalty": 1.9,
     "logit_bias": {3: 4.0}},
]  # fmt: skip


def _hf_adjusted(prompt: list[int], new: int, adjust: dict[str, Any]) -> list[int]:
    """``generate``'s greedy tokens with the same bias and penalties (its own sequence bias and
    repetition penalty, OpenAI's penalties as a logits processor after them)."""
    kwargs: dict[str, Any] = {}
    if "repetition_penalty" in adjust:
        kwargs["repetition_penalty"] = adjust["repetition_penalty"]
    if "logit_bias" in adjust:
        kwargs["sequence_bias"] = {(t,): b for t, b in adjust["logit_bias"].items()}
    if "frequency_penalty" in adjust:
        penalties = hf_models.OpenAIPenalties(
            len(prompt), adjust["frequency_penalty"], adjust["presence_penalty"]
        )
        kwargs["logits_processor"] = LogitsProcessorList([penalties])
    return hf_models.greedy(_model(), torch.tensor(prompt), new, **kwargs)


def test_bias_and_penalties_in_ragged_batches_equal_hf_generate() -> None:
    """Requests with a logit bias, a repetition penalty and OpenAI's penalties share ragged
    batches with plain ones: each gives ``generate``'s tokens with the same settings; sampled
    with them, each equals its single-request run."""
    work = _workload()
    params = [
        SamplingParams(max_new_tokens=m, **ADJUSTMENTS[i % 4]) for i, (_, m) in enumerate(work)
    ]
    outputs = _run_arriving(
        RaggedScheduler(_engine(), token_budget=96),
        [(p, q) for (p, _), q in zip(work, params, strict=True)],
    )
    changed = 0
    for i, (prompt, new) in enumerate(work):
        adjust = ADJUSTMENTS[i % 4]
        assert outputs[i] == _hf_adjusted(prompt, new, adjust), f"request {i}: {adjust}"
        if adjust and new > 4:
            changed += outputs[i] != hf_models.greedy(_model(), torch.tensor(prompt), new)
    assert changed >= 6  # the adjustments really changed the tokens
    sampled = [
        (p, SamplingParams(max_new_tokens=m, seed=50 + i, **SAMPLED, **ADJUSTMENTS[3]))
        for i, (p, m) in enumerate(work[:8])
    ]
    outputs = _run_arriving(RaggedScheduler(_engine(), token_budget=96), sampled, every=1)
    for i, (prompt, sampling) in enumerate(sampled):
        assert outputs[i] == _alone(prompt, sampling), f"sampled request {i}"
    # sampling draws from the adjusted distribution: a +100 bias is drawn every time
    biased = SamplingParams(max_new_tokens=6, seed=7, **SAMPLED, logit_bias={41: 100.0})
    assert _alone(work[0][0], biased) == [41] * 6


def test_a_bias_outside_the_vocabulary_is_refused_at_submission() -> None:
    sched = RaggedScheduler(_engine())
    vocab = sched.engine.vocab_size
    with pytest.raises(ValueError, match=f"vocabulary has {vocab} tokens"):
        sched.add_request([1, 2], SamplingParams(logit_bias={vocab: 1.0}))
    assert not sched.has_work


def test_stop_and_eos_ids_outside_the_vocabulary_are_refused() -> None:
    """A stop id past the vocabulary would index out of the logits when suppressed before
    min_new_tokens (on a GPU a device-side assert that ends the process's use of the device):
    refused at submission, an end-of-sequence id at construction, a negative one in the
    params."""
    sched = RaggedScheduler(_engine())
    vocab = sched.engine.vocab_size
    with pytest.raises(ValueError, match=f"stop_token_ids names token id {vocab}"):
        sched.add_request([1, 2], SamplingParams(stop_token_ids=[3, vocab], min_new_tokens=1))
    assert not sched.has_work
    with pytest.raises(ValueError, match=rf"eos_token_ids \[2, {vocab}\] must be token ids"):
        RaggedScheduler(sched.engine, eos_token_ids=[2, vocab])
    with pytest.raises(ValueError, match=r"stop_token_ids: \[-1\] are negative"):
        SamplingParams(stop_token_ids=[-1])


def test_splitfuse_splits_a_prompt_over_steps_with_decodes_riding_along() -> None:
    engine = _engine()
    sched = RaggedScheduler(engine, token_budget=32)
    short = hf_models.tokens(5, seed=50).tolist()
    long = hf_models.tokens(90, seed=51).tolist()
    a = sched.add_request(short, SamplingParams(max_new_tokens=8))
    out = {a: [e.token for e in sched.step()]}
    b = sched.add_request(long, SamplingParams(max_new_tokens=4))
    shapes = []
    while sched.has_work:
        events = sched.step()
        shapes.append([(c.uid, c.length, c.samples) for c in sched.last_step])
        for e in events:
            out.setdefault(e.uid, []).append(e.token)
    # 90 prompt tokens under a 32-token budget with a's decode token in each step: 31+31+28.
    assert shapes[:3] == [
        [(a, 1, True), (b, 31, False)],
        [(a, 1, True), (b, 31, False)],
        [(a, 1, True), (b, 28, True)],
    ]
    assert all(n <= 32 for s in shapes for n in [sum(x[1] for x in s)])
    assert out[a] == hf_models.greedy(_model(), torch.tensor(short), 8)
    assert out[b] == hf_models.greedy(_model(), torch.tensor(long), 4)


def test_preemption_with_six_blocks_of_four() -> None:
    rng = random.Random(7)
    work = []
    for i in range(8):
        prompt = hf_models.tokens(rng.randint(3, 10), seed=200 + i).tolist()
        max_new = rng.randint(6, 24 - len(prompt) + 1)
        extra = SAMPLED if i % 2 else {}
        work.append((prompt, SamplingParams(max_new_tokens=max_new, seed=i, **extra)))
    roomy = RaggedScheduler(_engine(blocks=64, block_size=4))
    ref_uids = [roomy.add_request(p, s) for p, s in work]
    ref = roomy.run_to_completion()
    assert roomy.num_preemptions == 0

    engine = _engine(blocks=6, block_size=4)
    tight = RaggedScheduler(engine, token_budget=16)
    uids = [tight.add_request(p, s) for p, s in work]
    got = tight.run_to_completion()
    assert tight.num_preemptions > 0
    for u, r in zip(uids, ref_uids, strict=True):
        assert got[u] == ref[r]
    assert engine.free_blocks == engine.total_blocks == 6 and engine.n_tracked_sequences == 0


def test_thousand_random_requests_with_aborts_return_every_block() -> None:
    rng = random.Random(1)
    engine = _engine(blocks=12, block_size=4)
    sched = RaggedScheduler(engine, token_budget=32, max_sequences=16)
    live: set[int] = set()
    added = aborted = 0
    while added < 1000 or sched.has_work:
        for _ in range(rng.randint(0, 6)):
            if added < 1000:
                # A few shared prefixes so that prefix-cached blocks are exercised too.
                head = [7, 8, 9, 10] if rng.random() < 0.3 else []
                prompt = head + [rng.randrange(1, 256) for _ in range(rng.randint(1, 10))]
                params = SamplingParams(
                    max_new_tokens=rng.randint(1, 6),
                    do_sample=rng.random() < 0.5,
                    seed=rng.randrange(2**31),
                )
                live.add(sched.add_request(prompt, params))
                added += 1
        if live and rng.random() < 0.2:
            uid = rng.choice(sorted(live))
            sched.abort(uid)
            live.discard(uid)
            aborted += 1
        for e in sched.step():
            if e.finished:
                live.discard(e.uid)
    assert aborted > 50 and not live and sched.num_preemptions > 0
    assert engine.prefix_hit_tokens > 0
    assert engine.free_blocks == engine.total_blocks and engine.n_tracked_sequences == 0
    # every indexed block is kept cached, held by no sequence; clearing frees them all
    assert engine.prefix_index_size == engine.cached_blocks
    engine.clear_prefix_cache()
    assert engine.prefix_index_size == 0 and engine.free_blocks == engine.total_blocks


def test_one_step_admits_no_more_sequences_than_the_engine_tracks() -> None:
    """8 requests waiting at once for an engine that tracks 3 sequences: each step admits
    only what the engine has room for (a step admitting more fails its put), and every
    request still gives its HF tokens."""
    engine = _engine(max_tracked_sequences=3)
    sched = RaggedScheduler(engine, token_budget=256)
    work = _workload()[:8]
    uids = [sched.add_request(p, SamplingParams(max_new_tokens=min(m, 6))) for p, m in work]
    outputs: dict[int, list[int]] = {}
    most = 0
    while sched.has_work:
        for event in sched.step():
            outputs.setdefault(event.uid, []).append(event.token)
        most = max(most, engine.n_tracked_sequences)
        assert sched.num_running <= 3
    assert most <= 3
    for uid, (prompt, new) in zip(uids, work, strict=True):
        expected = hf_models.greedy(_model(), torch.tensor(prompt), min(new, 6))
        assert outputs[uid] == expected


def test_choices_of_one_prompt_compute_it_once() -> None:
    """4 seeded choices of one 50-token prompt and an unrelated prompt, all waiting at once:
    the first choice computes the prompt, the others wait for it and then compute only the
    2 tokens past its 3 cached blocks of 16, while the unrelated prompt is admitted at once;
    every choice still equals its single-request run."""
    prompt, other = hf_models.tokens(50, seed=7).tolist(), hf_models.tokens(30, seed=8).tolist()
    engine = _engine(block_size=16)
    sched = RaggedScheduler(engine, token_budget=128)
    choices = [SamplingParams(max_new_tokens=5, seed=60 + j, **SAMPLED) for j in range(4)]
    uids = [sched.add_request(prompt, params) for params in choices]
    alone = sched.add_request(other, SamplingParams(max_new_tokens=5))
    first = sched.step()
    assert {c.uid for c in sched.last_step} == {uids[0], alone}  # the siblings wait
    outputs = sched.run_to_completion()
    for event in first:
        outputs.setdefault(event.uid, []).insert(0, event.token)
    # 50 + 3 x 2 prompt tokens, 30, and 4 fed-back tokens per request
    assert engine.computed_tokens == 50 + 3 * 2 + 30 + 5 * 4
    assert engine.prefix_hit_tokens == 3 * 48
    for uid, params in zip(uids, choices, strict=True):
        assert outputs[uid] == _alone(prompt, params)
    assert len({tuple(outputs[u]) for u in uids}) > 1  # the seeds really differ


def test_cached_prompt_tokens_take_no_budget() -> None:
    """A 205-token prompt whose first 192 tokens are cached (an earlier request's prompt) runs
    its whole prompt in one step under a 32-token budget: only its 13 new tokens count, in the
    scheduler and in the engine's max_ragged_batch_size check alike; its tokens are HF's."""
    engine = _engine(block_size=16, max_ragged_batch_size=32)
    sched = RaggedScheduler(engine, token_budget=32)
    shared = hf_models.tokens(200, seed=9).tolist()
    first = sched.add_request(shared, SamplingParams(max_new_tokens=2))
    sched.run_to_completion()
    assert first not in sched._running and engine.cached_blocks >= 12
    prompt = shared + hf_models.tokens(5, seed=10).tolist()
    uid = sched.add_request(prompt, SamplingParams(max_new_tokens=4))
    short = sched.add_request(hf_models.tokens(10, seed=11).tolist(), SamplingParams())
    computed = engine.computed_tokens
    events = sched.step()
    # 13 + 10 tokens of budget: the short prompt fits beside it in the same step
    assert [(c.uid, c.start, c.length) for c in sched.last_step] == [(uid, 0, 205), (short, 0, 10)]
    assert [e.uid for e in events] == [uid, short]  # first tokens in the first step
    assert engine.computed_tokens - computed == 13 + 10
    sched.abort(short)
    tokens = [events[0].token] + sched.run_to_completion()[uid]
    assert tokens == hf_models.greedy(_model(), torch.tensor(prompt), 4)


def test_shared_prefixes_under_a_tight_cache_and_budget() -> None:
    """200 requests whose prompts share prefixes (a few system prompts, some cut short, plus
    tails), over a cache of 24 blocks of 4 and a budget of 7 tokens: steps defer, adopt,
    preempt and cut chunks to the blocks left, yet the engine never computes more than the
    budget in a step (its own check would stop the loop), every request ends with its length,
    and every block comes back."""
    rng = random.Random(5)
    systems = [hf_models.tokens(n, seed=20 + n).tolist() for n in (9, 13, 22)]
    engine = _engine(blocks=24, block_size=4, max_ragged_batch_size=7, max_context=64)
    sched = RaggedScheduler(engine, token_budget=7)
    lengths: dict[int, int] = {}
    outputs: dict[int, list[int]] = {}
    added = steps = 0
    while added < 200 or sched.has_work:
        for _ in range(rng.randint(0, 3) if added < 200 else 0):
            system = rng.choice(systems)[: rng.randint(4, 22)]
            tail = [rng.randint(1, hf_models.VOCAB - 1) for _ in range(rng.randint(1, 6))]
            new = rng.randint(1, 12)
            lengths[sched.add_request(system + tail, SamplingParams(max_new_tokens=new))] = new
            added += 1
        before = engine.computed_tokens
        for event in sched.step():
            outputs.setdefault(event.uid, []).append(event.token)
        assert engine.computed_tokens - before <= 7
        steps += 1
    assert {u: len(t) for u, t in outputs.items()} == lengths
    assert engine.prefix_hit_tokens > 0 and sched.num_preemptions > 0
    engine.clear_prefix_cache()
    assert engine.free_blocks == engine.total_blocks and engine.n_tracked_sequences == 0


def test_a_shared_system_prompt_delays_its_sharers_only_until_it_is_computed() -> None:
    """Two prompts behind one 40-token system prompt (2 shared full blocks of 16) and a
    64-token budget: the second waits for the step that computes the shared blocks, then joins
    the step where the first still computes the rest of its prompt, adopting the shared blocks
    (32 tokens) and spending the budget left past them."""
    system = hf_models.tokens(40, seed=30).tolist()
    first = system + hf_models.tokens(60, seed=31).tolist()
    second = system + hf_models.tokens(30, seed=32).tolist()
    engine = _engine(block_size=16, max_ragged_batch_size=64)
    sched = RaggedScheduler(engine, token_budget=64)
    a = sched.add_request(first, SamplingParams(max_new_tokens=3))
    b = sched.add_request(second, SamplingParams(max_new_tokens=3))
    sched.step()
    assert [(c.uid, c.start, c.length) for c in sched.last_step] == [(a, 0, 64)]
    sched.step()
    chunks = [(c.uid, c.start, c.length) for c in sched.last_step]
    assert chunks == [(a, 64, 36), (b, 0, 32 + 28)]
    assert engine.prefix_hit_tokens == 32
    outputs = sched.run_to_completion()
    assert outputs[b] == hf_models.greedy(_model(), torch.tensor(second), 3)


def test_real_engine_too_big_and_abort() -> None:
    engine = _engine(blocks=6, block_size=4)
    sched = RaggedScheduler(engine)
    with pytest.raises(ValueError, match="7 KV blocks of 4 tokens.*has 6"):
        sched.add_request(list(range(1, 21)), SamplingParams(max_new_tokens=6))
    with pytest.raises(ValueError, match="max_context is 512"):
        RaggedScheduler(_engine()).add_request([1] * 500, SamplingParams(max_new_tokens=20))
    uid = sched.add_request([1, 2, 3], SamplingParams(max_new_tokens=12))
    for _ in range(3):
        sched.step()
    assert engine.free_blocks < 6 and engine.tracked(uid)
    assert sched.abort(uid) and not engine.tracked(uid) and engine.free_blocks == 6


def test_logprobs_are_the_models_raw_log_softmax() -> None:
    """A request asking for logprobs gets, per token, the log-softmax of Hugging Face's own
    logits at that position (raw: before temperature and the min_new_tokens ban) and the k most
    likely tokens in order; its batch-mates asking nothing get none, and tokens are unchanged."""
    model = _model()
    prompts = [hf_models.tokens(n, seed=40 + n).tolist() for n in (5, 17, 9)]
    asks = [
        SamplingParams(max_new_tokens=6, logprobs=3),
        SamplingParams(max_new_tokens=6),
        SamplingParams(max_new_tokens=6, logprobs=0, temperature=0.5, do_sample=True, seed=3),
    ]
    sched = RaggedScheduler(_engine(), token_budget=16)
    uids = [sched.add_request(p, a) for p, a in zip(prompts, asks, strict=True)]
    events: dict[int, list] = {u: [] for u in uids}
    while sched.has_work:
        for event in sched.step():
            events[event.uid].append(event)
    plain = [e.token for e in events[uids[1]]]
    assert all(e.logprob is None and e.top_logprobs == () for e in events[uids[1]])
    assert plain == _alone(prompts[1], asks[1])
    for uid, prompt, ask in ((uids[0], prompts[0], asks[0]), (uids[2], prompts[2], asks[2])):
        got = events[uid]
        tokens = [e.token for e in got]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens], device=model.device)).logits[0].float()
        want = logits[len(prompt) - 1 : -1].log_softmax(dim=-1)
        for step, event in enumerate(got):
            assert event.logprob == pytest.approx(float(want[step, event.token]), abs=1e-4)
            assert len(event.top_logprobs) == ask.logprobs
            values, ids = want[step].topk(ask.logprobs) if ask.logprobs else (want[:0, 0],) * 2
            assert [t for t, _ in event.top_logprobs] == ids.tolist()
            for (_, v), w in zip(event.top_logprobs, values.tolist(), strict=True):
                assert v == pytest.approx(w, abs=1e-4)
        if not ask.do_sample:  # greedy: the drawn token is the most likely one
            assert all(e.token == e.top_logprobs[0][0] for e in got)


def test_prompt_logprobs_over_chunks_equal_hf() -> None:
    """prompt_logprobs: a 40-token prompt split over steps by a 16-token budget, its prefix
    already cached by an earlier request, reports every prompt token's log-probability (the
    first None) and top tokens as HF's own forward gives them, with its first token."""
    model = _model()
    prompt = hf_models.tokens(40, seed=77).tolist()
    engine = _engine(block_size=8)
    sched = RaggedScheduler(engine, token_budget=16)
    sched.add_request(prompt[:32], SamplingParams(max_new_tokens=1))  # caches 4 blocks of it
    sched.run_to_completion()
    uid = sched.add_request(prompt, SamplingParams(max_new_tokens=3, prompt_logprobs=2))
    events = []
    while sched.has_work:
        events += sched.step()
    assert [e.prompt_logprobs is not None for e in events] == [True, False, False]
    entries = events[0].prompt_logprobs
    assert events[0].uid == uid and len(entries) == len(prompt)
    with torch.no_grad():
        want = model(torch.tensor([prompt], device=model.device)).logits[0]
        want = want.float().log_softmax(dim=-1)
    assert entries[0] == (prompt[0], None, ())
    for t in range(1, len(prompt)):
        token, logprob, top = entries[t]
        assert token == prompt[t]
        assert logprob == pytest.approx(float(want[t - 1, prompt[t]]), abs=1e-4)
        values, ids = want[t - 1].topk(2)
        assert [i for i, _ in top] == ids.tolist()
        assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-4)
    # the tokens are those of a plain run
    assert [e.token for e in events] == _alone(prompt, SamplingParams(max_new_tokens=3))
