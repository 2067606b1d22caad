"""Prefix caching: sequences whose prompts share leading full blocks share those KV blocks, and
indexed blocks stay cached (LRU, evicted on demand) after their last holder is flushed."""

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
    hm.assert_close(logits[0], hm.last_logits(llama, b), atol=ATOL, rtol=0)
    # both keep decoding correctly: the shared blocks are never written
    seqs = {1: a, 2: b}
    for step in range(6):
        runs = {uid: hm.tokens(1, 100 + 2 * step + uid) for uid in seqs}
        out = engine.put(list(runs), list(runs.values()))
        for row, uid in enumerate(runs):
            seqs[uid] = torch.cat([seqs[uid], runs[uid]])
            hm.assert_close(out[row], hm.last_logits(llama, seqs[uid]), atol=ATOL, rtol=0)
    free = engine.free_blocks
    engine.flush(1)  # 23 tokens: 6 blocks, 3 still held by sequence 2, 2 full ones cached
    assert engine.free_blocks == free + 3 and engine.cached_blocks == 2
    assert engine.prefix_match(b) == 12  # the shared blocks stay indexed while held
    engine.flush(2)
    assert engine.free_blocks == engine.total_blocks
    assert engine.prefix_match(b) == 12  # ... and after their last holder is gone
    cached = engine.cached_blocks
    assert cached == engine.prefix_index_size == 7  # a's five full blocks, b's own two
    assert engine.clear_prefix_cache() == cached
    assert engine.prefix_index_size == 0 and engine.cached_blocks == 0
    assert engine._cache.allocator.free_blocks == engine.total_blocks
    assert engine.prefix_match(b) == 0


def test_prefix_caching_off(llama: Any) -> None:
    engine = make_engine(llama, blocks=32, prefix_caching=False)
    prefix = hm.tokens(12, 1)
    engine.put([1], [torch.cat([prefix, hm.tokens(5, 2)])])
    b = torch.cat([prefix, hm.tokens(3, 3)])
    assert engine.prefix_match(b) == 0
    computed = engine.computed_tokens
    hm.assert_close(engine.put([2], [b])[0], hm.last_logits(llama, b), atol=ATOL, rtol=0)
    assert engine.computed_tokens - computed == 15 and engine.prefix_hit_tokens == 0


def _check_holders(engine: InferenceEngineV2) -> None:
    """Every block's reference count equals the number of live sequences holding it, plus one
    for a cached, unreferenced block (the prefix cache's own hold); no block is both."""
    state = engine._state
    holders = Counter(b for uid in list(state._seqs) for b in state._seqs[uid].block_ids)
    cached = set(state._lru)
    assert not cached & set(holders)
    assert cached <= set(state._key_of_block)
    # the chain: every indexed block's parent is indexed and lists it as a child, and back
    children = {(p, c) for p, kids in state._children.items() for c in kids}
    chained = {(key[0], b) for b, key in state._key_of_block.items() if key[0] != -1}
    assert children == chained and {p for p, _ in chained} <= set(state._key_of_block)
    assert {state._index[key] for key in state._key_of_block.values()} == set(state._key_of_block)
    allocator = engine._cache.allocator
    for block in range(engine.total_blocks):
        assert allocator.ref_count(block) == holders.get(block, 0) + (block in cached), block
    assert engine.cached_blocks == len(cached)
    assert engine.free_blocks == engine.total_blocks - len(holders)
    assert allocator.free_blocks == engine.total_blocks - len(holders) - len(cached)


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
                hm.assert_close(out[0], want, atol=ATOL, rtol=0)
        for uid in [u for u in live if live[u].numel() > 30 or rng.random() < 0.3]:
            engine.flush(uid)
            del live[uid]
        _check_holders(engine)
        if started >= 1000 and not batch:
            for uid in list(live):
                engine.flush(uid)
                del live[uid]
    assert engine.prefix_hit_tokens > 1000  # sharing happened
    assert engine.evicted_blocks > 0  # the cache filled up and evicted
    assert engine.free_blocks == engine.total_blocks and engine.n_tracked_sequences == 0
    assert engine.cached_blocks == engine.prefix_index_size > 0  # all cached, none held
    engine.clear_prefix_cache()
    assert engine.prefix_index_size == 0 and engine.cached_blocks == 0
    assert engine._cache.allocator.free_blocks == engine.total_blocks


def _ref(engine: InferenceEngineV2, block: int) -> int:
    return engine._cache.allocator.ref_count(block)


def test_flushed_prompt_is_reused(llama: Any) -> None:
    """A prompt put and flushed, then the same prompt plus a new tail: only the tail is
    computed (its blocks were kept, cached and unreferenced), and the logits equal HF's."""
    engine = make_engine(llama, blocks=16)
    prompt = hm.tokens(12, 21)  # three full blocks of 4
    engine.put([1], [prompt])
    blocks = list(engine._state.get_sequence(1).block_ids)
    engine.flush(1)
    assert engine.cached_blocks == 3 and engine.free_blocks == engine.total_blocks
    assert [_ref(engine, b) for b in blocks] == [1, 1, 1]  # the cache's own hold
    longer = torch.cat([prompt, hm.tokens(5, 22)])
    assert engine.prefix_match(longer) == 12
    computed, free = engine.computed_tokens, engine._cache.allocator.free_blocks
    logits = engine.put([2], [longer])
    assert engine.computed_tokens - computed == 5 and engine.prefix_hit_tokens == 12
    assert engine._state.get_sequence(2).block_ids[:3] == blocks  # adopted, 0 -> 1 holder
    assert engine.cached_blocks == 0 and [_ref(engine, b) for b in blocks] == [1, 1, 1]
    assert free - engine._cache.allocator.free_blocks == 2  # only the tail's two blocks
    hm.assert_close(logits[0], hm.last_logits(llama, longer), atol=ATOL, rtol=0)
    out = engine.put([2], [hm.tokens(1, 23)])  # decoding on top of the adopted blocks
    want = hm.last_logits(llama, torch.cat([longer, hm.tokens(1, 23)]))
    hm.assert_close(out[0], want, atol=ATOL, rtol=0)
    engine.flush(2)
    # caching off: a flushed prompt leaves nothing behind
    off = make_engine(llama, blocks=16, prefix_caching=False)
    off.put([1], [prompt])
    off.flush(1)
    assert off.cached_blocks == 0 and off.prefix_match(longer) == 0
    assert off._cache.allocator.free_blocks == off.total_blocks


def test_full_cache_evicts_least_recently_used(llama: Any) -> None:
    """With every block cached, new sequences are still admitted: the least recently released
    blocks are evicted first, and adopting a cached prompt makes it recent again."""
    engine = make_engine(llama, blocks=8)
    prompts = {name: hm.tokens(8, 30 + i) for i, name in enumerate("abcd")}
    for uid, name in enumerate("abcd"):
        engine.put([uid], [prompts[name]])  # two full blocks each
        engine.flush(uid)
    assert engine.cached_blocks == 8 and engine._cache.allocator.free_blocks == 0
    assert engine.free_blocks == engine.total_blocks  # what the scheduler admits against
    assert engine.can_schedule([10], [8]).name == "Success"

    def cached(name: str) -> bool:
        return engine.prefix_match(torch.cat([prompts[name], hm.tokens(1, 99)])) == 8

    # re-using a's blocks makes them recent (b becomes the oldest); the new token's block
    # evicts b's tail, the next two blocks b's head (one was freed by flushing 4)
    engine.put([4], [torch.cat([prompts["a"], hm.tokens(1, 40)])])
    engine.flush(4)
    engine.put([5], [hm.tokens(8, 41)])
    assert engine.evicted_blocks == 2
    assert not cached("b") and cached("a") and cached("c") and cached("d")
    engine.flush(5)
    x = hm.tokens(13, 42)
    logits = engine.put([6], [x])  # four blocks: c's two, then d's two
    hm.assert_close(logits[0], hm.last_logits(llama, x), atol=ATOL, rtol=0)
    assert engine.evicted_blocks == 6
    assert not cached("c") and not cached("d") and cached("a")
    _check_holders(engine)
    # more blocks than free + cached: refused before anything changes
    index = engine.prefix_index_size
    with pytest.raises(ValueError, match="KV"):
        engine.put([7], [hm.tokens(20, 43)])
    assert engine.prefix_index_size == index and not engine.tracked(7)
    engine.flush(6)
    _check_holders(engine)


def test_stale_chain_never_matches(llama: Any) -> None:
    """Evicting a parent evicts the blocks chained under it: once the parent's id is reused for
    other tokens, the old child (keyed by the parent's block id) must not match under it."""
    engine = make_engine(llama, blocks=8)
    prompt = hm.tokens(9, 50)
    engine.put([1], [prompt])
    parent, child = engine._state.get_sequence(1).block_ids[:2]
    engine.flush(1)
    state = engine._state
    # LRU order always puts a child before its parent (a parent is released with or after its
    # children); evict the parent first anyway, as a defence must hold without that order
    state._lru.move_to_end(parent, last=False)
    assert state.evict(engine.total_blocks - 1) == 2  # one asked for: parent and child went
    assert state.prefix_index_size == 0 and engine.evicted_blocks == 2
    free_stack = engine._cache.allocator._free
    free_stack.remove(parent)
    free_stack.append(parent)  # the next allocation reuses the parent's id
    other = hm.tokens(4, 52)
    engine.put([3], [torch.cat([other, hm.tokens(1, 53)])])
    assert state.get_sequence(3).block_ids[0] == parent  # the parent's id, other tokens
    probe = torch.cat([other, prompt[4:]])
    assert engine.prefix_match(probe) == 4  # ``other``'s block only, never the stale child
    out = engine.put([4], [probe])
    hm.assert_close(out[0], hm.last_logits(llama, probe), atol=ATOL, rtol=0)


def test_private_parent_chain_not_indexed(llama: Any) -> None:
    """Two sequences race on one prompt: the loser's blocks are private and nothing is chained
    under them, so when the loser's first block id is reused for other tokens no later prompt
    can reach the loser's second block through it."""
    engine = make_engine(llama, blocks=6)
    prompt = hm.tokens(9, 60)
    engine.put([1, 2], [prompt, prompt])
    loser = engine._state.get_sequence(2).block_ids
    engine.flush(1)
    engine.clear_prefix_cache()  # the winner's blocks go; only the loser holds the prompt
    engine.flush(2)  # the loser's blocks: private -> free, not cached
    assert engine.cached_blocks == 0 and engine.prefix_index_size == 0
    # the freed ids are reused (most recently freed first) for other tokens
    other = hm.tokens(4, 61)
    engine.put([3], [torch.cat([other, hm.tokens(1, 62)])])
    assert engine._state.get_sequence(3).block_ids[0] in loser
    probe = torch.cat([other, prompt[4:]])
    assert engine.prefix_match(probe) == 4
    out = engine.put([4], [probe])
    hm.assert_close(out[0], hm.last_logits(llama, probe), atol=ATOL, rtol=0)


def test_a_batch_adopts_its_cached_prefixes_before_anything_evicts_them(llama: Any) -> None:
    """No plain block free, two cached chains (x's older than w's), and one batch where an
    existing sequence's decode token needs a block while a new sequence extends x's prompt: the
    new sequence takes x's blocks before the decode's reservation evicts the oldest chain (w's
    goes instead), so it computes 1 token, as the batch check counted, not 9."""
    engine = make_engine(llama, blocks=7)
    x, w, y = hm.tokens(8, 40), hm.tokens(8, 41), hm.tokens(12, 42)
    engine.put([1], [x])
    engine.flush(1)
    engine.put([2], [w])
    engine.flush(2)
    engine.put([3], [y])  # three full blocks: its next token needs a fourth
    assert engine.cached_blocks == 4 and engine.free_blocks == 4  # cached ones count as free
    hits, computed = engine.prefix_hit_tokens, engine.computed_tokens
    extended = torch.cat([x, hm.tokens(1, 43)])
    logits = engine.put([3, 4], [hm.tokens(1, 44), extended])
    assert engine.prefix_hit_tokens - hits == 8
    assert engine.computed_tokens - computed == 2
    hm.assert_close(logits[1], hm.last_logits(llama, extended), atol=ATOL, rtol=0)
