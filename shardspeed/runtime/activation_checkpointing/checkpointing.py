"""DeepSpeed's ``deepspeed.runtime.activation_checkpointing.checkpointing`` module.

``checkpoint(function, *args)`` is the reentrant checkpoint with DeepSpeed's options
(partitioning, contiguous buffer, CPU checkpointing; see :mod:`.partition`), driven by
:func:`configure`. ``non_reentrant_checkpoint`` wraps PyTorch's non-reentrant checkpoint and adds
what PyTorch does not know about: the model-parallel RNG tracker's streams.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.utils import _pytree as pytree

from shardspeed.runtime.activation_checkpointing import partition, state
from shardspeed.runtime.activation_checkpointing.function import (
    CheckpointFunction,
    CheckpointStats,
    detach_variable,
    get_stats,
    reset_stats,
)
from shardspeed.runtime.activation_checkpointing.rng import (
    _CUDA_RNG_STATE_TRACKER,
    _MODEL_PARALLEL_RNG_TRACKER_NAME,
    CudaRNGStatesTracker,
    get_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
)
from shardspeed.runtime.activation_checkpointing.state import (
    configure,
    is_configured,
    partition_activations_in_checkpoint,
    set_num_layers,
)

__all__ = [
    "CheckpointFunction",
    "CheckpointStats",
    "CudaRNGStatesTracker",
    "_CUDA_RNG_STATE_TRACKER",
    "_MODEL_PARALLEL_RNG_TRACKER_NAME",
    "checkpoint",
    "configure",
    "detach_variable",
    "get_cuda_rng_tracker",
    "get_stats",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "non_reentrant_checkpoint",
    "partition_activations_in_checkpoint",
    "reset",
    "reset_stats",
    "set_num_layers",
]


class _FlatCall:
    """Calls ``function`` with arguments rebuilt from flat pytree leaves.

    Used when arguments nest tensors in containers (so each tensor becomes an autograd input)
    or when an anchor leaf is appended. Holds the callable, never its parameters.
    """

    def __init__(self, function: Callable[..., Any], spec: pytree.TreeSpec, n_leaves: int):
        self.function = function
        self.spec = spec
        self.n_leaves = n_leaves

    def __call__(self, *leaves: Any) -> Any:
        args = pytree.tree_unflatten(list(leaves[: self.n_leaves]), self.spec)
        return self.function(*args)


def checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)``, keeping only ``args`` for backward and recomputing the rest there.

    Arguments and outputs may mix tensors with non-tensors (None, numbers, nested tuples, lists
    and dicts); every tensor among the arguments gets its gradient. Dropout inside draws the
    same mask in the recompute as in the forward. With grad mode off this is a plain call.
    """
    if not torch.is_grad_enabled():
        return function(*args)
    leaves, spec = pytree.tree_flatten(args)
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    nested = any(not isinstance(a, torch.Tensor) and pytree.tree_leaves(a) != [a] for a in args)
    needs_anchor = not any(t.requires_grad for t in tensors)
    run: Callable[..., Any] = function
    call_args: list[Any] = list(args)
    if nested or needs_anchor:
        run = _FlatCall(function, spec, len(leaves))
        call_args = list(leaves)
        if needs_anchor:
            # no input needs a gradient, but the block's parameters do: an empty leaf that
            # requires grad keeps the output attached to the graph so backward reaches us
            call_args.append(torch.empty(0, requires_grad=True))
    all_outputs: list[Any] = []
    out_tensors = CheckpointFunction.apply(run, all_outputs, *call_args)
    out_leaves, out_spec, tensor_indices = all_outputs[0]
    rebuilt = list(out_leaves)
    for index, tensor in zip(tensor_indices, out_tensors, strict=True):
        rebuilt[index] = tensor
    return pytree.tree_unflatten(rebuilt, out_spec)


def _tracker_contexts() -> tuple[
    contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]
]:
    """Forward/recompute context pair that replays the RNG tracker's streams."""
    snapshot: dict[str, dict[str, torch.Tensor]] = {}
    tracker = get_cuda_rng_tracker()

    @contextlib.contextmanager
    def in_forward() -> Iterator[None]:
        snapshot["states"] = tracker.get_states()
        yield

    @contextlib.contextmanager
    def in_recompute() -> Iterator[None]:
        outer = tracker.get_states()
        tracker.set_states(snapshot["states"])
        try:
            yield
        finally:
            tracker.set_states(outer)

    return in_forward(), in_recompute()


def non_reentrant_checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """Like :func:`checkpoint` but with PyTorch's non-reentrant mechanism (works with
    ``torch.autograd.grad`` and inputs that do not require grad). Partitioning, the contiguous
    buffer and CPU checkpointing do not apply here; RNG streams, tracker included, are replayed.
    """
    if not torch.is_grad_enabled():
        return function(*args)
    return torch_checkpoint.checkpoint(
        function, *args, use_reentrant=False, preserve_rng_state=True, context_fn=_tracker_contexts
    )


def reset() -> None:
    """Drop the contiguous checkpoint buffers (call after forwards that ran no backward)."""
    partition.contiguous_buffers().clear()
    state.bump_generation()
