"""``enable_cuda_graph``: decode batches and fresh prompts padded to buckets and run on buffers
allocated once. The bucketed steps run eagerly (on CPU) give the logits of the plain ragged
forward and of Hugging Face's forward, with padding rows, padding blocks and padding prompt
tokens (which write only into the scratch block); a recording stand-in for the accelerator sees
one capture per bucket and a replay per decode batch or prompt; anywhere but CUDA (or for a
model whose forward has data-dependent shapes) the setting is refused, naming the fix."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardspeed.inference.v2 import build_hf_engine, engine_v2, graphed_decode
from shardspeed.inference.v2.graphed_decode import GraphedDecode, graph_refusal
from shardspeed.inference.v2.scheduler import RaggedScheduler, SamplingParams
from tests.inference import recording_accelerator
from tests.inference.v2 import hf_models as hm
from tests.inference.v2.test_engine_v2 import ATOL, make_engine

BLOCK = 4
# padded and unpadded batches of one engine: on CPU within 2e-6 of each other; cuBLAS may pick
# another kernel per shape, so on CUDA the engine-vs-HF tolerance
SHAPES_ATOL = ATOL if torch.cuda.is_available() else 1e-5


def _static(engine: Any, graph: bool = False, prompts: int = 256) -> GraphedDecode:
    """The engine's decode batches and fresh prompts of up to ``prompts`` tokens through
    buckets (eagerly unless ``graph``), as ``enable_cuda_graph`` sets them up on CUDA: a
    scratch block taken for good."""
    scratch = int(engine._cache.allocator.allocate(1)[0])
    engine.decode_graphs = GraphedDecode(
        engine.model, engine._cache, BLOCK, 8, engine.max_context, graph=graph,
        scratch_block=scratch, max_prompt_tokens=prompts,
    )  # fmt: skip
    return engine.decode_graphs


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral-window", "gpt2"])
def test_bucketed_decode_equals_plain_forward_and_hf(family: str) -> None:
    """3 sequences (padded to 4 rows) of contexts across block buckets, then 5 (padded to 8):
    every row equals the plain engine's and HF's logits, steps after padded ones too (the
    padding rows wrote nothing wrong into the cache)."""
    model = hm.build(family)
    plain, bucketed = make_engine(model), make_engine(model)
    static = _static(bucketed)
    seqs = {1: hm.tokens(3, 1), 2: hm.tokens(13, 2), 3: hm.tokens(30, 3)}
    for engine in (plain, bucketed):
        engine.put(list(seqs), list(seqs.values()))
    for step in range(7):
        if step == 4:  # two more sequences join (a padded prompt and a one-token one)
            new = {4: hm.tokens(6, 4), 5: hm.tokens(1, 5)}
            for engine in (plain, bucketed):
                engine.put(list(new), list(new.values()))
            seqs |= new
        nxt = {uid: hm.tokens(1, 100 * step + uid) for uid in seqs}
        want = plain.put(list(nxt), list(nxt.values()))
        got = bucketed.put(list(nxt), list(nxt.values()))
        hm.assert_close(got, want, atol=SHAPES_ATOL, rtol=0)
        for row, uid in enumerate(nxt):
            seqs[uid] = torch.cat([seqs[uid], nxt[uid]])
            hm.assert_close(got[row], hm.last_logits(model, seqs[uid]), atol=ATOL, rtol=0)
    # 3 then 5 sequences: 4 and 8 rows; contexts of 4-37 tokens: 2 to 16 blocks of 4; and
    # (1, 1): the one-token prompt beside the 6-token one
    assert {seqs for seqs, _ in static.buckets} == {1, 4, 8}
    assert {blocks for _, blocks in static.buckets} <= {1, 2, 4, 8, 16}
    assert len({blocks for _, blocks in static.buckets}) >= 2
    # prompts of 3, 13, 30 and 6 tokens: padded to 4, 16, 32 and 8 (within the 8-token window
    # alone: the longer ones need the masked path, so they run the plain forward)
    windowed = family == "mistral-window"
    assert set(static.prompt_buckets) == ({4, 8} if windowed else {4, 8, 16, 32})


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral-window", "gpt2"])
def test_mixed_steps_split_into_graphs_equal_plain_forward_and_hf(family: str) -> None:
    """Steps that mix decode tokens, fresh prompts (several in one step, lengths across
    buckets), a prompt taking a cached prefix and chunks of a long prompt: the pieces (decode
    bucket, prompt buckets, plain forward for the rest) give the plain engine's logits in the
    batch's order, and every later step still equals HF's (no padding token wrote where a
    sequence reads)."""
    model = hm.build(family)
    plain = make_engine(model, blocks=96, prefix_caching=True)
    split = make_engine(model, blocks=96, prefix_caching=True)
    static = _static(split, prompts=32)
    shared, long = hm.tokens(12, 50), hm.tokens(45, 51)
    seqs: dict[int, torch.Tensor] = {}
    steps = [
        {1: shared, 2: hm.tokens(5, 2)},  # fresh prompts only
        {1: hm.tokens(1, 3), 3: torch.cat([shared[:8], hm.tokens(9, 4)]), 2: hm.tokens(1, 5)},
        {4: long[:20], 1: hm.tokens(1, 6), 5: hm.tokens(2, 7), 3: hm.tokens(1, 8)},
        {2: hm.tokens(1, 9), 4: long[20:45], 6: hm.tokens(40, 10), 1: hm.tokens(1, 11)},
        {uid: hm.tokens(1, 20 + uid) for uid in (6, 5, 4, 3, 2, 1)},
    ]
    for step in steps:
        want = plain.put(list(step), list(step.values()))
        got = split.put(list(step), list(step.values()))
        hm.assert_close(got, want, atol=SHAPES_ATOL, rtol=0)
        for row, (uid, run) in enumerate(step.items()):
            seqs[uid] = torch.cat([seqs.get(uid, run[:0]), run])
            hm.assert_close(got[row], hm.last_logits(model, seqs[uid]), atol=ATOL, rtol=0)
    # 3 took shared's first 8 tokens from the prefix cache (2 blocks) and ran the plain
    # forward, as did long's second chunk and the 40-token prompt (over 32)
    assert split.prefix_hit_tokens == 8
    window = model.config.sliding_window if family == "mistral-window" else None
    assert static.max_prompt_tokens == min(32, window or 32)
    # prompts of 12, 5, 20 and 2 tokens (5 and 2 alone within the 8-token window)
    expected = {2, 8, 16, 32} if window is None else {2, 8}
    assert set(static.prompt_buckets) == expected
    assert split.computed_tokens == plain.computed_tokens
    # the plain forward ran in steps 2 (the prefix hit) and 4 (a chunk, a long prompt) alone;
    # with the window also in 1 and 3 (prompts of 12 and 20 tokens)
    assert (plain.eager_forwards, split.eager_forwards) == (len(steps), 4 if window else 2)


def test_prompt_padding_writes_only_the_scratch_block() -> None:
    """A 5-token prompt padded to 8: its 3 padding tokens write into the scratch block, and
    every other block keeps what the plain forward wrote."""
    model = hm.build("llama")
    plain, graphed = make_engine(model), make_engine(model)
    static = _static(graphed)
    plain._cache.allocator.allocate(1)  # the same block ids in both engines
    prompt = hm.tokens(5, 1)
    for engine in (plain, graphed):
        engine.put([1], [prompt])
    scratch = static.scratch_block
    for layer in range(graphed.model.num_layers):
        for ours, theirs in ((graphed._cache.keys, plain._cache.keys),
                             (graphed._cache.values, plain._cache.values)):  # fmt: skip
            others = [b for b in range(graphed.total_blocks) if b != scratch]
            hm.assert_close(
                ours[layer][:, others], theirs[layer][:, others], atol=SHAPES_ATOL, rtol=0
            )
            assert ours[layer][:, scratch, :3].abs().sum() > 0  # the padding landed there


def test_scheduler_tokens_equal_hf_generate() -> None:
    """Requests of different lengths, decoded through the buckets: HF generate's tokens."""
    model = hm.build("llama")
    engine = make_engine(model, blocks=96)
    _static(engine)
    scheduler = RaggedScheduler(engine, token_budget=32)
    asks = [(hm.tokens(n, 10 + n), new) for n, new in ((3, 12), (17, 6), (40, 9), (9, 1))]
    uids = [scheduler.add_request(p.tolist(), SamplingParams(max_new_tokens=m)) for p, m in asks]
    out = scheduler.run_to_completion()
    for uid, (prompt, new) in zip(uids, asks, strict=True):
        assert out[uid] == hm.greedy(model, prompt, new)
    assert engine.decode_graphs is not None and engine.decode_graphs.buckets


def test_put_returns_a_copy_of_the_bucket_output(monkeypatch) -> None:
    """A replay rewrites the bucket's output buffer: what put returns must not be that buffer
    (a caller keeping one step's logits would see them change at the next step)."""
    recording_accelerator.install(monkeypatch, graphed_decode)
    engine = make_engine(hm.build("llama"))
    graphs = _static(engine, graph=True)
    for uid, length in ((1, 5), (2, 6)):  # one prompt per put: bucket 8's output each time
        prompt = engine.put([uid], [hm.tokens(length, uid)])
        logits = graphs.prompt_buckets[8].logits
        assert logits is not None
        assert prompt.untyped_storage().data_ptr() != logits.untyped_storage().data_ptr()
    first = engine.put([1, 2], [hm.tokens(1, 3), hm.tokens(1, 4)])
    (bucket,) = graphs.buckets.values()
    assert bucket.logits is not None and graphs.replays == 3
    assert first.untyped_storage().data_ptr() != bucket.logits.untyped_storage().data_ptr()
    second = engine.put([1, 2], [hm.tokens(1, 5), hm.tokens(1, 6)])
    assert second.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()


def test_one_capture_per_bucket_and_a_replay_per_decode_batch_or_prompt(monkeypatch) -> None:
    recorder = recording_accelerator.install(monkeypatch, graphed_decode)
    engine = make_engine(hm.build("llama"), blocks=96)
    graphs = _static(engine, graph=True)
    free = engine.free_blocks
    # every decode bucket up to 4 sequences of 16 tokens (4 blocks): 3 x 3 shapes; every
    # prompt bucket up to 8 tokens: 2, 4 and 8; all written into the scratch block alone
    assert engine.capture_decode_graphs(max_sequences=4, max_context=16, max_prompt_tokens=8) == 12
    assert (recorder.created, recorder.captured, recorder.replayed) == (12, 12, 12)
    assert engine.free_blocks == free and engine.n_tracked_sequences == 0
    scratch = graphs.scratch_block
    for cache in (*engine._cache.keys, *engine._cache.values):  # blocks on dim 1, zeroed at start
        written = cache.abs().flatten(2).sum(-1).sum(0).nonzero().flatten().tolist()
        assert written == [scratch]
    assert engine.capture_decode_graphs(4, 16, 8) == 0  # all there
    engine.put([1, 2, 3], [hm.tokens(5, 1), hm.tokens(7, 2), hm.tokens(2, 3)])  # prompts
    assert (recorder.captured, recorder.replayed) == (12, 15)  # one replay per prompt
    for step in range(3):  # 3 sequences: the (4, 4) bucket, captured above
        engine.put([1, 2, 3], [hm.tokens(1, 10 + step)] * 3)
    assert (recorder.captured, recorder.replayed, graphs.replays) == (12, 18, 18)
    engine.put([1], [hm.tokens(1, 20)])  # one sequence of 8 tokens: (1, 2), also there
    assert (recorder.captured, recorder.replayed) == (12, 19)
    engine.put([1], [hm.tokens(12, 21)])  # a chunk continuing a sequence: the plain path
    assert (recorder.captured, recorder.replayed) == (12, 19)
    # 21 tokens: 8 blocks, a new shape; beside it a 9-token prompt: bucket 16, also new
    engine.put([1, 4], [hm.tokens(1, 22), hm.tokens(9, 23)])
    assert (recorder.captured, recorder.replayed) == (14, 21)
    # one memory pool for every graph: the first capture's (None here: the stand-in has none)
    assert set(recorder.pools) == {None}


def test_capture_limits_of_zero_capture_none_of_that_kind(monkeypatch) -> None:
    recorder = recording_accelerator.install(monkeypatch, graphed_decode)
    engine = make_engine(hm.build("llama"), blocks=96)
    graphs = _static(engine, graph=True)
    assert engine.capture_decode_graphs(4, 16, max_prompt_tokens=0) == 9  # decode shapes only
    assert not graphs.prompt_buckets
    assert engine.capture_decode_graphs(0, 0, max_prompt_tokens=8) == 3  # prompts 2, 4, 8
    assert engine.capture_decode_graphs(0, 0, 0) == 0
    assert recorder.captured == 12


def test_the_scratch_block_is_beside_the_sequences_blocks(monkeypatch) -> None:
    """With graphs the engine holds one block more than the cache's size for prompt padding,
    so a request that needs every configured block still runs (with the scratch block taken
    from them, the scheduler preempted it forever), and the counts exclude it."""
    monkeypatch.setattr(engine_v2, "graph_refusal", lambda model, tp: None)  # CUDA stand-in
    recording_accelerator.install(monkeypatch, graphed_decode)
    config = {
        "enable_cuda_graph": True,
        "state_manager": {
            "kv_block_size": 4,
            "max_context": 32,
            "memory_config": {"mode": "allocate", "size": 8},
        },
    }
    engine = build_hf_engine(hm.build("llama"), config)
    assert (engine.total_blocks, engine.free_blocks) == (8, 8)
    graphs = engine.decode_graphs
    assert graphs is not None
    scheduler = RaggedScheduler(engine)
    uid = scheduler.add_request(hm.tokens(30, 1).tolist(), SamplingParams(max_new_tokens=3))
    for _ in range(10):  # a prompt step and two decode steps
        if not scheduler.has_work:
            break
        scheduler.step()
    assert not scheduler.has_work and scheduler.num_preemptions == 0, uid
    assert engine.free_blocks == 8


def test_refused_off_cuda_and_for_data_dependent_models() -> None:
    config = {
        "enable_cuda_graph": True,
        "state_manager": {"memory_config": {"mode": "allocate", "size": 8}},
    }
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA graphs exist only on CUDA devices") as error:
            build_hf_engine(hm.build("llama"), config)
        assert "set enable_cuda_graph=False" in str(error.value)
    with pytest.raises(ValueError, match="Mixtral's expert routing"):
        build_hf_engine(hm.build("mixtral"), config)
    model = make_engine(hm.build("llama")).model
    assert "tp_size=2" in str(graph_refusal(model, 2))
    with pytest.raises(ValueError, match="needs enable_cuda_graph=True"):
        make_engine(hm.build("llama")).capture_decode_graphs()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_cuda_graph_logits_equal_without_graph(family: str) -> None:
    model = hm.build(family)
    plain = make_engine(model)
    graphed = build_hf_engine(
        model,
        {
            "enable_cuda_graph": True,
            "state_manager": {
                "kv_block_size": BLOCK,
                "max_context": 256,
                "memory_config": {"mode": "allocate", "size": 64},
            },
        },
    )
    assert graphed.capture_decode_graphs(max_sequences=4, max_context=64) > 0
    assert graphed.decode_graphs is not None
    captured = graphed.decode_graphs.replays  # each capture replays once
    seqs = [hm.tokens(3, 1), hm.tokens(20, 2), hm.tokens(9, 3)]
    for engine in (plain, graphed):  # three fresh prompts: three prompt graphs
        engine.put([1, 2, 3], seqs)
    for step in range(6):
        nxt = [hm.tokens(1, 10 * step + i) for i in range(3)]
        uids = [1, 2, 3]
        if step == 2:  # a new prompt beside the decode tokens: two graphs in one step
            uids, nxt = [1, 2, 3, 4], [*nxt, hm.tokens(13, 99)]
        want = plain.put(uids, nxt)
        hm.assert_close(graphed.put(uids, nxt), want, atol=1e-4, rtol=0)
    # three prompts, six decode steps and the new prompt beside one of them
    assert graphed.decode_graphs.replays == captured + 3 + 6 + 1
