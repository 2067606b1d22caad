"""Decode batches and fresh prompts of inference v2 replayed from CUDA graphs
(``enable_cuda_graph``).

On a GPU a step of a small model is bound by the host: its forward is a few hundred kernel
launches of microseconds each. Here

* a decode batch (one new token per sequence) is padded to a bucket (sequences: a power of two
  up to ``max_ragged_sequence_count``; blocks per sequence: a power of two up to what
  ``max_context`` needs). Padding rows repeat the last real row (its token written again to the
  same slot, with the same values); padding blocks are masked like any decode batch's;
* a fresh prompt (a new sequence's whole prompt, nothing cached) is padded to a power of two of
  tokens up to ``max_ragged_batch_size``. Its real tokens come first and attend causally, so
  they never see the padding; padding tokens write their keys and values into a scratch KV block
  no sequence holds.

Each bucket's forward is captured once on buffers allocated once, and every later batch of that
bucket copies its tokens, positions, cache slots (and block tables) into one buffer (one
host-to-device copy) and replays the graph. A step that mixes decode tokens with prompts
replays one graph for its decode tokens and one per fresh prompt; only prompt chunks that
continue a cached prefix run the plain ragged forward. Without ``graph`` the same buffers and
arithmetic run eagerly, on any device (how the tests check them on a CPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from shardspeed.accelerator import get_accelerator
from shardspeed.inference.graph_capture import capture_step
from shardspeed.inference.v2.model.ragged_lm import _STATIC_ROPE, RaggedCausalLM
from shardspeed.inference.v2.ragged.kv_cache import BlockedKVCache
from shardspeed.inference.v2.ragged.paged_attention import RaggedBatchMetadata, private_workspace

__all__ = ["GraphedDecode", "graph_refusal"]

# eager runs before a capture (graph_capture's recipe); two suffice for a forward
_WARMUP_RUNS = 2


def graph_refusal(model: RaggedCausalLM, tp_size: int) -> str | None:
    """Why ``model`` cannot decode from CUDA graphs (None: it can)."""
    if model.family == "mixtral":
        return "Mixtral's expert routing has data-dependent shapes, which a graph cannot hold"
    rope = getattr(getattr(model.base, "rotary_emb", None), "rope_type", "default")
    if model.layout != "gpt2" and rope not in _STATIC_ROPE:
        return f"rope_type {rope!r} rescales with the sequence length, which a graph cannot hold"
    if tp_size > 1:
        return f"tensor_parallel.tp_size={tp_size}: graphs are captured at tp_size 1 only"
    device = model.device
    if device.type != "cuda":
        return f"CUDA graphs exist only on CUDA devices and the model runs on {device.type}"
    return None


def _bucket(n: int, limit: int) -> int:
    """The smallest power of two >= ``n``, or ``limit`` when that is smaller."""
    size = 1
    while size < n:
        size *= 2
    return min(size, limit)


def _buckets_up_to(top: int) -> list[int]:
    """Every bucket size up to bucket ``top``: the powers of two below it, then ``top``."""
    sizes = [1]
    while sizes[-1] < top:
        sizes.append(min(2 * sizes[-1], top))
    return sizes


class _Bucket:
    """One padded shape: its ``packed`` input buffer (int64, one row per sequence or token) and
    its forward, captured on that buffer (or run eagerly on it)."""

    def __init__(self, owner: GraphedDecode, rows: int, columns: int) -> None:
        self.owner = owner
        self.packed = torch.zeros(rows, columns, dtype=torch.int64, device=owner.model.device)
        self.graph: Any = None
        self.logits: torch.Tensor | None = None

    def __call__(self, host_rows: torch.Tensor) -> torch.Tensor:
        # straight from pinned memory into the buffer, without waiting on the stream
        cuda = self.packed.is_cuda
        self.packed.copy_(host_rows.pin_memory() if cuda else host_rows, non_blocking=cuda)
        if not self.owner.use_graph:
            return self._step()
        if self.graph is None:
            self._capture()
        get_accelerator().replay_graph(self.graph)
        self.owner.replays += 1
        assert self.logits is not None
        return self.logits

    def _step(self) -> torch.Tensor:
        owner, packed = self.owner, self.packed
        # every bucket's rows start with the token, its position and its cache slot
        meta = self._meta(packed[:, 1].contiguous(), packed[:, 2].contiguous())
        return owner.model(packed[:, 0].contiguous(), meta, owner.cache)

    def _meta(self, positions: torch.Tensor, slots: torch.Tensor) -> RaggedBatchMetadata:
        """The batch metadata over ``packed`` (a view of it: replays see new values)."""
        raise NotImplementedError

    def _capture(self) -> None:
        # every bucket's graph shares one memory pool: they replay one at a time, and each
        # one's output is read before the next replay; the capture allocates its own gather
        # buffers (its kernels keep the addresses they were captured with)
        owner = self.owner
        graph, self.logits = capture_step(
            self._step, owner.pool, _WARMUP_RUNS, recording=private_workspace()
        )
        if owner.pool is None and hasattr(graph, "pool"):
            owner.pool = graph.pool()
        self.graph = graph
        owner.captures += 1


class _DecodeBucket(_Bucket):
    """``seqs`` sequences of one new token each, over ``blocks`` blocks each. ``packed``: per
    sequence its token, position, cache slot, then its block table."""

    def __init__(self, owner: GraphedDecode, seqs: int, blocks: int) -> None:
        super().__init__(owner, seqs, 3 + blocks)
        device = self.packed.device
        self.seqs = seqs
        self.keys = torch.arange(blocks * owner.block_size, device=device)
        self.rows = torch.arange(seqs, device=device)
        self.offsets = torch.zeros(seqs, dtype=torch.int64, device=device)

    def _meta(self, positions: torch.Tensor, slots: torch.Tensor) -> RaggedBatchMetadata:
        return RaggedBatchMetadata(
            positions=positions,
            slots=slots,
            query_index=self.rows[:, None],
            token_seq=self.rows,
            token_offset=self.offsets,
            block_tables=self.packed[:, 3:].contiguous(),
            mask=(self.keys[None, :] <= positions[:, None])[:, None, None, :],
            block_size=self.owner.block_size,
            decode=True,
            new_counts=(1,) * self.seqs,
            # the rotary table is sized once for the whole context: no regrowth in a replay
            max_position=self.owner.max_context - 1,
        )


class _PromptBucket(_Bucket):
    """One fresh prompt padded to ``tokens`` tokens. ``packed``: per token its id, position and
    cache slot, and (every row) the index of the prompt's last real token."""

    def __init__(self, owner: GraphedDecode, tokens: int) -> None:
        super().__init__(owner, tokens, 4)
        device = self.packed.device
        self.tokens = tokens
        self.index = torch.arange(tokens, device=device)
        self.zeros = torch.zeros(tokens, dtype=torch.int64, device=device)
        # the fresh path reads neither a block table nor a mask: placeholders of the right rank
        self.table = torch.zeros(1, 1, dtype=torch.int64, device=device)
        self.mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)

    def _meta(self, positions: torch.Tensor, slots: torch.Tensor) -> RaggedBatchMetadata:
        return RaggedBatchMetadata(
            positions=positions,
            slots=slots,
            query_index=self.index[None, :],
            token_seq=self.zeros,
            token_offset=self.index,
            block_tables=self.table,
            mask=self.mask,
            block_size=self.owner.block_size,
            fresh=True,
            new_counts=(self.tokens,),
            max_position=self.owner.max_context - 1,
            last_rows=self.packed[:1, 3],
        )


class GraphedDecode:
    """Decode batches and fresh prompts of ``model`` over ``cache`` through padded buckets,
    each captured in a CUDA graph on first use (``graph``) or run eagerly on the same buffers.
    ``scratch_block``: a KV block no sequence ever holds, where padding tokens of prompts write;
    ``max_prompt_tokens``: the longest prompt run from a graph (0: none)."""

    def __init__(
        self,
        model: RaggedCausalLM,
        cache: BlockedKVCache,
        block_size: int,
        max_sequences: int,
        max_context: int,
        graph: bool,
        scratch_block: int,
        max_prompt_tokens: int = 0,
    ) -> None:
        self.model, self.cache, self.block_size = model, cache, block_size
        self.max_sequences, self.max_context, self.use_graph = max_sequences, max_context, graph
        self.max_blocks = -(-max_context // block_size)
        self.scratch_block = scratch_block
        # a sliding window narrower than the padded prompt would need the masked (gathering)
        # path: such prompts stay eager
        window = model.smallest_window
        self.max_prompt_tokens = min(max_prompt_tokens, max_context)
        if window is not None:
            self.max_prompt_tokens = min(self.max_prompt_tokens, window)
        self.buckets: dict[tuple[int, int], _DecodeBucket] = {}
        self.prompt_buckets: dict[int, _PromptBucket] = {}
        self.pool: Any = None
        self.captures = 0
        """Graphs captured so far."""
        self.replays = 0
        """Batches replayed from a graph so far."""

    def bucket_of(self, sequences: int, blocks: int) -> tuple[int, int]:
        """The padded (sequences, blocks) a decode batch of that size runs in."""
        return _bucket(sequences, self.max_sequences), _bucket(blocks, self.max_blocks)

    def prompt_bucket_of(self, tokens: int) -> int | None:
        """The padded length a fresh prompt of ``tokens`` tokens runs in (None: it runs the
        plain forward)."""
        if not 1 < tokens <= self.max_prompt_tokens:
            return None
        return _bucket(tokens, self.max_prompt_tokens)

    def run(
        self, tokens: Sequence[int], seen: Sequence[int], tables: Sequence[Sequence[int]]
    ) -> torch.Tensor:
        """Logits (sequences, vocab), float32, of a decode batch: sequence ``s`` brings token
        ``tokens[s]`` at position ``seen[s]``, its blocks ``tables[s]`` (already reserved)."""
        key = self.bucket_of(len(tokens), max(len(t) for t in tables))
        seqs, blocks = key
        bucket = self.buckets.get(key)
        if bucket is None:
            bucket = self.buckets[key] = _DecodeBucket(self, seqs, blocks)
        size = self.block_size
        rows = [
            [token, position, table[position // size] * size + position % size, *table]
            + [0] * (blocks - len(table))
            for token, position, table in zip(tokens, seen, tables, strict=True)
        ]
        rows += [rows[-1]] * (seqs - len(rows))
        # a copy: the bucket's output buffer is overwritten by its next step
        return bucket(torch.tensor(rows, dtype=torch.int64))[: len(tokens)].clone()

    def run_prompt(self, tokens: Sequence[int], table: Sequence[int]) -> torch.Tensor:
        """Logits (1, vocab), float32, of the last token of a fresh prompt ``tokens`` (a new
        sequence's first tokens, held by blocks ``table``, already reserved); ValueError when
        :meth:`prompt_bucket_of` gives it no bucket."""
        padded = self.prompt_bucket_of(len(tokens))
        if padded is None:
            raise ValueError(
                f"a prompt of {len(tokens)} tokens has no graph (2 to {self.max_prompt_tokens})."
            )
        bucket = self.prompt_buckets.get(padded)
        if bucket is None:
            bucket = self.prompt_buckets[padded] = _PromptBucket(self, padded)
        length, size = len(tokens), self.block_size
        rows = torch.empty(padded, 4, dtype=torch.int64)
        positions = torch.arange(length)
        blocks = torch.tensor(list(table[: -(-length // size)]), dtype=torch.int64)
        rows[:length, 0] = torch.tensor(list(tokens), dtype=torch.int64)
        rows[:length, 1] = positions
        rows[:length, 2] = blocks[positions // size] * size + positions % size
        # padding: the last token again, at position 0, into the scratch block's slots
        rows[length:, 0] = rows[length - 1, 0]
        rows[length:, 1] = 0
        rows[length:, 2] = self.scratch_block * size + torch.arange(padded - length) % size
        rows[:, 3] = length - 1
        return bucket(rows).clone()

    def capture_all(
        self, max_sequences: int | None, max_context: int | None, max_prompt: int | None = None
    ) -> int:
        """Capture (or, eagerly, run once) every decode bucket up to ``max_sequences`` sequences
        and ``max_context`` tokens each, and every prompt bucket up to ``max_prompt`` tokens
        (None: the limits given at construction; 0: none of that kind), so that no later step
        waits for a capture;
        returns how many buckets were new. The captures write keys and values into the scratch
        block only."""
        scratch, size = self.scratch_block, self.block_size
        wanted = self.max_sequences if max_sequences is None else max_sequences
        context = self.max_context if max_context is None else max_context
        # 0 (or less) asks for none of that kind
        seq_sizes = _buckets_up_to(_bucket(wanted, self.max_sequences)) if wanted > 0 else []
        blocks_wanted = -(-context // size)
        block_sizes = _buckets_up_to(_bucket(blocks_wanted, self.max_blocks)) if context > 0 else []
        new = 0
        # each shape once, through the path a real batch takes: token 0 at position 0 (every
        # prompt token at its position), every block of the table the scratch block
        for seqs in seq_sizes:
            for blocks in block_sizes:
                if (seqs, blocks) not in self.buckets:
                    self.run([0] * seqs, [0] * seqs, [[scratch] * blocks] * seqs)
                    new += 1
        longest = self.max_prompt_tokens if max_prompt is None else max_prompt
        top_prompt = self.prompt_bucket_of(min(longest, self.max_prompt_tokens))
        for tokens in _buckets_up_to(top_prompt)[1:] if top_prompt else []:
            if tokens not in self.prompt_buckets:
                self.run_prompt([0] * tokens, [scratch] * -(-tokens // size))
                new += 1
        return new
