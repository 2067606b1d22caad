"""Paged attention for a ragged batch in plain PyTorch.

A ragged batch is the flat run of new tokens of several sequences (a prefill chunk of one, a
single decode token of another, ...), each sequence with its own number of tokens already in the
blocked KV cache. Each layer writes the new tokens' keys/values into the cache first, then
attends, per group of sequences (``RaggedBatchMetadata.parts``):

* decode tokens (one per sequence, bucketed by context length): each sequence's key blocks are
  gathered whole into a padded (sequences, kv_heads, context, head_dim) batch, then a matmul
  and a softmax with the padding masked; on CPU in float32 the values are summed straight from
  the cache by those weights (one ``embedding_bag``), elsewhere gathered too and multiplied
  (SDPA below float32);
* fresh prompts (nothing cached): one causal SDPA call per sequence over its own new keys;
* anything else (prompt chunks continuing a cached prefix): the same padded gather and one SDPA
  call with a mask that is causal at each sequence's own offset and hides the padding.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = [
    "RaggedBatchMetadata",
    "host_to_device",
    "paged_attention",
    "private_workspace",
    "ragged_sdpa_backends",
]

# SDPA's kernels for ragged batches on CUDA: cuDNN's is left out. It builds an execution plan
# for every new input shape (about half a second each), and a ragged batch brings a new shape
# at almost every step: on an H200 in bf16, with cuDNN allowed, inter-token latency p99 was
# 563 ms (benchmarks/bench_serving.py at 100 requests/s)
_RAGGED_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@contextlib.contextmanager
def ragged_sdpa_backends(device: torch.device) -> Iterator[None]:
    """Within it, SDPA on ``device`` picks among the kernels that need no per-shape plan (flash,
    memory-efficient, math); elsewhere than CUDA it changes nothing."""
    if device.type != "cuda":
        yield
        return
    with sdpa_kernel(_RAGGED_BACKENDS):
        yield


@dataclass(frozen=True)
class RaggedBatchMetadata:
    """What every layer of one forward pass needs about the ragged batch, built once per step.

    ``positions`` (tokens,): each new token's position in its sequence (for rotary embeddings).
    ``slots`` (tokens,): its cache slot, ``block * block_size + offset``.
    ``query_index`` (sequences, max_new): flat token index of each sequence's i-th new token
    (padding rows point at token 0 and are discarded).
    ``token_seq``/``token_offset`` (tokens,): where each flat token sits in the padded batch.
    ``block_tables`` (sequences, max_blocks): block ids, padded with block 0 (masked).
    ``mask`` (sequences, 1, max_new, max_blocks * block_size): True where a query may attend
    (no query rows when ``parts`` split the batch: each part has its own).
    ``parts``: when the batch mixes single-token (decode) sequences with longer runs, each
    group's flat token indices and its own metadata; attention then runs per group, so a decode
    token is not padded to the longest prompt chunk's number of query rows. Single-token
    sequences whose contexts differ much in length are split further by context length, so a
    short context is not gathered (and attended) padded to the longest one.
    ``decode``: every sequence brings one new token (attention takes one query row each).
    ``fresh``: no sequence has cached tokens and the mask is plain causal, so each sequence's
    keys/values are exactly its new tokens' (no padded context gathered from the cache).
    ``new_counts`` (host ints): each sequence's number of new tokens; ``max_position`` (host
    int): the largest position of a new token; ``last_rows`` (sequences,): each sequence's last
    flat token (None for a decode batch, where row s is sequence s). Known on the host when the
    batch is built, so the forward never waits on the device to learn them.
    """

    positions: torch.Tensor
    slots: torch.Tensor
    query_index: torch.Tensor
    token_seq: torch.Tensor
    token_offset: torch.Tensor
    block_tables: torch.Tensor
    mask: torch.Tensor
    block_size: int
    parts: tuple[tuple[torch.Tensor, RaggedBatchMetadata], ...] = ()
    decode: bool = False
    fresh: bool = False
    new_counts: tuple[int, ...] = ()
    max_position: int = 0
    last_rows: torch.Tensor | None = None
    # per-step memo shared by every layer (gather indices by kv head count); not an init field,
    # so dataclasses.replace (e.g. a windowed copy) starts a fresh one
    memo: dict[Any, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        """How many new tokens the batch has in all."""
        return int(self.positions.numel())

    @classmethod
    def build(
        cls,
        seen_tokens: Sequence[int],
        new_tokens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        split: bool = True,
    ) -> RaggedBatchMetadata:
        """Metadata of a batch whose sequence ``s`` has ``seen_tokens[s]`` tokens cached and
        ``new_tokens[s]`` (>= 1) new ones in the flat token run (sequence 0's first), its
        tokens held by ``block_tables[s]``; with ``split``, a batch that mixes single-token and
        longer runs (or whose single-token contexts differ much in length) also gets per-group
        ``parts``."""
        if not len(seen_tokens) == len(new_tokens) == len(block_tables) >= 1:
            raise ValueError(
                "seen_tokens, new_tokens and block_tables need one entry per sequence and at "
                f"least one sequence; got {len(seen_tokens)}, {len(new_tokens)} and "
                f"{len(block_tables)}."
            )
        for s, (seen, new, table) in enumerate(
            zip(seen_tokens, new_tokens, block_tables, strict=True)
        ):
            if seen < 0 or new < 1:
                raise ValueError(
                    f"sequence {s}: seen_tokens must be >= 0 and new_tokens >= 1, got {seen} "
                    f"and {new}."
                )
            if seen + new > len(table) * block_size:
                raise ValueError(
                    f"sequence {s}: {seen + new} tokens do not fit its {len(table)} block(s) of "
                    f"{block_size}; reserve blocks first."
                )
        max_blocks = max(len(t) for t in block_tables)
        # one tensor from padded lists: a copy per sequence costs more than the whole batch
        tables = torch.tensor(
            [_ints(t) + [0] * (max_blocks - len(t)) for t in block_tables], dtype=torch.int64
        )
        seen_t = torch.tensor(list(seen_tokens), dtype=torch.int64)
        new_t = torch.tensor(list(new_tokens), dtype=torch.int64)
        groups = []
        if split:
            buckets = _max_decode_buckets(device)
            groups = _groups(seen_tokens, new_tokens, block_tables, block_size, buckets)
        parts: list[tuple[torch.Tensor, RaggedBatchMetadata]] = []
        if groups:
            starts = torch.cumsum(new_t, 0) - new_t
            for group in groups:
                g = torch.tensor(group, dtype=torch.int64)
                news = [new_tokens[s] for s in group]
                if max(news) == 1:
                    index = starts[g]  # one flat token per sequence
                else:
                    counts = new_t[g]
                    first = torch.cumsum(counts, 0) - counts
                    index = torch.arange(int(counts.sum())) + torch.repeat_interleave(
                        starts[g] - first, counts
                    )
                blocks = max(len(block_tables[s]) for s in group)
                sub = cls._from_tensors(
                    seen_t[g],
                    new_t[g],
                    tables[g, :blocks],
                    block_size,
                    max_new=max(news),
                    fresh=not any(seen_tokens[s] for s in group),
                )
                parts.append((index, sub))
        meta = cls._from_tensors(
            seen_t,
            new_t,
            tables,
            block_size,
            max_new=max(new_tokens),
            fresh=not any(seen_tokens),
            parts=tuple(parts),
        )
        # built on the host; to an accelerator in two copies (the integers, the masks) rather
        # than one per tensor: on CUDA each copy from pageable memory waits for the stream
        return meta if torch.device(device).type == "cpu" else _moved(meta, device)

    @classmethod
    def _from_tensors(
        cls,
        seen_t: torch.Tensor,
        new_t: torch.Tensor,
        tables: torch.Tensor,
        block_size: int,
        max_new: int,
        fresh: bool,
        parts: tuple[tuple[torch.Tensor, RaggedBatchMetadata], ...] = (),
    ) -> RaggedBatchMetadata:
        """The metadata, on the host, of checked per-sequence ``seen_t``/``new_t`` (int64) and
        padded block ``tables`` (``max_new``: the largest new count; ``fresh``: nothing
        seen)."""
        n_seq = new_t.numel()
        max_ctx = tables.shape[1] * block_size
        if max_new == 1:  # one token per sequence: flat token s is sequence s
            token_seq = torch.arange(n_seq)
            token_offset = torch.zeros(n_seq, dtype=torch.int64)
            query_index = token_seq[:, None]
        else:
            starts = torch.cumsum(new_t, 0) - new_t
            token_seq = torch.repeat_interleave(torch.arange(n_seq), new_t)
            token_offset = torch.arange(token_seq.numel()) - starts[token_seq]
            rows = torch.arange(max_new)
            query_index = torch.where(rows < new_t[:, None], starts[:, None] + rows, 0)
        positions = seen_t[token_seq] + token_offset
        slots = tables[token_seq, positions // block_size] * block_size + positions % block_size

        new_counts = tuple(new_t.tolist())
        max_position = int((seen_t + new_t).max()) - 1 if n_seq else 0
        last_rows = None if max_new == 1 else torch.cumsum(new_t, 0) - 1
        if parts:
            # every part masks its own queries: the whole batch's mask would go unused
            mask = torch.ones(n_seq, 0, max_ctx, dtype=torch.bool)
        else:
            # Query i of sequence s sits at position seen[s] + i and sees keys 0 .. seen[s] + i.
            rows = torch.arange(max_new)
            last_key = seen_t[:, None] + rows  # (n_seq, max_new)
            mask = torch.arange(max_ctx)[None, None, :] <= last_key[:, :, None]
            if max_new > 1:
                # Padding rows see key 0 only: an all-False row would make SDPA return NaN.
                pad_rows = rows[None, :] >= new_t[:, None]
                mask = mask & ~pad_rows[:, :, None]
                mask[:, :, 0] |= pad_rows

        return cls(
            positions=positions,
            slots=slots,
            query_index=query_index,
            token_seq=token_seq,
            token_offset=token_offset,
            block_tables=tables.contiguous(),
            mask=mask[:, None],
            block_size=block_size,
            parts=parts,
            decode=max_new == 1,
            fresh=fresh,
            new_counts=new_counts,
            max_position=max_position,
            last_rows=last_rows,
        )

    def gather_index(self, kv_heads: int, num_blocks: int) -> torch.Tensor:
        """Row indices into a head-major cache viewed as (kv_heads * num_blocks,
        block_size * head_dim) that gather every sequence's padded context as (sequences,
        kv_heads, max_context, head_dim) in one ``index_select`` of whole blocks (built once per
        batch and cache shape, shared by all layers)."""
        key = (kv_heads, num_blocks)
        index = self.memo.get(key)
        if index is None:
            heads = torch.arange(kv_heads, device=self.block_tables.device) * num_blocks
            index = (heads[None, :, None] + self.block_tables[:, None, :]).reshape(-1)
            self.memo[key] = index
        return index

    def bag_index(self, kv_heads: int, num_blocks: int, group: int) -> tuple[torch.Tensor, ...]:
        """For a decode batch: the rows of a head-major cache viewed as (kv_heads * num_blocks *
        block_size, head_dim) that each (sequence, kv head, query head of it) reads, its whole
        padded context in order, flat, and each such bag's offset into them (the inputs of one
        ``embedding_bag``; built once per batch and cache shape, shared by all layers)."""
        key = ("bag", kv_heads, num_blocks, group)
        bags = self.memo.get(key)
        if bags is None:
            seqs, blocks = self.block_tables.shape
            ctx = blocks * self.block_size
            first = self.gather_index(kv_heads, num_blocks).view(seqs, kv_heads, blocks, 1)
            offsets = torch.arange(self.block_size, device=first.device)
            rows = (first * self.block_size + offsets).view(seqs, kv_heads, 1, ctx)
            rows = rows.expand(seqs, kv_heads, group, ctx).reshape(-1)
            starts = torch.arange(seqs * kv_heads * group, device=first.device) * ctx
            bags = self.memo[key] = (rows, starts)
        return bags


_INT_FIELDS = ("positions", "slots", "query_index", "token_seq", "token_offset", "block_tables")


def host_to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``tensor`` (on the host) copied to ``device``. To CUDA through pinned memory and without
    waiting: a copy from pageable memory synchronizes the stream, so the host would wait for
    every queued kernel before it could prepare the next piece of work (PyTorch's pinned-memory
    cache keeps the staging buffer until the copy is done)."""
    if torch.device(device).type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def _one_copy(tensors: list[torch.Tensor], device: torch.device | str) -> list[torch.Tensor]:
    """``tensors`` (one dtype) on ``device`` through a single copy: views of one buffer."""
    flat = host_to_device(torch.cat([t.reshape(-1) for t in tensors]), device)
    pieces = flat.split([t.numel() for t in tensors])
    return [piece.view(t.shape) for piece, t in zip(pieces, tensors, strict=True)]


def _moved(meta: RaggedBatchMetadata, device: torch.device | str) -> RaggedBatchMetadata:
    """``meta`` (and its parts) with every tensor on ``device``: the integer tensors in one
    copy, the masks in another."""
    metas = [meta] + [part for _, part in meta.parts]
    ints = [getattr(m, name) for m in metas for name in _INT_FIELDS]
    ints += [m.last_rows for m in metas if m.last_rows is not None]
    ints += [index for index, _ in meta.parts]
    moved = iter(_one_copy(ints, device))
    masks = iter(_one_copy([m.mask for m in metas], device))
    fields = [[next(moved) for _ in _INT_FIELDS] for _ in metas]
    last_rows = [None if m.last_rows is None else next(moved) for m in metas]
    rebuilt = []
    for m, f, rows in zip(metas, fields, last_rows, strict=True):
        tensors: dict[str, Any] = dict(zip(_INT_FIELDS, f, strict=True))
        rebuilt.append(dataclasses.replace(m, **tensors, mask=next(masks), last_rows=rows))
    parts = tuple((next(moved), part) for part in rebuilt[1:])
    return dataclasses.replace(rebuilt[0], parts=parts)


def _ints(values: Sequence[int] | torch.Tensor) -> list[int]:
    """``values`` as a list of Python ints (block ids given as a list or a tensor)."""
    if isinstance(values, torch.Tensor):
        return [int(v) for v in values.reshape(-1).tolist()]
    return values if isinstance(values, list) else [int(v) for v in values]


# Smallest saving, in padded context tokens, worth another attention call (gather + SDPA) per
# layer: below it the call's fixed cost outweighs the copy and compute saved (measured on CPU).
_MIN_SPLIT_SAVING = 1024
_MAX_DECODE_BUCKETS = 4


def _max_decode_buckets(device: torch.device | str) -> int:
    """How many context-length buckets decode tokens may be split into on ``device``: on CPU
    a padded key costs compute and copies, so similar lengths are grouped; on an accelerator a
    step is bound by kernel launches (about ten more per layer for each bucket) long before
    the padded keys of these contexts cost anything, so decode tokens stay in one call."""
    return _MAX_DECODE_BUCKETS if torch.device(device).type == "cpu" else 1


# Fewest new tokens of fresh prompts (nothing cached) worth their own causal attention call,
# next to prompt chunks that continue a cached prefix.
_MIN_FRESH_TOKENS = 128


def _groups(
    seen_tokens: Sequence[int],
    new_tokens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    max_buckets: int = _MAX_DECODE_BUCKETS,
) -> list[list[int]]:
    """The sequence groups attention runs separately (none: one call for the batch): the
    single-token sequences, in up to ``max_buckets`` buckets of similar context length, then
    the longer runs (fresh prompts apart from continued ones when they are many tokens)."""
    single = [s for s, n in enumerate(new_tokens) if n == 1]
    longer = [s for s, n in enumerate(new_tokens) if n != 1]
    fresh = [s for s in longer if seen_tokens[s] == 0]
    longers = [longer] if longer else []
    if (
        fresh
        and len(fresh) < len(longer)
        and sum(new_tokens[s] for s in fresh) >= (_MIN_FRESH_TOKENS)
    ):
        # fresh prompts then attend causally to their own keys: no gather, no padded mask
        longers = [fresh, [s for s in longer if seen_tokens[s] != 0]]
    buckets = [single] if single else []
    if single:
        # split by context length while a split saves enough padded keys: a sorted run of
        # block counts split at i pads i sequences to its i-th count, the rest to its maximum
        buckets = [sorted(single, key=lambda s: len(block_tables[s]))]
        while len(buckets) < max_buckets:
            best: tuple[int, int, int] | None = None  # (saving, bucket, split point)
            for b, bucket in enumerate(buckets):
                blocks = [len(block_tables[s]) for s in bucket]
                whole = len(blocks) * blocks[-1]
                for i in range(1, len(blocks)):
                    saving = whole - i * blocks[i - 1] - (len(blocks) - i) * blocks[-1]
                    if best is None or saving > best[0]:
                        best = (saving, b, i)
            if best is None or best[0] * block_size < _MIN_SPLIT_SAVING:
                break
            _, b, i = best
            buckets[b : b + 1] = [buckets[b][:i], buckets[b][i:]]
    groups = buckets + longers
    return groups if len(groups) > 1 else []


# Per thread, grow-only buffers the key/value gathers land in: a fresh multi-megabyte tensor per
# gather costs more than the copy itself (the allocator hands back untouched pages that fault
# in), while every gathered batch is used up before the next gather starts.
_WORKSPACE = threading.local()


@contextlib.contextmanager
def private_workspace() -> Iterator[None]:
    """Within it, every gather allocates its own buffer instead of this thread's reused one:
    for a CUDA graph's capture, whose kernels keep writing to the addresses they were captured
    with (a reused buffer may grow, be freed and be handed to something else)."""
    saved = getattr(_WORKSPACE, "private", False)
    _WORKSPACE.private = True
    try:
        yield
    finally:
        _WORKSPACE.private = saved


def _buffer(slot: int, like: torch.Tensor, numel: int) -> torch.Tensor:
    """The first ``numel`` values of this thread's reused buffer ``slot`` (``like``'s dtype and
    device; valid until the next use of the same slot)."""
    if getattr(_WORKSPACE, "private", False):
        return like.new_empty(numel)
    buffers: dict[Any, torch.Tensor] | None = getattr(_WORKSPACE, "buffers", None)
    if buffers is None:
        buffers = _WORKSPACE.buffers = {}
    key = (slot, like.dtype, like.device)
    buffer = buffers.get(key)
    if buffer is None or buffer.numel() < numel:
        buffer = buffers[key] = like.new_empty(numel)
    return buffer[:numel]


def _gather(rows: torch.Tensor, index: torch.Tensor, slot: int) -> torch.Tensor:
    """``rows.index_select(0, index)`` written into this thread's reused buffer ``slot``."""
    out = _buffer(slot, rows, index.numel() * rows.shape[1]).view(index.numel(), rows.shape[1])
    return torch.index_select(rows, 0, index, out=out)


def _gather_slots(cache: torch.Tensor, slots: torch.Tensor, slot: int) -> torch.Tensor:
    """The keys or values at cache ``slots`` as (kv_heads, len(slots), head_dim), gathered
    into this thread's reused buffer ``slot``."""
    kv_heads, head_dim = cache.shape[0], cache.shape[-1]
    flat = cache.view(kv_heads, -1, head_dim)
    out = _buffer(slot, cache, kv_heads * slots.numel() * head_dim)
    return torch.index_select(flat, 1, slots, out=out.view(kv_heads, slots.numel(), head_dim))


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: RaggedBatchMetadata,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of the ragged batch's new tokens ``query`` (tokens, heads, head_dim) over the
    keys/values of their sequences in one layer's cache ``key_cache``/``value_cache``
    (kv_heads, num_blocks, block_size, head_dim), the new tokens already written there. ``heads``
    must be a multiple of ``kv_heads`` (grouped-query attention: query head ``h`` reads kv head
    ``h // (heads // kv_heads)``). Returns (tokens, heads, head_dim)."""
    tokens, heads, head_dim = query.shape
    kv_heads, num_blocks, block_size = key_cache.shape[:3]
    if tokens != meta.num_tokens:
        raise ValueError(f"query has {tokens} tokens and the batch metadata {meta.num_tokens}.")
    if block_size != meta.block_size:
        raise ValueError(
            f"the cache's block size is {block_size} and the metadata's {meta.block_size}."
        )
    if heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of kv heads ({kv_heads}).")
    if meta.parts:
        out = query.new_empty(tokens, heads, head_dim)
        for index, part in meta.parts:
            out[index] = paged_attention(query[index], key_cache, value_cache, part, scale)
        return out
    seqs, max_new = meta.query_index.shape
    group = heads // kv_heads
    if meta.fresh:
        # Nothing cached before these tokens: each sequence attends causally to its own new
        # keys/values, one SDPA call per sequence (no padding to the longest prompt: padded
        # calls cost 2-3x as much for prompts of mixed lengths)
        lengths = meta.new_counts
        k = _gather_slots(key_cache, meta.slots, 0)  # (kv_heads, tokens, head_dim)
        v = _gather_slots(value_cache, meta.slots, 1)
        out = query.new_empty(tokens, heads, head_dim)
        start = 0
        for length in lengths:
            end = start + length
            attended = F.scaled_dot_product_attention(
                query[start:end].transpose(0, 1)[None],
                k[None, :, start:end].to(query.dtype),
                v[None, :, start:end].to(query.dtype),
                is_causal=True,
                scale=scale,
                enable_gqa=group > 1,
            )
            out[start:end] = attended[0].transpose(0, 1)
            start = end
        return out
    # one index_select of whole head-major blocks lands every sequence's keys/values already
    # laid out as SDPA wants them (sequences, kv_heads, context, head_dim): no transpose
    index = meta.gather_index(kv_heads, num_blocks)
    ctx = meta.block_tables.shape[1] * block_size
    row = block_size * head_dim
    k = _gather(key_cache.view(-1, row), index, 0).view(seqs, kv_heads, ctx, head_dim)
    k = k.to(query.dtype)
    if meta.decode and query.dtype == torch.float32:
        # one query per sequence (flat token s is sequence s): the `group` query heads of a kv
        # head are its query rows. float32 with a handful of query rows: a batched matmul and
        # a softmax beat the CPU flash kernel, whose tiling is made for many query rows; the
        # mask as an additive -inf bias made once per step for all layers (a broadcast add
        # costs a tenth of masked_fill_ with a broadcast mask)
        q = query.view(seqs, kv_heads, group, head_dim)
        bias = meta.memo.get("bias")
        if bias is None:
            bias = torch.zeros(meta.mask.shape, dtype=q.dtype, device=q.device)
            bias = meta.memo["bias"] = bias.masked_fill_(~meta.mask, float("-inf"))
        scores = torch.matmul(q * (head_dim**-0.5 if scale is None else scale), k.mT)
        scores += bias
        probs = scores.softmax(dim=-1)
        if value_cache.device.type == "cpu" and value_cache.dtype == torch.float32:
            # the values weighted straight from the cache, one bag of rows per query row: no
            # gathered copy of them (a 64-sequence decode step 19.2 -> 16.4 ms on this CPU)
            rows, starts = meta.bag_index(kv_heads, num_blocks, group)
            out = F.embedding_bag(
                rows,
                value_cache.view(-1, head_dim),
                starts,
                mode="sum",
                per_sample_weights=probs.reshape(-1),
            )
            return out.view(seqs, heads, head_dim)
        v = _gather(value_cache.view(-1, row), index, 1).view(seqs, kv_heads, ctx, head_dim)
        return torch.matmul(probs, v.to(q.dtype)).reshape(seqs, heads, head_dim)
    v = _gather(value_cache.view(-1, row), index, 1).view(seqs, kv_heads, ctx, head_dim)
    v = v.to(query.dtype)
    if meta.decode:
        # below float32: SDPA (it accumulates in float32), the (seqs, 1, 1, ctx) mask
        # broadcast over each kv head's `group` query rows
        q = query.view(seqs, kv_heads, group, head_dim)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=meta.mask, scale=scale)
        return out.reshape(seqs, heads, head_dim)
    q = query[meta.query_index].transpose(1, 2)  # (seqs, heads, max_new, head_dim)
    mask = meta.mask
    if group > 1:
        # GQA without copying keys/values per query head: the `group` query heads of one kv
        # head become extra query rows of it (row g * max_new + i), the mask repeated to match
        q = q.reshape(seqs, kv_heads, group * max_new, head_dim)
        mask = mask.repeat(1, 1, group, 1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    out = out.reshape(seqs, heads, max_new, head_dim)
    return out.transpose(1, 2)[meta.token_seq, meta.token_offset]
