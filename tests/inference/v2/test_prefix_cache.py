"""Prefix caching: sequences whose prompts share leading full blocks share those KV blocks."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest
import torch

from shardspeed.inference.v2 import InferenceEngineV2, build_hf_engine
from tests.inference.v2 import hf_models as hm

ATOL = 1e-4


def make_engine(model: Any, blocks: int, prefix_caching: bool = True) -> InferenceEngineV2:
    state = {
        "kv_block_size": 4,
        "max_context": 128,
        "prefix_caching": prefix_caching,
        "memory_config": {"mode": "allocate", "size": blocks},
    }
    return build_hf_engine(model, {"state_manager": state})


@pytest.fixture(scope="module")
def llama() -> Any:
    return hm.build("llama")


def test_shared_prefix_runs_only_the_tail(llama: Any) -> None:
    engine = make_engine(llama, blocks=32)
    prefix = hm.tokens(12, 1)  # three full blocks of 4
    a = torch.cat([prefix, hm.tokens(5, 2)])
    b = torch.cat([prefix, hm.tokens(3, 3)])
    engine.put([1], [a])
    assert engine.prefix_index_size == 4  # a's 17 tokens fill four blocks
    assert engine.prefix_match(b) == 12 and engine.prefix_match(prefix) == 8  # last token runs
    assert engine.prefix_match(hm.tokens(12, 9)) == 0
    free, computed = engine.free_blocks, engine.computed_tokens
    logits = engine.put([2], [b])
    assert engine.computed_tokens - computed == 3 and engine.prefix_hit_tokens == 12
    assert free - engine.free_blocks == 1  # 15 tokens in 4 blocks, 3 of them shared
    torch.testing.assert_close(logits[0], hm.last_logits(llama, b), atol=ATOL, rtol=0)
    # both keep decoding correctly: the shared blocks are never written
    seqs = {1: a, 2: b}
    for step in range(6):
        runs = {uid: hm.tokens(1, 100 + 2 * step + uid) for uid in seqs}
        out = engine.put(list(runs), list(runs.values()))
        for row, uid in enumerate(runs):
            seqs[uid] = torch.cat([seqs[uid], runs[uid]])
            torch.testing.assert_close(
                out[row], hm.last_logits(llama, seqs[uid]), atol=ATOL, rtol=0
            )
    free = engine.free_blocks
    engine.flush(1)  # 23 tokens: 6 blocks, 3 still held by sequence 2
    assert engine.free_blocks == free + 3
    assert engine.prefix_match(b) == 12  # the shared blocks stay indexed while held
    engine.flush(2)
    assert engine.free_blocks == engine.total_blocks and engine.prefix_index_size == 0
    assert engine.prefix_match(b) == 0


def test_prefix_caching_off(llama: Any) -> None:
    engine = make_engine(llama, blocks=32, prefix_caching=False)
    prefix = hm.tokens(12, 1)
    engine.put([1], [torch.cat([prefix, hm.tokens(5, 2)])])
    b = torch.cat([prefix, hm.tokens(3, 3)])
    assert engine.prefix_match(b) == 0
    computed = engine.computed_tokens
    torch.testing.assert_close(engine.put([2], [b])[0], hm.last_logits(llama, b), atol=ATOL, rtol=0)
    assert engine.computed_tokens - computed == 15 and engine.prefix_hit_tokens == 0


def _check_holders(engine: InferenceEngineV2) -> None:
    """Every block's reference count equals the number of live sequences holding it."""
    state = engine._state
    holders = Counter(b for uid in list(state._seqs) for b in state._seqs[uid].block_ids)
    allocator = engine._cache.allocator
    for block in range(engine.total_blocks):
        assert allocator.ref_count(block) == holders.get(block, 0), block
    assert engine.free_blocks == engine.total_blocks - len(holders)


def test_random_put_flush_never_leaks() -> None:
    """1,000 sequences drawn from a few shared prefixes, put (prompts and decode tokens mixed)
    and flushed in random order: reference counts always equal holders, a sample of logits
    equals HF's, and at the end every block is free and the index is empty."""
    model = hm.build("llama", num_hidden_layers=1)
    engine = make_engine(model, blocks=128)
    rng = random.Random(0)
    prefixes = [hm.tokens(n, 200 + n) for n in (4, 8, 9, 13, 20)]
    live: dict[int, torch.Tensor] = {}
    started = puts = 0
    while started < 1000 or live:
        batch: dict[int, torch.Tensor] = {}
        for uid in rng.sample(sorted(live), k=min(len(live), rng.randint(0, 3))):
            batch[uid] = hm.tokens(rng.randint(1, 2), rng.randrange(1 << 30))
        for _ in range(rng.randint(0, 3) if started < 1000 and len(live) < 10 else 0):
            prefix = prefixes[rng.randrange(len(prefixes))]
            tail = hm.tokens(rng.randint(1, 6), rng.randrange(1 << 30))
            batch[started] = torch.cat([prefix, tail]) if rng.random() < 0.8 else tail
            started += 1
        if batch:
            out = engine.put(list(batch), list(batch.values()))
            puts += 1
            for uid, run in batch.items():
                live[uid] = torch.cat([live.get(uid, run[:0]), run])
            if puts % 40 == 0:
                uid = next(iter(batch))
                want = hm.last_logits(model, live[uid])
                torch.testing.assert_close(out[0], want, atol=ATOL, rtol=0)
        for uid in [u for u in live if live[u].numel() > 30 or rng.random() < 0.3]:
            engine.flush(uid)
            del live[uid]
        _check_holders(engine)
        if started >= 1000 and not batch:
            for uid in list(live):
                engine.flush(uid)
                del live[uid]
    assert engine.prefix_hit_tokens > 1000  # sharing happened
    assert engine.free_blocks == engine.total_blocks
    assert engine.prefix_index_size == 0 and engine.n_tracked_sequences == 0
