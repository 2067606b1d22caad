"""``enable_cuda_graph``: decode batches padded to buckets and run on buffers allocated once.
The bucketed step run eagerly (on CPU) gives the logits of the plain ragged forward and of
Hugging Face's forward, with padding rows and padding blocks; a recording stand-in for the
accelerator sees one capture per bucket and a replay per decode step; anywhere but CUDA (or
for a model whose forward has data-dependent shapes) the setting is refused, naming the fix."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardspeed.inference.v2 import build_hf_engine, graphed_decode
from shardspeed.inference.v2.graphed_decode import GraphedDecode, graph_refusal
from shardspeed.inference.v2.scheduler import RaggedScheduler, SamplingParams
from tests.inference import recording_accelerator
from tests.inference.v2 import hf_models as hm
from tests.inference.v2.test_engine_v2 import ATOL, make_engine

BLOCK = 4


def _static(engine: Any, graph: bool = False) -> GraphedDecode:
    """The engine's decode batches through buckets (eagerly unless ``graph``)."""
    engine.decode_graphs = GraphedDecode(
        engine.model, engine._cache, BLOCK, 8, engine.max_context, graph=graph
    )
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
        if step == 4:  # two more sequences join (prompts: the plain ragged path)
            new = {4: hm.tokens(6, 4), 5: hm.tokens(1, 5)}
            for engine in (plain, bucketed):
                engine.put(list(new), list(new.values()))
            seqs |= new
        nxt = {uid: hm.tokens(1, 100 * step + uid) for uid in seqs}
        want = plain.put(list(nxt), list(nxt.values()))
        got = bucketed.put(list(nxt), list(nxt.values()))
        hm.assert_close(got, want, atol=1e-5, rtol=0)
        for row, uid in enumerate(nxt):
            seqs[uid] = torch.cat([seqs[uid], nxt[uid]])
            hm.assert_close(got[row], hm.last_logits(model, seqs[uid]), atol=ATOL, rtol=0)
    # 3 then 5 sequences: 4 and 8 rows; contexts of 4-37 tokens: 2 to 16 blocks of 4
    assert {seqs for seqs, _ in static.buckets} == {4, 8}
    assert {blocks for _, blocks in static.buckets} <= {2, 4, 8, 16}
    assert len({blocks for _, blocks in static.buckets}) >= 2


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
    engine.put([1, 2], [hm.tokens(5, 1), hm.tokens(6, 2)])
    first = engine.put([1, 2], [hm.tokens(1, 3), hm.tokens(1, 4)])
    (bucket,) = graphs.buckets.values()
    assert bucket.logits is not None and graphs.replays == 1
    assert first.untyped_storage().data_ptr() != bucket.logits.untyped_storage().data_ptr()
    second = engine.put([1, 2], [hm.tokens(1, 5), hm.tokens(1, 6)])
    assert second.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()


def test_one_capture_per_bucket_and_a_replay_per_decode_step(monkeypatch) -> None:
    recorder = recording_accelerator.install(monkeypatch, graphed_decode)
    engine = make_engine(hm.build("llama"), blocks=96)
    graphs = _static(engine, graph=True)
    free = engine.free_blocks
    # every bucket up to 4 sequences of 16 tokens (4 blocks): 3 x 3 shapes, the KV block the
    # captures wrote to given back
    assert engine.capture_decode_graphs(max_sequences=4, max_context=16) == 9
    assert (recorder.created, recorder.captured, recorder.replayed) == (9, 9, 9)
    assert engine.free_blocks == free and engine.n_tracked_sequences == 0
    assert engine.capture_decode_graphs(max_sequences=4, max_context=16) == 0  # all there
    engine.put([1, 2, 3], [hm.tokens(5, 1), hm.tokens(7, 2), hm.tokens(2, 3)])  # prompts
    assert recorder.replayed == 9
    for step in range(3):  # 3 sequences: the (4, 4) bucket, captured above
        engine.put([1, 2, 3], [hm.tokens(1, 10 + step)] * 3)
    assert (recorder.captured, recorder.replayed, graphs.replays) == (9, 12, 12)
    engine.put([1], [hm.tokens(1, 20)])  # one sequence of 8 tokens: (1, 2), also there
    assert (recorder.captured, recorder.replayed) == (9, 13)
    engine.put([1], [hm.tokens(12, 21)])  # a chunk: the plain path
    engine.put([1], [hm.tokens(1, 22)])  # 21 tokens: 8 blocks, a new shape
    assert (recorder.captured, recorder.replayed) == (10, 14)
    # one memory pool for every graph: the first capture's (None here: the stand-in has none)
    assert set(recorder.pools) == {None}


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
    seqs = [hm.tokens(3, 1), hm.tokens(20, 2), hm.tokens(9, 3)]
    for engine in (plain, graphed):
        engine.put([1, 2, 3], seqs)
    for step in range(6):
        nxt = [hm.tokens(1, 10 * step + i) for i in range(3)]
        want = plain.put([1, 2, 3], nxt)
        hm.assert_close(graphed.put([1, 2, 3], nxt), want, atol=1e-4, rtol=0)
    assert graphed.decode_graphs is not None and graphed.decode_graphs.replays == 6
