"""``CheckpointFunction``: run a block without keeping its activations, rerun it in backward.

Forward runs the block under ``no_grad`` and saves only its inputs (partitioned, in a contiguous
buffer or in host memory as configured) plus the RNG and autocast states. Backward restores the
inputs and the states, runs the block again with autograd on, and back-propagates through that
fresh graph. The block is *called* again, never replayed from captured tensors: module hooks
fire in the recompute exactly as in the forward, so a ZeRO-3 pre-forward hook can gather the
parameters again, and no parameter tensor is held by the checkpoint.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from shardspeed.accelerator import get_accelerator
from shardspeed.runtime.activation_checkpointing import partition, state
from shardspeed.runtime.activation_checkpointing.rng import RNGSnapshot
from shardspeed.utils.logging import log_dist

__all__ = ["CheckpointFunction", "CheckpointStats", "detach_variable", "get_stats", "reset_stats"]


@dataclass
class CheckpointStats:
    """What checkpoints stored since the last :func:`reset_stats`, for tests and profiling."""

    checkpoints: int = 0
    recomputes: int = 0
    saved_bytes: int = 0
    saved_tensors: int = 0
    partitioned_tensors: int = 0
    offloaded_tensors: int = 0
    saved_devices: set[str] = field(default_factory=set)
    forward_seconds: float = 0.0
    recompute_seconds: float = 0.0


_STATS = CheckpointStats()


def get_stats() -> CheckpointStats:
    """The running counters."""
    return _STATS


def reset_stats() -> None:
    """Zero the counters."""
    global _STATS
    _STATS = CheckpointStats()


def detach_variable(inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    """``inputs`` with every tensor detached, keeping its ``requires_grad`` (DeepSpeed helper)."""
    out = []
    for item in inputs:
        if isinstance(item, torch.Tensor):
            detached = item.detach()
            detached.requires_grad_(item.requires_grad)
            out.append(detached)
        else:
            out.append(item)
    return tuple(out)


def _placement(cfg: state.CheckpointingSettings) -> partition.Placement:
    if not cfg.partition_activations:
        return partition.Placement(cpu=cfg.cpu_checkpointing)
    return partition.Placement(
        partition=True,
        cpu=cfg.cpu_checkpointing,
        contiguous=cfg.contiguous_memory_optimization,
        group=state.model_parallel_group(),
        world_size=state.model_parallel_world_size(),
        rank=state.model_parallel_rank(),
    )


@dataclass(frozen=True)
class _AutocastState:
    """Autocast on/off and dtype for the host and the accelerator device, at forward time."""

    modes: tuple[tuple[str, bool, torch.dtype], ...]

    @classmethod
    def capture(cls) -> _AutocastState:
        kinds = dict.fromkeys(["cpu", get_accelerator().device_name()])
        return cls(
            tuple((k, torch.is_autocast_enabled(k), torch.get_autocast_dtype(k)) for k in kinds)
        )

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for kind, enabled, dtype in self.modes:
                stack.enter_context(torch.autocast(device_type=kind, enabled=enabled, dtype=dtype))
            yield


@contextlib.contextmanager
def _boundary(cfg: state.CheckpointingSettings, what: str) -> Iterator[None]:
    """Synchronize around a checkpoint's forward or recompute, and time it, as configured."""
    accel = get_accelerator()
    if cfg.synchronize or cfg.profile:
        accel.synchronize()
    start = time.perf_counter()
    yield
    if cfg.synchronize or cfg.profile:
        accel.synchronize()
    if cfg.profile:
        elapsed = time.perf_counter() - start
        if what == "forward":
            _STATS.forward_seconds += elapsed
        else:
            _STATS.recompute_seconds += elapsed
        log_dist(f"activation checkpoint {what}: {elapsed * 1e3:.3f} ms", ranks=[0])


def _ensure_buffers_current(cfg: state.CheckpointingSettings) -> None:
    buffers = partition.contiguous_buffers()
    if buffers.sized_for != cfg.generation:
        # settings changed since the buffers were sized: start over
        buffers.clear()
        buffers.sized_for = cfg.generation


class CheckpointFunction(torch.autograd.Function):
    """``CheckpointFunction.apply(function, all_outputs, *args)``.

    Returns the tensors among ``function(*args)``'s (pytree-flattened) outputs; appends
    ``(leaves, spec, tensor_indices)`` of the full output to ``all_outputs`` so the caller can
    rebuild the original structure with non-tensor outputs in place (see ``checkpoint``).
    """

    @staticmethod
    def forward(  # type: ignore[override]  # autograd's signature is variadic
        ctx: Any, run_function: Callable[..., Any], all_outputs: list[Any], *args: Any
    ) -> tuple[torch.Tensor, ...]:
        cfg = state.settings()
        ctx.run_function = run_function
        ctx.cfg = cfg
        ctx.placement = _placement(cfg)
        ctx.rng = RNGSnapshot.capture()
        ctx.autocast = _AutocastState.capture()
        ctx.set_materialize_grads(False)

        with _boundary(cfg, "forward"), torch.no_grad():
            outputs = run_function(*args)

        ctx.inputs = [None if isinstance(a, torch.Tensor) else a for a in args]
        ctx.tensor_positions, ctx.infos, ctx.handles = _stash_inputs(ctx, cfg, args)

        leaves, spec = pytree.tree_flatten(outputs)
        tensor_indices = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        all_outputs.append((leaves, spec, tensor_indices))
        out_tensors = tuple(leaves[i] for i in tensor_indices)
        not_differentiable = [
            t for t in out_tensors if not (t.is_floating_point() or t.is_complex())
        ]
        ctx.mark_non_differentiable(*not_differentiable)
        return out_tensors

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor | None) -> tuple[Any, ...]:
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError(
                "shardspeed.checkpointing.checkpoint recomputes in backward and does not work "
                "with torch.autograd.grad(); use .backward(), or non_reentrant_checkpoint."
            )
        inputs = list(ctx.inputs)
        for position, stored, info in zip(
            ctx.tensor_positions, ctx.saved_tensors, ctx.infos, strict=True
        ):
            inputs[position] = partition.restore_tensor(stored, info, ctx.placement)

        with _boundary(ctx.cfg, "recompute"):
            with ctx.rng.replay(), torch.enable_grad(), ctx.autocast.applied():
                outputs = ctx.run_function(*inputs)
            _STATS.recomputes += 1
            leaves = pytree.tree_leaves(outputs)
            out_tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
            pairs = [
                (out, grad)
                for out, grad in zip(out_tensors, grad_outputs, strict=True)
                if grad is not None and out.requires_grad
            ]
            if pairs:
                torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs])

        # slots go back only now: a nested checkpoint in the recompute must not take the slot
        # whose storage the restored input (world size 1) still shares
        for handle in ctx.handles:
            partition.contiguous_buffers().release(handle)
        grads = tuple(
            item.grad if isinstance(item, torch.Tensor) and item.requires_grad else None
            for item in inputs
        )
        return (None, None, *grads)


def _stash_inputs(
    ctx: Any, cfg: state.CheckpointingSettings, args: tuple[Any, ...]
) -> tuple[list[int], list[partition.StashedTensor], list[Any]]:
    """Save the tensor arguments as the placement says; returns positions, infos, slot handles."""
    if ctx.placement.contiguous:
        _ensure_buffers_current(cfg)
    positions: list[int] = []
    infos: list[partition.StashedTensor] = []
    handles: list[Any] = []
    stored: list[torch.Tensor] = []
    for position, arg in enumerate(args):
        if not isinstance(arg, torch.Tensor):
            continue
        saved, info, handle = partition.stash_tensor(
            arg, position, ctx.placement, cfg.num_checkpoints
        )
        positions.append(position)
        infos.append(info)
        stored.append(saved)
        if handle is not None:
            handles.append(handle)
        _STATS.saved_tensors += 1
        _STATS.saved_bytes += saved.numel() * saved.element_size()
        _STATS.saved_devices.add(saved.device.type)
        _STATS.partitioned_tensors += int(info.partitioned)
        _STATS.offloaded_tensors += int(info.offloaded)
    _STATS.checkpoints += 1
    ctx.save_for_backward(*stored)
    return positions, infos, handles
