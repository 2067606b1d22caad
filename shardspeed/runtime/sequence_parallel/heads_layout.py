"""How a sequence-parallel group of ``sp`` ranks splits one attention layer's work.

Ulysses trades the sequence for heads with an all-to-all, so it needs the query heads divisible
by the ranks it spans, and the key/value heads either divisible by them too or dividing them
(fewer key/value heads than ranks: each is replicated to the ranks whose query heads read it).
When ``sp`` does not fit the heads, the group is viewed as ``sp = u x r``: Ulysses over ``u``
consecutive ranks (the largest ``u`` that fits the heads), and exact ring attention across the
``r`` Ulysses groups, each holding one contiguous block of the sequence ("USP", arXiv
2405.07719). ``u = sp`` is plain Ulysses (DeepSpeed's only mode), ``u = 1`` plain ring.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["HeadsLayout", "plan_heads_layout"]


@dataclass(frozen=True)
class HeadsLayout:
    """The split of ``q_heads`` query and ``kv_heads`` key/value heads over ``sp`` ranks."""

    q_heads: int
    kv_heads: int
    sp: int
    #: ranks of one Ulysses all-to-all (consecutive sequence-parallel ranks)
    ulysses: int
    #: Ulysses groups the ring passes keys and values around
    ring: int

    @property
    def kv_replication(self) -> int:
        """Copies of each key/value head sent out (> 1 when fewer kv heads than Ulysses ranks)."""
        return max(self.ulysses // self.kv_heads, 1)

    @property
    def local_q_heads(self) -> int:
        """Query heads each rank attends over after the all-to-all."""
        return self.q_heads // self.ulysses

    @property
    def local_kv_heads(self) -> int:
        """Key/value heads each rank holds after the all-to-all."""
        return self.kv_heads * self.kv_replication // self.ulysses

    @property
    def mode(self) -> str:
        """``"ulysses"``, ``"ring"`` or ``"ulysses x ring"``."""
        if self.ring == 1:
            return "ulysses"
        return "ring" if self.ulysses == 1 else "ulysses x ring"

    def describe(self) -> str:
        """One line for the log: the mode and the sizes it picked."""
        text = (
            f"sequence parallel attention: {self.mode} (sp={self.sp}: ulysses {self.ulysses} x "
            f"ring {self.ring}; {self.q_heads} query / {self.kv_heads} key-value heads, "
            f"{self.local_q_heads} / {self.local_kv_heads} per rank"
        )
        if self.kv_replication > 1:
            text += f", key-value heads replicated x{self.kv_replication}"
        return text + ")"


def _fits(q_heads: int, kv_heads: int, ulysses: int) -> bool:
    """Whether an all-to-all over ``ulysses`` ranks can split these heads."""
    if q_heads % ulysses:
        return False
    # each rank's query heads must read key/value heads it holds: either the kv heads split
    # evenly, or each kv head is copied to the ulysses / kv_heads ranks of its query group
    return kv_heads % ulysses == 0 or ulysses % kv_heads == 0


def plan_heads_layout(q_heads: int, kv_heads: int, sp: int) -> HeadsLayout:
    """The layout with the largest Ulysses part: all-to-all is cheaper than the ring's
    ``r - 1`` key/value passes, and the ring's blocks need no head split at all."""
    for name, value in (("q_heads", q_heads), ("kv_heads", kv_heads), ("sp", sp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if q_heads % kv_heads:
        raise ValueError(
            f"{q_heads} query heads are not a multiple of {kv_heads} key/value heads; grouped "
            "query attention needs num_attention_heads divisible by num_key_value_heads"
        )
    ulysses = max(u for u in range(1, sp + 1) if sp % u == 0 and _fits(q_heads, kv_heads, u))
    return HeadsLayout(q_heads, kv_heads, sp, ulysses, sp // ulysses)
