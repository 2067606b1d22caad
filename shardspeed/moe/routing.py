"""The routing a gate decides: for each token and each of its k slots, which expert, where in
that expert's capacity buffer, with what combine weight, and whether it was kept.

This index form holds ``tokens x k`` entries; DeepSpeed's dense form (``tokens x experts x
capacity`` combine weights and dispatch mask) is built from it only on request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

#: the slot of a route that holds no buffer row (dropped, unused token, or outside the buffer)
DROPPED = -1


def route_slots(experts: Tensor, locations: Tensor, num_experts: int, capacity: int) -> Tensor:
    """Flat buffer row ``expert * capacity + location`` of every route, ``-1`` where dropped.

    ``experts`` and ``locations`` have one entry per route (any equal shapes). A route is dropped
    when its expert is negative (DeepSpeed's mark for a dropped route) or when either index falls
    outside the ``num_experts x capacity`` buffer, so every kept slot addresses a real row.
    Returns int64 slots of the input shape.
    """
    if experts.shape != locations.shape:
        raise ValueError(
            f"route experts {tuple(experts.shape)} and locations {tuple(locations.shape)} "
            "must have the same shape (one entry per route)"
        )
    experts, locations = experts.long(), locations.long()
    inside = (experts >= 0) & (experts < num_experts) & (locations >= 0) & (locations < capacity)
    return torch.where(inside, experts * capacity + locations, DROPPED)


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

    def slots(self) -> Tensor:
        """Route-major ``[k, S]`` int64 buffer rows of every slot, ``-1`` where not kept."""
        experts = torch.where(self.kept, self.experts, DROPPED)
        return route_slots(experts.t(), self.locations.t(), self.num_experts, self.capacity)

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

    def as_sparse_routes(
        self,
    ) -> tuple[Tensor, int, int, list[Tensor], list[Tensor], list[Tensor], Tensor]:
        """DeepSpeed's ``sparse_routes=True`` gate output: ``(l_aux, capacity, num_experts,
        indices_, locations_, gates_, exp_counts)``, each list holding one ``[S]`` tensor per
        route rank (first choices, second choices, ...). A dropped route has index -1,
        location 0 and gate 0."""
        kept = self.kept.t()
        indices = torch.where(kept, self.experts.t(), DROPPED)
        locations = self.locations.t() * kept
        gates = self.weights.t() * kept
        return (
            self.l_aux,
            self.capacity,
            self.num_experts,
            list(indices.contiguous().unbind(0)),
            list(locations.contiguous().unbind(0)),
            list(gates.contiguous().unbind(0)),
            self.exp_counts,
        )
