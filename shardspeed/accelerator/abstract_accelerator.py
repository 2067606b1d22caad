"""The accelerator contract: every device-specific call the rest of shardspeed makes goes here.

The method names follow DeepSpeed's ``DeepSpeedAccelerator`` so that user code written against
``deepspeed.accelerator.get_accelerator()`` keeps working. Methods every backend must answer
differently are abstract; the few that shardspeed cannot give a meaning to (native op builders)
have one documented default here.
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Callable, Iterable, MutableMapping
from typing import Any

import torch


class DeepSpeedAccelerator(abc.ABC):
    """Abstract device backend: device naming, sync, RNG, streams, memory, dtypes, comm backend.

    ``_name`` is the device type (``"cpu"``, ``"cuda"``, ``"mps"``) and
    ``_communication_backend_name`` the torch.distributed backend used on that device; both are
    read by DeepSpeed-era user code, so subclasses set them in ``__init__``.
    """

    def __init__(self) -> None:
        self._name: str = ""
        self._communication_backend_name: str = ""
        self._compile_backend: str = "inductor"

    # ------------------------------------------------------------------ device and sync
    def is_synchronized_device(self) -> bool:
        """True when kernels run synchronously with the host (no streams to wait on)."""
        return False

    def use_host_timers(self) -> bool:
        """True when timing with host clocks is accurate (synchronous devices)."""
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        """True when the device orders dependent work itself, so no explicit stream waits."""
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        """True when the device cannot run out of memory by queuing too far ahead of the host."""
        return self.is_synchronized_device()

    @abc.abstractmethod
    def device_name(self, device_index: int | None = None) -> str:
        """Device string: ``"cuda"`` without an index, ``"cuda:N"`` with one."""

    def device(self, device_index: int | None = None) -> torch.device:
        """A ``torch.device`` for ``device_index`` (the device type alone when None)."""
        return torch.device(self.device_name(device_index))

    @abc.abstractmethod
    def set_device(self, device_index: int) -> None:
        """Make ``device_index`` this process's current device."""

    @abc.abstractmethod
    def current_device(self) -> int:
        """Index of the current device."""

    def current_device_name(self) -> str:
        """Device string of the current device, e.g. ``"cuda:0"`` or ``"cpu"``."""
        return self.device_name(self.current_device())

    @abc.abstractmethod
    def device_count(self) -> int:
        """Number of devices of this type visible to the process."""

    @abc.abstractmethod
    def synchronize(self, device_index: int | None = None) -> None:
        """Block the host until all queued work on the device is done."""

    # ------------------------------------------------------------------ RNG
    def random(self) -> Any:
        """The module holding the host RNG functions (``torch.random``)."""
        return torch.random

    @abc.abstractmethod
    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        """Restore the device RNG state."""

    @abc.abstractmethod
    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        """The device RNG state as a byte tensor."""

    @abc.abstractmethod
    def manual_seed(self, seed: int) -> None:
        """Seed the current device's RNG."""

    @abc.abstractmethod
    def manual_seed_all(self, seed: int) -> None:
        """Seed the RNG of every device of this type."""

    @abc.abstractmethod
    def initial_seed(self) -> int:
        """The seed the current device's RNG started from."""

    @abc.abstractmethod
    def default_generator(self, device_index: int) -> torch.Generator:
        """The default ``torch.Generator`` of ``device_index``."""

    # ------------------------------------------------------------------ streams and events
    @property
    @abc.abstractmethod
    def Stream(self) -> type:  # noqa: N802 - DeepSpeed's name
        """The stream class; instances work as context managers."""

    @abc.abstractmethod
    def stream(self, stream: Any) -> Any:
        """Context manager that makes ``stream`` current."""

    @abc.abstractmethod
    def current_stream(self, device_index: int | None = None) -> Any:
        """The stream work is queued on now."""

    @abc.abstractmethod
    def default_stream(self, device_index: int | None = None) -> Any:
        """The device's default stream."""

    @property
    @abc.abstractmethod
    def Event(self) -> type:  # noqa: N802 - DeepSpeed's name
        """The event class (``record``, ``synchronize``, ``elapsed_time``)."""

    # ------------------------------------------------------------------ memory
    @abc.abstractmethod
    def empty_cache(self) -> None:
        """Return cached, unused device memory to the system."""

    @abc.abstractmethod
    def memory_allocated(self, device_index: int | None = None) -> int:
        """Bytes in use now."""

    @abc.abstractmethod
    def max_memory_allocated(self, device_index: int | None = None) -> int:
        """Peak bytes in use since the last reset."""

    @abc.abstractmethod
    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        """Start a new peak window for :meth:`max_memory_allocated`."""

    def memory_cached(self, device_index: int | None = None) -> int:
        """Old name of :meth:`memory_reserved`."""
        return self.memory_reserved(device_index)

    def max_memory_cached(self, device_index: int | None = None) -> int:
        """Old name of :meth:`max_memory_reserved`."""
        return self.max_memory_reserved(device_index)

    def reset_max_memory_cached(self, device_index: int | None = None) -> None:
        """Old name of :meth:`reset_peak_memory_stats`."""
        self.reset_peak_memory_stats(device_index)

    @abc.abstractmethod
    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        """Allocator statistics (keys as in ``torch.cuda.memory_stats`` where they apply)."""

    @abc.abstractmethod
    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        """Reset every peak statistic."""

    @abc.abstractmethod
    def memory_reserved(self, device_index: int | None = None) -> int:
        """Bytes held by the allocator (in use or cached)."""

    @abc.abstractmethod
    def max_memory_reserved(self, device_index: int | None = None) -> int:
        """Peak of :meth:`memory_reserved` since the last reset."""

    @abc.abstractmethod
    def total_memory(self, device_index: int | None = None) -> int:
        """Total bytes of device memory."""

    @abc.abstractmethod
    def available_memory(self, device_index: int | None = None) -> int:
        """Bytes that can still be allocated."""

    # ------------------------------------------------------------------ dtypes and capabilities
    @abc.abstractmethod
    def is_bf16_supported(self) -> bool:
        """Whether bfloat16 tensors and math work on this device."""

    @abc.abstractmethod
    def is_fp16_supported(self) -> bool:
        """Whether float16 tensors and math work on this device."""

    def supported_dtypes(self) -> list[torch.dtype]:
        """The floating-point dtypes training may use on this device."""
        dtypes = [torch.float32]
        if self.is_fp16_supported():
            dtypes.append(torch.float16)
        if self.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        return dtypes

    def amp(self) -> Any:
        """The autocast module (``torch.amp``); ``torch.autocast(device_type=...)`` is generic."""
        return torch.amp

    @abc.abstractmethod
    def is_available(self) -> bool:
        """Whether this device type can be used in this process."""

    def is_triton_supported(self) -> bool:
        """Whether Triton kernels can run here; shardspeed ships none, so only a capability probe."""
        return False

    # ------------------------------------------------------------------ profiling ranges
    def range_push(self, msg: str) -> None:
        """Open a named profiler range (no-op where the device has no range API)."""
        return None

    def range_pop(self) -> None:
        """Close the innermost profiler range (no-op where the device has no range API)."""
        return None

    def lazy_call(self, callback: Callable[[], Any]) -> Any:
        """Run ``callback`` once the device is initialized; eager devices run it now."""
        return callback()

    # ------------------------------------------------------------------ communication
    def communication_backend_name(self) -> str:
        """The torch.distributed backend for this device (``"nccl"``, ``"gloo"``)."""
        return self._communication_backend_name

    # ------------------------------------------------------------------ graphs
    def create_graph(self) -> Any:
        """A device graph object, or None where the device cannot capture graphs."""
        return None

    def capture_to_graph(self, graph: Any, pool: Any = None, stream: Any = None) -> Any:
        """Context manager capturing into ``graph``; a no-op context where graphs do not exist."""
        import contextlib

        return contextlib.nullcontext()

    def replay_graph(self, graph: Any) -> None:
        """Replay a captured graph (no-op where graphs do not exist)."""
        return None

    # ------------------------------------------------------------------ tensor constructors
    def _tensor_ctor(self, dtype: torch.dtype) -> Callable[..., torch.Tensor]:
        # DeepSpeed's CUDA accelerator hands out ``torch.tensor`` bound to a dtype and device
        # rather than the legacy ``torch.cuda.FloatTensor`` classes; every backend does the same
        # here so device-agnostic code behaves alike.
        return functools.partial(torch.tensor, dtype=dtype, device=self._name)

    @property
    def BFloat16Tensor(self) -> Callable[..., torch.Tensor]:  # noqa: N802 - DeepSpeed's name
        return self._tensor_ctor(torch.bfloat16)

    @property
    def ByteTensor(self) -> Callable[..., torch.Tensor]:  # noqa: N802 - DeepSpeed's name
        return self._tensor_ctor(torch.uint8)

    @property
    def DoubleTensor(self) -> Callable[..., torch.Tensor]:  # noqa: N802 - DeepSpeed's name
        return self._tensor_ctor(torch.float64)

    @property
    def FloatTensor(self) -> Callable[..., torch.Tensor]:  # noqa: N802 - DeepSpeed's name
        return self._tensor_ctor(torch.float32)

    @property
    def HalfTensor(self) -> Callable[..., torch.Tensor]:  # noqa: N802 - DeepSpeed's name
        return self._tensor_ctor(torch.float16)

    @property
    def IntTensor(self) -> Callable[..., torch.Tensor]:  # noqa: N802 - DeepSpeed's name
        return self._tensor_ctor(torch.int32)

    @property
    def LongTensor(self) -> Callable[..., torch.Tensor]:  # noqa: N802 - DeepSpeed's name
        return self._tensor_ctor(torch.int64)

    # ------------------------------------------------------------------ pinning
    @abc.abstractmethod
    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        """``tensor`` in page-locked host memory where the device benefits from it."""

    @abc.abstractmethod
    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is in page-locked host memory."""

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives on this accelerator's device type."""
        return tensor.device.type == self._name

    # ------------------------------------------------------------------ op builders
    def op_builder_dir(self) -> str | None:
        """None: shardspeed is pure Python and has no native op builders to locate."""
        return None

    def create_op_builder(self, class_name: str) -> Any:
        """None: shardspeed has no native ops; its optimizers are written in PyTorch."""
        return None

    def get_op_builder(self, class_name: str) -> Any:
        """None: shardspeed has no native ops; its optimizers are written in PyTorch."""
        return None

    def build_extension(self) -> Any:
        """None: there is no C++/CUDA extension to build."""
        return None

    # ------------------------------------------------------------------ environment
    def export_envs(self) -> list[str]:
        """Prefixes of environment variables the launcher forwards to remote ranks."""
        return []

    def visible_devices_envs(self) -> list[str]:
        """Environment variables that restrict which devices a process sees."""
        return ["CUDA_VISIBLE_DEVICES"]

    def set_visible_devices_envs(
        self, current_env: MutableMapping[str, str], local_accelerator_ids: Iterable[int]
    ) -> None:
        """Write ``local_accelerator_ids`` into every variable of :meth:`visible_devices_envs`."""
        value = ",".join(str(i) for i in local_accelerator_ids)
        for name in self.visible_devices_envs():
            current_env[name] = value

    # ------------------------------------------------------------------ compile
    def get_compile_backend(self) -> str:
        """The ``torch.compile`` backend the engine uses (``"inductor"`` unless changed)."""
        return self._compile_backend

    def set_compile_backend(self, backend: str) -> None:
        """Choose the ``torch.compile`` backend; it must be one torch.compile knows."""
        # importing dynamo is slow, so only the setter pays for the validation
        import torch._dynamo

        known = torch._dynamo.list_backends(exclude_tags=())
        if backend not in known:
            raise ValueError(
                f"compile backend {backend!r} is not known to torch.compile; "
                f"choose one of {sorted(known)}"
            )
        self._compile_backend = backend

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self._name!r}, backend={self._communication_backend_name!r})"
