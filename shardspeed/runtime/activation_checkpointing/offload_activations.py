"""DeepSpeed's ``offload_activations``: the inputs of activation checkpoints (a decoder
layer's ``hidden_states``) kept in host memory between forward and backward (ALST).

With non-reentrant checkpointing (``use_reentrant=False``, Hugging Face's default) a layer's
input is the one tensor a checkpoint saves for backward, through autograd's saved-tensor
hooks. Inside :class:`CheckpointHiddenStatesOffload` (a ``saved_tensors_hooks`` context)
marked tensors are copied to host memory when saved and copied back when backward needs them;
every other saved tensor passes untouched. While the context is active, Hugging Face's
``GradientCheckpointingLayer.__call__`` marks its first argument (the hidden states) of a
checkpointed call in training; :meth:`~CheckpointHiddenStatesOffload.mark` marks any tensor.
The last ``keep_last_count`` marked tensors stay on the device (backward needs them first).
Backward must run inside the same context as the forward.

Copies run on the current stream (pinned host buffers make them asynchronous); DeepSpeed's
side stream and buffer pool are not reproduced, their arguments are accepted.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks

__all__ = [
    "CheckpointActivationOffloadStats",
    "CheckpointHiddenStatesOffload",
    "get_checkpoint_hidden_states_offloading_ctx_manager",
    "patch_gradient_checkpointing_layer_marker",
]


@dataclass
class CheckpointActivationOffloadStats:
    """Counts of one context's work (DeepSpeed's fields)."""

    saved_tensors_seen: int = 0
    marked_tensors: int = 0
    offloaded_tensors: int = 0
    restored_tensors: int = 0
    skipped_marked_tensors: int = 0
    kept_last_tensors: int = 0
    offloaded_bytes: int = 0
    restored_bytes: int = 0


@dataclass(frozen=True)
class _Ref:
    """What a saved tensor is replaced with while it is away."""

    tensor_id: int


_STATE = threading.local()
_PATCH_LOCK = threading.Lock()
_ORIGINAL_CALL: dict[str, Any] = {}


def _stack() -> list[CheckpointHiddenStatesOffload]:
    if not hasattr(_STATE, "stack"):
        _STATE.stack = []
    return _STATE.stack  # type: ignore[no-any-return]


def patch_gradient_checkpointing_layer_marker() -> bool:
    """Make ``transformers.GradientCheckpointingLayer`` mark its hidden states for the active
    context; False when transformers (>= 4.52) is not there."""
    with _PATCH_LOCK:
        if "call" in _ORIGINAL_CALL:
            return True
        try:
            from transformers import GradientCheckpointingLayer
        except ImportError:
            return False
        original = GradientCheckpointingLayer.__call__

        def marking_call(self: Any, *args: Any, **kwargs: Any) -> Any:
            stack = _stack()
            manager = stack[-1] if stack else None
            marked = None
            if (
                manager is not None
                and self.training
                and torch.is_grad_enabled()
                and getattr(self, "gradient_checkpointing", False)
                and args
                and isinstance(args[0], torch.Tensor)
            ):
                marked = args[0]  # the checkpoint saves its positional inputs
                manager.mark(marked)
            try:
                return original(self, *args, **kwargs)
            finally:
                if marked is not None:
                    manager._consume_mark(marked)  # type: ignore[union-attr]

        _ORIGINAL_CALL["call"] = GradientCheckpointingLayer.__dict__.get("__call__")
        GradientCheckpointingLayer.__call__ = marking_call  # type: ignore[method-assign]
        return True


def _unpatch() -> None:
    with _PATCH_LOCK:
        if "call" not in _ORIGINAL_CALL:
            return
        from transformers import GradientCheckpointingLayer

        original = _ORIGINAL_CALL.pop("call")
        if original is None:
            del GradientCheckpointingLayer.__call__
        else:
            GradientCheckpointingLayer.__call__ = original  # type: ignore[method-assign]


class CheckpointHiddenStatesOffload(saved_tensors_hooks):
    """Keep marked saved tensors in host memory between forward and backward.

    ``offload_host_tensors``: also copy marked tensors that already live on the host (to a
    fresh host buffer): no memory gained, the path exercised without an accelerator.
    """

    def __init__(
        self,
        use_pin_memory: bool = True,
        use_streams: bool = True,
        min_offload_bytes: int = 1024,
        max_fwd_stash_count: int = 2,
        max_cpu_buffer_pool_count: int = 64,
        keep_last_count: int = 1,
        offload_host_tensors: bool = False,
    ) -> None:
        for name, value in (
            ("keep_last_count", keep_last_count),
            ("max_fwd_stash_count", max_fwd_stash_count),
            ("max_cpu_buffer_pool_count", max_cpu_buffer_pool_count),
            ("min_offload_bytes", min_offload_bytes),
        ):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        self.use_pin_memory = use_pin_memory
        self.use_streams = use_streams
        self.min_offload_bytes = min_offload_bytes
        self.keep_last_count = keep_last_count
        self.offload_host_tensors = offload_host_tensors
        self.stats = CheckpointActivationOffloadStats()
        self._marks: dict[int, int] = {}
        self._next_id = 0
        self._kept: dict[int, torch.Tensor] = {}  # oldest first
        self._host: dict[int, tuple[torch.Tensor, torch.device]] = {}
        self._restored: dict[int, torch.Tensor] = {}
        self._patched = False
        super().__init__(self._pack, self._unpack)

    def mark(self, tensor: torch.Tensor) -> None:
        """Offload ``tensor`` when autograd saves it next (once per mark)."""
        self._marks[id(tensor)] = self._marks.get(id(tensor), 0) + 1
        self.stats.marked_tensors += 1

    def _consume_mark(self, tensor: torch.Tensor) -> bool:
        count = self._marks.get(id(tensor), 0)
        if count <= 0:
            return False
        if count == 1:
            del self._marks[id(tensor)]
        else:
            self._marks[id(tensor)] = count - 1
        return True

    def host_bytes(self) -> int:
        """Bytes held in host memory now."""
        return sum(t.untyped_storage().nbytes() for t, _ in self._host.values())

    def _offloadable(self, tensor: torch.Tensor) -> bool:
        if isinstance(tensor, torch.nn.Parameter):
            return False
        if tensor.element_size() * tensor.nelement() < self.min_offload_bytes:
            return False
        if tensor.numel() > 1 and 0 in tensor.stride():  # overlapping views cannot be copied
            return False
        return tensor.device.type != "cpu" or self.offload_host_tensors

    def _pack(self, tensor: torch.Tensor) -> Any:
        self.stats.saved_tensors_seen += 1
        if not self._consume_mark(tensor):
            return tensor
        if not self._offloadable(tensor):
            self.stats.skipped_marked_tensors += 1
            return tensor
        self._next_id += 1
        self._kept[self._next_id] = tensor
        while len(self._kept) > self.keep_last_count:
            oldest = next(iter(self._kept))
            self._to_host(oldest, self._kept.pop(oldest))
        return _Ref(self._next_id)

    def _to_host(self, tensor_id: int, tensor: torch.Tensor) -> None:
        pin = self.use_pin_memory and tensor.device.type != "cpu"
        host = torch.empty_strided(
            tensor.size(), tensor.stride(), dtype=tensor.dtype, device="cpu", pin_memory=pin
        )
        host.copy_(tensor.detach(), non_blocking=pin)
        self._host[tensor_id] = (host, tensor.device)
        self.stats.offloaded_tensors += 1
        self.stats.offloaded_bytes += host.untyped_storage().nbytes()

    def _unpack(self, packed: Any) -> Any:
        if not isinstance(packed, _Ref):
            return packed
        key = packed.tensor_id
        if key in self._restored:  # unpacked twice (a recompute and its backward)
            return self._restored[key]
        if key in self._kept:
            self.stats.kept_last_tensors += 1
            tensor = self._kept.pop(key)
        elif key in self._host:
            host, device = self._host.pop(key)
            tensor = torch.empty_strided(
                host.size(), host.stride(), dtype=host.dtype, device=device
            )
            tensor.copy_(host, non_blocking=host.is_pinned())
            self.stats.restored_tensors += 1
            self.stats.restored_bytes += tensor.element_size() * tensor.nelement()
        else:
            raise RuntimeError(
                f"offloaded activation {key} is no longer held: backward() must run inside "
                "the same CheckpointHiddenStatesOffload context as forward()"
            )
        self._restored[key] = tensor
        return tensor

    def reset(self) -> None:
        """Forget every held tensor and count."""
        self.stats = CheckpointActivationOffloadStats()
        self._marks.clear()
        self._kept.clear()
        self._host.clear()
        self._restored.clear()
        self._next_id = 0

    def __enter__(self) -> CheckpointHiddenStatesOffload:  # type: ignore[override]  # self, not None
        if self in _stack():
            raise RuntimeError(
                "CheckpointHiddenStatesOffload is not re-entrant: use another instance for a "
                "nested context"
            )
        self._patched = patch_gradient_checkpointing_layer_marker() and len(_stack()) == 0
        self.reset()
        _stack().append(self)
        super().__enter__()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        stats = self.stats
        self.reset()
        self.stats = stats  # the counts stay readable after the block
        _stack().remove(self)
        if not _stack():
            _unpatch()
        super().__exit__(*exc_info)


def get_checkpoint_hidden_states_offloading_ctx_manager(
    use_pin_memory: bool = True,
    use_streams: bool = True,
    min_offload_bytes: int = 1024,
    max_fwd_stash_count: int = 2,
    max_cpu_buffer_pool_count: int = 64,
    keep_last_count: int = 1,
) -> CheckpointHiddenStatesOffload:
    """A :class:`CheckpointHiddenStatesOffload` (DeepSpeed's factory)."""
    return CheckpointHiddenStatesOffload(
        use_pin_memory=use_pin_memory,
        use_streams=use_streams,
        min_offload_bytes=min_offload_bytes,
        max_fwd_stash_count=max_fwd_stash_count,
        max_cpu_buffer_pool_count=max_cpu_buffer_pool_count,
        keep_last_count=keep_last_count,
    )
