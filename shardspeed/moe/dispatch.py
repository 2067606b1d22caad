"""Index-based dispatch and combine: tokens into per-expert capacity buffers and back.

Equivalent to DeepSpeed's ``einsum("sec,sm->ecm", dispatch_mask, x)`` and
``einsum("sec,ecm->sm", combine_weights, y)`` but gathers and scatters rows by index, so memory
is ``tokens x k`` indices instead of ``tokens x experts x capacity`` masks.
"""

from __future__ import annotations

from torch import Tensor

from shardspeed.moe.routing import Routing


def dispatch(tokens: Tensor, routing: Routing) -> Tensor:
    """``[S, M]`` tokens -> ``[E, C, M]`` expert buffers; unfilled rows are zero."""
    token, row, _ = routing.flat_slots()
    model_dim = tokens.shape[-1]
    buffer = tokens.new_zeros(routing.num_experts * routing.capacity, model_dim)
    buffer = buffer.index_add(0, row, tokens[token])
    return buffer.reshape(routing.num_experts, routing.capacity, model_dim)


def combine(expert_output: Tensor, routing: Routing) -> Tensor:
    """``[E, C, M]`` expert outputs -> ``[S, M]``: each token's kept slots, weighted and summed."""
    token, row, weight = routing.flat_slots()
    model_dim = expert_output.shape[-1]
    rows = expert_output.reshape(-1, model_dim)[row] * weight.to(expert_output.dtype).unsqueeze(1)
    out = expert_output.new_zeros(routing.num_tokens, model_dim)
    return out.index_add(0, token, rows)
