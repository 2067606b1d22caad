"""Sequence tracking for the inference v2 engine: each uid's descriptor, its tokens and blocks,
and the prefix cache that lets sequences with a common prompt prefix share its KV blocks.

Prefix cache: once a block of a sequence is full its keys/values never change, and they depend
only on the tokens up to and including that block. Every full block is indexed under the key
(block id of the previous block, the block's own tokens) — the previous block stands for all
tokens before it, exactly — so a new sequence walks the index block by block from the start and
takes (shares, reference counted) every leading block it finds, never writing to them. At least
the prompt's last token is always computed (its logits are the answer). A block that was
computed twice (two sequences raced on the same prefix) stays private to its sequence and is not
indexed, nor is anything chained after it.

Blocks outlive their sequences (automatic prefix caching): when its last holder is flushed an
indexed block stays indexed, cached and unreferenced, in an LRU; the next allocation that finds
too few free blocks evicts the oldest of them. Evicting a block also evicts every block keyed
under it, so a reused block id can never make a stale child reachable.
"""

from __future__ import annotations

from collections import OrderedDict
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
    ``DSStateManager``), with prefix sharing of full blocks when ``config.prefix_caching``.

    Prefix-cached blocks outlive their sequences: when the last sequence holding an indexed
    block is flushed, the block stays indexed as "cached, unreferenced" (an LRU, oldest first)
    and the manager keeps the allocator's one reference on it. A new sequence whose prompt
    matches takes that reference over; an allocation that finds too few free blocks first
    evicts the least recently released cached blocks (with their indexed descendants) back to
    the allocator. :attr:`free_blocks` counts free + evictable blocks.
    """

    def __init__(self, config: DSStateManagerConfig, cache: BlockedKVCache) -> None:
        self.config = config
        self.cache = cache
        self.block_size = cache.block_size
        self.prefix_caching = config.prefix_caching
        self._seqs: dict[int, TrackedSequence] = {}
        self._index: dict[_PrefixKey, int] = {}
        self._key_of_block: dict[int, _PrefixKey] = {}
        # indexed block -> the indexed blocks keyed under it (evicted with it: a freed block id
        # may come back holding other tokens, and a child keyed under it must not match then)
        self._children: dict[int, set[int]] = {}
        # cached, unreferenced blocks, least recently released first (value unused)
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.evicted_blocks = 0
        """Cached blocks evicted to make room, so far."""

    # ------------------------------------------------------------------ sequences
    @property
    def n_tracked_sequences(self) -> int:
        """How many sequences are tracked now."""
        return len(self._seqs)

    @property
    def free_blocks(self) -> int:
        """How many KV blocks an allocation can get now: free ones plus cached, unreferenced
        ones (evicted on demand)."""
        return self.cache.free_blocks + len(self._lru)

    @property
    def cached_blocks(self) -> int:
        """How many blocks are cached and held by no sequence (evictable)."""
        return len(self._lru)

    @property
    def prefix_index_size(self) -> int:
        """How many blocks the prefix cache indexes now (held or cached)."""
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

    def reserve(self, seq: TrackedSequence, new_tokens: int) -> None:
        """Give ``seq`` the blocks ``new_tokens`` more tokens need, evicting cached blocks
        first when too few are free (ValueError, nothing taken, when even that is not enough)."""
        needed = seq.blocks_needed(new_tokens, self.block_size)
        if needed:
            self.evict(needed)
            self.cache.reserve(seq, new_tokens)

    def flush_sequence(self, uid: int) -> None:
        """Forget ``uid`` and drop its hold on its blocks: an indexed block it was the last
        holder of stays cached (evictable); ValueError for an unknown (or already flushed)
        uid."""
        seq = self._seqs.pop(uid, None)
        if seq is None:
            raise ValueError(
                f"cannot flush sequence {uid}: it is not tracked (never put, or already "
                "flushed); flush each uid once, after its last put."
            )
        allocator = self.cache.allocator
        release: list[int] = []
        # Last block first, so that a prompt's tail is evicted before its head (the head is
        # what other prompts most likely share; evicting it would take the tail along anyway).
        for block in reversed(seq.block_ids):
            if block in self._key_of_block and allocator.ref_count(block) == 1:
                self._lru[block] = None  # the manager keeps the reference
            else:
                release.append(block)
        allocator.free(release)
        seq.block_ids = []
        seq.seen_tokens = seq.in_flight_tokens = 0

    # ------------------------------------------------------------------ prefix cache
    def evict(self, needed: int) -> int:
        """Evict least recently released cached blocks (each with its indexed descendants)
        until ``needed`` blocks are free or none is cached; return how many were evicted."""
        allocator = self.cache.allocator
        evicted = 0
        while allocator.free_blocks < needed and self._lru:
            oldest = next(iter(self._lru))
            evicted += self._drop_subtree(oldest)
        self.evicted_blocks += evicted
        return evicted

    def clear_prefix_cache(self) -> int:
        """Evict every cached, unreferenced block (blocks live sequences hold stay indexed);
        return how many were evicted."""
        return self.evict(self.cache.num_blocks + 1)

    def _drop_subtree(self, root: int) -> int:
        """Unindex ``root`` and every indexed block chained under it and return them all to
        the allocator; all of them must be cached, unreferenced (a sequence holding a block
        holds its whole chain, so a child of an unreferenced block is unreferenced too)."""
        dropped, i = [root], 0
        while i < len(dropped):  # the subtree, checked before anything changes
            dropped.extend(self._children.get(dropped[i], ()))
            i += 1
        held = [b for b in dropped if b not in self._lru]
        if held:
            raise RuntimeError(
                f"prefix cache: KV block(s) {held} are held by a sequence but chained under the "
                f"unreferenced block {root} (internal error: please report it)."
            )
        parent = self._key_of_block[root][0]  # stays (it is held, or older): unlink the root
        siblings = self._children.get(parent)
        if siblings is not None:
            siblings.discard(root)
            if not siblings:
                del self._children[parent]
        for block in dropped:
            del self._lru[block]
            del self._index[self._key_of_block.pop(block)]
            self._children.pop(block, None)
        self.cache.allocator.free(dropped)
        return len(dropped)

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

    def adopt_prefix(
        self, seq: TrackedSequence, tokens: Sequence[int], blocks: list[int] | None = None
    ) -> int:
        """Give the new, empty ``seq`` the cached blocks that hold a prefix of ``tokens``
        (``blocks``: ``match_prefix(tokens)`` when already found; shared, reference counted; a
        cached, unreferenced block's reference passes from the manager to ``seq``) and return
        how many tokens they cover."""
        if blocks is None:
            blocks = self.match_prefix(tokens)
        if not blocks:
            return 0
        if seq.block_ids or seq.seen_tokens:
            raise ValueError(f"sequence {seq.uid} already holds tokens; a prefix goes first.")
        held = [b for b in blocks if b not in self._lru]
        self.cache.allocator.share(held)
        for b in blocks:
            self._lru.pop(b, None)
        seq.extend_blocks(blocks)
        covered = len(blocks) * self.block_size
        seq.seen_tokens = covered
        seq.tokens.extend(int(t) for t in tokens[:covered])
        seq.indexed_blocks = len(blocks)
        return covered

    def index_full_blocks(self, seq: TrackedSequence) -> None:
        """Index the blocks of ``seq`` that became full since the last call. A block is indexed
        only under an indexed parent: a block whose parent stayed private (it raced another
        sequence on the same prefix) could never be matched, and its parent id, freed with the
        sequence, could come back holding other tokens."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        full = seq.seen_tokens // bs
        for b in range(seq.indexed_blocks, full):
            parent = seq.block_ids[b - 1] if b else -1
            if parent != -1 and parent not in self._key_of_block:
                break
            key = (parent, tuple(seq.tokens[b * bs : (b + 1) * bs]))
            block = seq.block_ids[b]
            if key not in self._index and block not in self._key_of_block:
                self._index[key] = block
                self._key_of_block[block] = key
                if parent != -1:
                    self._children.setdefault(parent, set()).add(block)
        seq.indexed_blocks = max(seq.indexed_blocks, full)
