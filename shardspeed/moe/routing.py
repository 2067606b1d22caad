"""The routing a gate decides: for each token and each of its k slots, which expert, where in
that expert's capacity buffer, with what combine weight, and whether it was kept.

This index form holds ``tokens x k`` entries; DeepSpeed's dense form (``tokens x experts x
capacity`` combine weights and dispatch mask) is built from it only on request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Routing:
    """Gate decisions for ``S`` tokens with ``k`` slots each (all tensors are ``[S, k]``)."""

    l_aux: Tensor
    exp_counts: Tensor
    capacity: int
    num_experts: int
    experts: Tensor  # long: expert chosen for the slot
    locations: Tensor  # long: row in that expert's capacity buffer (valid where kept)
    weights: Tensor  # float: combine weight, 0 where dropped
    kept: Tensor  # bool: the slot survived capacity and ``used_token`` masking

    @property
    def num_tokens(self) -> int:
        return int(self.experts.shape[0])

    def flat_slots(self) -> tuple[Tensor, Tensor, Tensor]:
        """(token index, buffer row ``expert * capacity + location``, weight) of kept slots."""
        k = self.experts.shape[1]
        keep = self.kept.reshape(-1)
        token = torch.arange(self.num_tokens, device=self.experts.device).repeat_interleave(k)
        row = (self.experts * self.capacity + self.locations).reshape(-1)
        return token[keep], row[keep], self.weights.reshape(-1)[keep]

    def combine_weights(self) -> Tensor:
        """DeepSpeed's dense ``[S, E, C]`` combine weights (memory heavy; for parity checks)."""
        token, row, weight = self.flat_slots()
        dense = self.weights.new_zeros(self.num_tokens, self.num_experts * self.capacity)
        dense = dense.index_put((token, row), weight, accumulate=True)
        return dense.reshape(self.num_tokens, self.num_experts, self.capacity)

    def as_deepspeed_tuple(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(l_aux, combine_weights, dispatch_mask, exp_counts)`` as DeepSpeed's gates return."""
        combine = self.combine_weights()
        return self.l_aux, combine, combine.bool(), self.exp_counts
