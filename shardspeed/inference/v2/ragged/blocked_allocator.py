"""The KV block allocator: which blocks of the blocked KV cache are free, and how many holders
each used block has (prefix blocks shared by several sequences are reference counted)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch

__all__ = ["BlockedAllocator"]


def _as_ids(blocks: Iterable[int] | int | torch.Tensor) -> list[int]:
    """``blocks`` (one id, an iterable of ids or an integer tensor) as a list of Python ints."""
    if isinstance(blocks, torch.Tensor):
        if blocks.is_floating_point() or blocks.is_complex():
            raise TypeError(f"block ids must be integers, got a tensor of {blocks.dtype}.")
        return [int(b) for b in blocks.reshape(-1).tolist()]
    if isinstance(blocks, int):
        return [blocks]
    ids = list(blocks)
    for b in ids:
        if isinstance(b, bool) or not isinstance(b, int):
            raise TypeError(f"block ids must be integers, got {b!r} ({type(b).__name__}).")
    return ids


class BlockedAllocator:
    """Hands out the ``num_blocks`` blocks of a blocked KV cache and takes them back.

    Free blocks sit on a stack (the most recently freed block is reused first, its memory likely
    still warm); a used block carries a reference count, 1 after ``allocate`` and one more per
    ``share``, and returns to the free stack only when ``free`` has dropped it to 0. Every call
    checks all of its ids before changing anything, so a refused call leaves the allocator as it
    was.
    """

    def __init__(self, num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(
                f"a blocked KV cache needs at least 1 block, got num_blocks={num_blocks!r}."
            )
        self._num_blocks = num_blocks
        # Reversed so that a fresh allocator hands out 0, 1, 2, ... (easier to read in tests).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._refs: list[int] = [0] * num_blocks

    @property
    def num_blocks(self) -> int:
        """How many blocks the cache has in all."""
        return self._num_blocks

    @property
    def free_blocks(self) -> int:
        """How many blocks are free now."""
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        """How many blocks have at least one holder."""
        return self._num_blocks - len(self._free)

    def ref_count(self, block: int) -> int:
        """How many holders ``block`` has (0 when it is free)."""
        self._check_known(block)
        return self._refs[block]

    def allocate(self, num_blocks: int) -> torch.Tensor:
        """Take ``num_blocks`` free blocks (reference count 1 each) and return their ids as an
        int32 tensor; raise ValueError, allocating nothing, when fewer are free."""
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks must be an integer >= 0, got {num_blocks!r}.")
        if num_blocks > len(self._free):
            raise ValueError(
                f"cannot allocate {num_blocks} KV blocks: {len(self._free)} of "
                f"{self._num_blocks} are free; free finished sequences first or give the cache "
                "more blocks."
            )
        taken = [self._free.pop() for _ in range(num_blocks)]
        for b in taken:
            self._refs[b] = 1
        return torch.tensor(taken, dtype=torch.int32)

    def share(self, blocks: Iterable[int] | int | torch.Tensor) -> None:
        """Add one holder to each of ``blocks`` (all in use): a sequence that reuses another's
        prefix blocks takes them this way, and each holder frees them once."""
        ids = _as_ids(blocks)
        for b in ids:
            self._check_known(b)
            if self._refs[b] == 0:
                raise ValueError(f"cannot share KV block {b}: it is free; allocate it first.")
        for b in ids:
            self._refs[b] += 1

    def free(self, blocks: Iterable[int] | int | torch.Tensor) -> None:
        """Drop one holder from each of ``blocks`` (an id may appear as often as it has
        holders); a block whose count reaches 0 becomes free. Raise ValueError naming the id for
        an unknown block or one freed more often than it is held."""
        ids = _as_ids(blocks)
        for b in ids:
            self._check_known(b)
        for b, times in Counter(ids).items():
            if self._refs[b] == 0:
                raise ValueError(f"KV block {b} is already free (double free).")
            if times > self._refs[b]:
                raise ValueError(
                    f"KV block {b} is freed {times} times but has {self._refs[b]} holder(s) "
                    "(double free)."
                )
        for b in ids:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)

    def _check_known(self, block: int) -> None:
        """Raise ValueError unless ``block`` is an id of this cache."""
        if isinstance(block, bool) or not isinstance(block, int):
            raise TypeError(f"block ids must be integers, got {block!r}.")
        if not 0 <= block < self._num_blocks:
            raise ValueError(
                f"unknown KV block id {block}: this cache has blocks 0..{self._num_blocks - 1}."
            )
