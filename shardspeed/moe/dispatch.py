"""Index-based dispatch and combine: tokens into per-expert capacity buffers and back.

Equivalent to DeepSpeed's ``einsum("sec,sm->ecm", dispatch_mask, x)`` and
``einsum("sec,ecm->sm", combine_weights, y)`` but moves rows by slot index (see
``routing.route_slots``), so routing holds ``k x tokens`` indices instead of
``tokens x experts x capacity`` masks, and no step depends on how many routes were dropped
(no host sync, shapes fixed by ``k``, tokens, experts and capacity alone).

Slots are route-major ``[k, S]``: row ``j`` holds every token's ``j``-th route.
"""

from __future__ import annotations

from torch import Tensor

from shardspeed.moe.routing import Routing


def _check_slots(slots: Tensor, num_tokens: int) -> None:
    if slots.dim() != 2 or slots.shape[1] != num_tokens:
        raise ValueError(f"slots must be [k, tokens] = [k, {num_tokens}], got {tuple(slots.shape)}")


def encode(tokens: Tensor, slots: Tensor, num_experts: int, capacity: int) -> Tensor:
    """``[S, M]`` tokens -> ``[E, C, M]`` expert buffers: each kept route's token in its slot.

    Unfilled rows are zero; a slot named by two routes holds their sum, as the einsum does.
    """
    _check_slots(slots, tokens.shape[0])
    rows = num_experts * capacity
    # dropped routes land in one extra sink row that is cut off afterwards: no boolean
    # filtering, so the op count and shapes never depend on the routing
    sink = slots.masked_fill(slots < 0, rows)
    buffer = tokens.new_zeros(rows + 1, tokens.shape[1])
    for route in sink:
        # one index_add per route rank (k is small): no [k * S, M] copy of the tokens
        buffer.index_add_(0, route, tokens)
    return buffer[:rows].reshape(num_experts, capacity, tokens.shape[1])


def decode(expert_rows: Tensor, slots: Tensor, gates: Tensor, num_tokens: int) -> Tensor:
    """``[E * C, M]`` expert outputs -> ``[S, M]``: each token's kept slots, gate-weighted, summed.

    ``gates`` is ``[k, S]`` like ``slots``; it is cast to the outputs' dtype, as DeepSpeed's
    combine weights are (``type_as``). A dropped route contributes nothing, whatever its gate.
    """
    _check_slots(slots, num_tokens)
    if gates.shape != slots.shape:
        raise ValueError(f"gates {tuple(gates.shape)} must match slots {tuple(slots.shape)}")
    kept = slots >= 0
    # a dropped route reads row 0 with weight 0: the same zero as the dense combine weight,
    # without padding (copying) the expert outputs with a zero row
    weights = (gates * kept).to(expert_rows.dtype)
    # one gather for all k route ranks: its backward is a single scatter into one zero
    # [E * C, M] buffer, where a gather per rank would allocate and sum k of them
    picked = expert_rows.index_select(0, slots.clamp_min(0).reshape(-1))
    picked = picked.reshape(*slots.shape, expert_rows.shape[1]) * weights.unsqueeze(-1)
    return picked.sum(dim=0)


def dispatch(tokens: Tensor, routing: Routing) -> Tensor:
    """``[S, M]`` tokens -> ``[E, C, M]`` expert buffers; unfilled rows are zero."""
    return encode(tokens, routing.slots(), routing.num_experts, routing.capacity)


def combine(expert_output: Tensor, routing: Routing) -> Tensor:
    """``[E, C, M]`` expert outputs -> ``[S, M]``: each token's kept slots, weighted and summed."""
    rows = expert_output.reshape(-1, expert_output.shape[-1])
    return decode(rows, routing.slots(), routing.weights.t(), routing.num_tokens)
