"""Sequence tracking for the inference v2 engine: each uid's descriptor, its tokens and blocks,
and the prefix cache that lets sequences with a common prompt prefix share its KV blocks.

Prefix cache: once a block of a sequence is full its keys/values never change, and they depend
only on the tokens up to and including that block. Every full block is indexed under the key
(block id of the previous block, the block's own tokens) — the previous block stands for all
tokens before it, exactly — so a new sequence walks the index block by block from the start and
takes (shares, reference counted) every leading block it finds, never writing to them. At least
the prompt's last token is always computed (its logits are the answer). A block leaves the index
when its last holder lets go of it; a block that was computed twice (two sequences raced on the
same prefix) stays private to its sequence and is simply not indexed.
"""

from __future__ import annotations

from collections.abc import Sequence

from shardspeed.inference.v2.config_v2 import DSStateManagerConfig
from shardspeed.inference.v2.ragged.kv_cache import BlockedKVCache, SequenceDescriptor

__all__ = ["DSStateManager", "TrackedSequence"]

_PrefixKey = tuple[int, tuple[int, ...]]


class TrackedSequence(SequenceDescriptor):
    """A sequence descriptor that also keeps the sequence's token ids (for prefix keys) and how
    many of its leading blocks are indexed in (or were checked against) the prefix cache."""

    def __init__(self, uid: int) -> None:
        super().__init__(uid)
        self.tokens: list[int] = []
        self.indexed_blocks = 0


class DSStateManager:
    """Tracks sequences by uid over one :class:`BlockedKVCache` (DeepSpeed's
    ``DSStateManager``), with prefix sharing of full blocks when ``config.prefix_caching``."""

    def __init__(self, config: DSStateManagerConfig, cache: BlockedKVCache) -> None:
        self.config = config
        self.cache = cache
        self.block_size = cache.block_size
        self.prefix_caching = config.prefix_caching
        self._seqs: dict[int, TrackedSequence] = {}
        self._index: dict[_PrefixKey, int] = {}
        self._key_of_block: dict[int, _PrefixKey] = {}

    # ------------------------------------------------------------------ sequences
    @property
    def n_tracked_sequences(self) -> int:
        """How many sequences are tracked now."""
        return len(self._seqs)

    @property
    def free_blocks(self) -> int:
        """How many KV blocks are free now."""
        return self.cache.free_blocks

    @property
    def prefix_index_size(self) -> int:
        """How many blocks the prefix cache indexes now."""
        return len(self._index)

    def get_sequence(self, uid: int) -> TrackedSequence | None:
        """The tracked sequence ``uid``, or None."""
        return self._seqs.get(uid)

    def get_or_create_sequence(self, uid: int) -> TrackedSequence:
        """The tracked sequence ``uid``, created empty when new."""
        seq = self._seqs.get(uid)
        if seq is None:
            if len(self._seqs) >= self.config.max_tracked_sequences:
                raise ValueError(
                    f"cannot track sequence {uid}: {len(self._seqs)} sequences are tracked "
                    f"(state_manager.max_tracked_sequences={self.config.max_tracked_sequences}); "
                    "flush finished sequences or raise the limit."
                )
            seq = self._seqs[uid] = TrackedSequence(uid)
        return seq

    def flush_sequence(self, uid: int) -> None:
        """Forget ``uid`` and drop its hold on its blocks (blocks no one holds leave the prefix
        index); ValueError for an unknown (or already flushed) uid."""
        seq = self._seqs.pop(uid, None)
        if seq is None:
            raise ValueError(
                f"cannot flush sequence {uid}: it is not tracked (never put, or already "
                "flushed); flush each uid once, after its last put."
            )
        blocks = seq.block_ids
        self.cache.release(seq)
        for block in blocks:
            if self.cache.allocator.ref_count(block) == 0:
                key = self._key_of_block.pop(block, None)
                if key is not None:
                    del self._index[key]

    # ------------------------------------------------------------------ prefix cache
    def match_prefix(self, tokens: Sequence[int]) -> list[int]:
        """Block ids of the indexed blocks that hold the leading tokens of ``tokens``, leaving
        at least the last token to compute (empty without prefix caching)."""
        if not self.prefix_caching:
            return []
        bs = self.block_size
        matched: list[int] = []
        parent = -1
        for b in range((len(tokens) - 1) // bs):
            block = self._index.get((parent, tuple(tokens[b * bs : (b + 1) * bs])))
            if block is None:
                break
            matched.append(block)
            parent = block
        return matched

    def adopt_prefix(self, seq: TrackedSequence, tokens: Sequence[int]) -> int:
        """Give the new, empty ``seq`` the cached blocks that hold a prefix of ``tokens`` (shared,
        reference counted) and return how many tokens they cover."""
        blocks = self.match_prefix(tokens)
        if not blocks:
            return 0
        if seq.block_ids or seq.seen_tokens:
            raise ValueError(f"sequence {seq.uid} already holds tokens; a prefix goes first.")
        self.cache.allocator.share(blocks)
        seq.extend_blocks(blocks)
        covered = len(blocks) * self.block_size
        seq.seen_tokens = covered
        seq.tokens.extend(int(t) for t in tokens[:covered])
        seq.indexed_blocks = len(blocks)
        return covered

    def index_full_blocks(self, seq: TrackedSequence) -> None:
        """Index the blocks of ``seq`` that became full since the last call."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        full = seq.seen_tokens // bs
        for b in range(seq.indexed_blocks, full):
            parent = seq.block_ids[b - 1] if b else -1
            key = (parent, tuple(seq.tokens[b * bs : (b + 1) * bs]))
            block = seq.block_ids[b]
            if key not in self._index and block not in self._key_of_block:
                self._index[key] = block
                self._key_of_block[block] = key
        seq.indexed_blocks = max(seq.indexed_blocks, full)
