"""A stand-in for ``InferenceEngineV2`` in scheduler tests: the same put/query/flush interface and
KV block accounting (through the real ``BlockedAllocator``), with logits from a function of each
sequence's whole token history (no cache), so scheduling logic is tested without a model."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence

import torch

from shardspeed.inference.v2.ragged import BlockedAllocator


def hashed_logits(vocab: int) -> Callable[[list[int]], torch.Tensor]:
    """Logits that depend on the whole history only (a seeded draw from its hash)."""

    def fn(history: list[int]) -> torch.Tensor:
        digest = hashlib.sha256(str(history).encode()).digest()
        g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
        return torch.randn(vocab, generator=g)

    return fn


class FakeEngine:
    """Tracks token histories and KV blocks per uid like the real engine."""

    def __init__(
        self,
        logits_fn: Callable[[list[int]], torch.Tensor],
        total_blocks: int = 64,
        kv_block_size: int = 4,
        max_context: int = 1024,
        max_batch_tokens: int = 768,
        max_sequences: int = 512,
    ) -> None:
        self.logits_fn = logits_fn
        self.allocator = BlockedAllocator(total_blocks)
        self.total_blocks, self.kv_block_size, self.max_context = (
            total_blocks,
            kv_block_size,
            max_context,
        )
        self.max_batch_tokens, self.max_sequences = max_batch_tokens, max_sequences
        self.history: dict[int, list[int]] = {}
        self.tables: dict[int, list[int]] = {}
        self.puts: list[list[tuple[int, int]]] = []

    @property
    def free_blocks(self) -> int:
        return self.allocator.free_blocks

    def tracked(self, uid: int) -> bool:
        return uid in self.history

    def _blocks_for(self, uid: int, tokens: int) -> int:
        seen = len(self.history.get(uid, []))
        held = len(self.tables.get(uid, []))
        return max(0, -(-(seen + tokens) // self.kv_block_size) - held)

    def query(self, uid: int, max_request_tokens: int, max_request_blocks: int) -> tuple[int, int]:
        seen = len(self.history.get(uid, []))
        held = len(self.tables.get(uid, []))
        room = (held + max_request_blocks) * self.kv_block_size - seen
        tokens = max(0, min(max_request_tokens, room, self.max_context - seen))
        return tokens, self._blocks_for(uid, tokens)

    def put(
        self,
        batch_uids: Iterable[int],
        batch_tokens: Iterable[torch.Tensor | Sequence[int]],
        do_checks: bool = True,
    ) -> torch.Tensor:
        uids, toks = list(batch_uids), [torch.as_tensor(t).tolist() for t in batch_tokens]
        assert len(set(uids)) == len(uids), uids
        assert sum(len(t) for t in toks) <= self.max_batch_tokens
        assert len(uids) <= self.max_sequences
        out = []
        for uid, t in zip(uids, toks, strict=True):
            assert t, f"empty chunk for {uid}"
            need = self._blocks_for(uid, len(t))
            self.tables.setdefault(uid, []).extend(self.allocator.allocate(need).tolist())
            self.history.setdefault(uid, []).extend(t)
            assert len(self.history[uid]) <= self.max_context
            out.append(self.logits_fn(self.history[uid]))
        self.puts.append([(u, len(t)) for u, t in zip(uids, toks, strict=True)])
        return torch.stack(out)

    def flush(self, uid: int) -> None:
        if uid not in self.history:
            raise ValueError(f"uid {uid} unknown")
        del self.history[uid]
        self.allocator.free(self.tables.pop(uid))
