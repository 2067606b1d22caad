"""The fast paths of paged attention give the general path's results: decode-only batches (one
query row per sequence), decode sequences bucketed by context length, and fresh prefills that
attend causally to their own keys/values; the engine's rotary table gives the rotary module's
values; and batches that take these paths stay equal to Hugging Face on every family."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from shardspeed.inference.v2.ragged import (
    BlockedKVCache,
    RaggedBatchMetadata,
    SequenceDescriptor,
    paged_attention,
)
from tests.inference.v2 import hf_models as hm
from tests.inference.v2.test_engine_v2 import ATOL, FAMILIES, make_engine
from tests.inference.v2.test_paged_attention import _dense_reference

HEAD_DIM = 8


def _filled_cache(
    plan: list[tuple[int, int]], block: int, kv_heads: int
) -> tuple[BlockedKVCache, list[SequenceDescriptor], list[torch.Tensor], list[torch.Tensor]]:
    """A cache holding each ``(seen, new)`` sequence's seen and new keys/values (random),
    blocks fragmented so tables are not runs."""
    cache = BlockedKVCache(
        num_layers=1, num_blocks=512, block_size=block, kv_heads=kv_heads, head_dim=HEAD_DIM
    )
    junk = cache.allocator.allocate(60)
    cache.allocator.free(junk[torch.randperm(60)[:45]])
    seqs, keys, values = [], [], []
    for uid, (seen, new) in enumerate(plan):
        seq = SequenceDescriptor(uid)
        k = torch.randn(seen + new, kv_heads, HEAD_DIM)
        v = torch.randn(seen + new, kv_heads, HEAD_DIM)
        cache.reserve(seq, seen + new)
        cache.write(0, seq.slots(seen + new, block), k, v)
        seq.seen_tokens = seen
        seqs.append(seq)
        keys.append(k)
        values.append(v)
    return cache, seqs, keys, values


def _check_dense(out: torch.Tensor, q: torch.Tensor, plan: list[tuple[int, int]], keys, values):
    start = 0
    for (seen, new), k, v in zip(plan, keys, values, strict=True):
        want = _dense_reference(q[start : start + new], k, v, seen)
        hm.assert_close(out[start : start + new], want, atol=1e-5, rtol=0)
        start += new


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_decode_path_and_length_buckets(heads: int, kv_heads: int) -> None:
    torch.manual_seed(kv_heads)
    block = 4
    # one decode token each, contexts from 1 to ~600 tokens: worth splitting by length
    plan = [(seen, 1) for seen in (0, 3, 17, 40, 90, 150, 260, 300, 420, 599, 5, 2)]
    cache, seqs, keys, values = _filled_cache(plan, block, kv_heads)
    args = ([s.seen_tokens for s in seqs], [1] * len(plan), [s.block_ids for s in seqs], block)
    bucketed = RaggedBatchMetadata.build(*args)
    whole = RaggedBatchMetadata.build(*args, split=False)
    assert whole.decode and not whole.parts
    assert len(bucketed.parts) >= 2 and all(p.decode for _, p in bucketed.parts)
    # buckets hold sequences of similar length: fewer padded keys than one batch
    padded = sum(p.block_tables.numel() for _, p in bucketed.parts)
    assert padded * 10 < whole.block_tables.numel() * 6
    assert sorted(torch.cat([i for i, _ in bucketed.parts]).tolist()) == list(range(len(plan)))
    # on an accelerator a step is launch-bound: decode tokens stay in one attention call there
    # (the metadata built for the meta device stands in for one)
    assert not RaggedBatchMetadata.build(*args, device="meta").parts
    general = dataclasses.replace(whole, decode=False)  # the general path, one row each

    q = torch.randn(len(plan), heads, HEAD_DIM)
    outs = [paged_attention(q, cache.keys[0], cache.values[0], m) for m in (bucketed, whole)]
    reference = paged_attention(q, cache.keys[0], cache.values[0], general)
    for out in outs:
        hm.assert_close(out, reference, atol=1e-5, rtol=0)
    _check_dense(outs[0], q, plan, keys, values)


def test_close_lengths_are_not_split() -> None:
    tables = [[b] for b in range(8)]
    assert not RaggedBatchMetadata.build([1] * 8, [1] * 8, tables, 4).parts


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_fresh_prefill_path(heads: int, kv_heads: int) -> None:
    torch.manual_seed(heads + kv_heads)
    block = 4
    plan = [(0, 13), (0, 1), (0, 7), (0, 30)]
    cache, seqs, keys, values = _filled_cache(plan, block, kv_heads)
    meta = RaggedBatchMetadata.build(
        [0] * len(plan), [n for _, n in plan], [s.block_ids for s in seqs], block, split=False
    )
    assert meta.fresh
    q = torch.randn(meta.num_tokens, heads, HEAD_DIM)
    out = paged_attention(q, cache.keys[0], cache.values[0], meta)
    general = paged_attention(
        q, cache.keys[0], cache.values[0], dataclasses.replace(meta, fresh=False)
    )
    hm.assert_close(out, general, atol=1e-6, rtol=0)
    _check_dense(out, q, plan, keys, values)
    # a cached prefix anywhere in the batch rules the causal-only path out
    assert not RaggedBatchMetadata.build([0, 4], [3, 2], [[1], [2, 3]], block).fresh


def test_rotary_table_equals_the_module() -> None:
    model = hm.build("llama")
    engine = make_engine(model)
    lm = engine.model
    device = lm.device  # the table the engine uses: on its device
    hidden = torch.zeros(5, 64, device=device)
    positions = torch.tensor([0, 7, 3, 300, 2], device=device)
    cos, sin = lm._rotary(hidden, positions, 300)
    want_cos, want_sin = lm.base.rotary_emb(hidden[None], positions[None])
    hm.assert_close(cos, want_cos[0], atol=1e-7, rtol=0)
    hm.assert_close(sin, want_sin[0], atol=1e-7, rtol=0)
    # grows past its first size
    far = torch.tensor([511], device=device)
    cos, _ = lm._rotary(hidden[:1], far, 511)
    hm.assert_close(cos, lm.base.rotary_emb(hidden[None, :1], far[None])[0][0])


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request: pytest.FixtureRequest) -> tuple[str, Any]:
    return request.param, hm.build(request.param)


def test_bucketed_decode_and_fresh_prefill_match_hf(family_model: tuple[str, Any]) -> None:
    """Fresh prompts of very different lengths in one put, then decode tokens for all of them in
    one put (bucketed by context length): every row equals HF's logits of that sequence."""
    family, model = family_model
    engine = make_engine(model, blocks=256, block=4, max_context=512, max_ragged_batch_size=1024)
    lengths = [2, 9, 30, 70, 120, 300, 400]
    # the decode puts below are split by context length on CPU; elsewhere they stay whole
    tables = [[0] * (n // 4 + 1) for n in lengths]
    device = engine.model.device
    parts = RaggedBatchMetadata.build(lengths, [1] * 7, tables, 4, device=device).parts
    assert len(parts) >= 2 if device.type == "cpu" else not parts
    seqs = {uid: hm.tokens(n, 40 + uid) for uid, n in enumerate(lengths)}
    logits = engine.put(list(seqs), list(seqs.values()))
    for row, ids in enumerate(seqs.values()):
        hm.assert_close(logits[row], hm.last_logits(model, ids), atol=ATOL, rtol=0)
    for step in range(2):
        nxt = {uid: hm.tokens(1, 100 + 10 * step + uid) for uid in seqs}
        logits = engine.put(list(nxt), list(nxt.values()))
        for row, uid in enumerate(nxt):
            seqs[uid] = torch.cat([seqs[uid], nxt[uid]])
            want = hm.last_logits(model, seqs[uid])
            hm.assert_close(logits[row], want, atol=ATOL, rtol=0)


def test_fresh_prompts_split_from_continued_chunks() -> None:
    torch.manual_seed(3)
    block, heads, kv_heads = 4, 4, 2
    plan = [(9, 20), (0, 100), (30, 1), (0, 60), (3, 1)]
    cache, seqs, keys, values = _filled_cache(plan, block, kv_heads)
    args = ([s for s, _ in plan], [n for _, n in plan], [s.block_ids for s in seqs], block)
    split = RaggedBatchMetadata.build(*args)
    fresh_parts = [p for _, p in split.parts if p.fresh]
    assert [p.query_index.shape for p in fresh_parts] == [(2, 100)]
    q = torch.randn(split.num_tokens, heads, HEAD_DIM)
    out = paged_attention(q, cache.keys[0], cache.values[0], split)
    whole = RaggedBatchMetadata.build(*args, split=False)
    assert not whole.fresh
    hm.assert_close(
        out, paged_attention(q, cache.keys[0], cache.values[0], whole), atol=1e-6, rtol=0
    )
    _check_dense(out, q, plan, keys, values)
