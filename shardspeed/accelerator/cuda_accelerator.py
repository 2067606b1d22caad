"""The CUDA backend (also ROCm builds of torch, which answer to ``torch.cuda``): NCCL."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shardspeed.accelerator.abstract_accelerator import DeepSpeedAccelerator


class CUDA_Accelerator(DeepSpeedAccelerator):  # noqa: N801 - DeepSpeed's class name
    """NVIDIA (or AMD through ROCm) GPUs through ``torch.cuda``."""

    def __init__(self) -> None:
        super().__init__()
        self._name = "cuda"
        self._communication_backend_name = "nccl"

    def _index(self, device_index: int | None) -> int:
        return torch.cuda.current_device() if device_index is None else device_index

    # device and sync
    def device_name(self, device_index: int | None = None) -> str:
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def set_device(self, device_index: int) -> None:
        torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def synchronize(self, device_index: int | None = None) -> None:
        torch.cuda.synchronize(device_index)

    # RNG
    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        torch.cuda.set_rng_state(new_state, device="cuda" if device_index is None else device_index)

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.cuda.get_rng_state(device="cuda" if device_index is None else device_index)

    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed()

    def default_generator(self, device_index: int) -> torch.Generator:
        return torch.cuda.default_generators[device_index]

    # streams and events
    @property
    def Stream(self) -> type:  # noqa: N802 - DeepSpeed's name
        return torch.cuda.Stream

    def stream(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def current_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.current_stream(device_index)

    def default_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.default_stream(device_index)

    @property
    def Event(self) -> type:  # noqa: N802 - DeepSpeed's name
        return torch.cuda.Event

    # memory
    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return int(torch.cuda.memory_allocated(device_index))

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return int(torch.cuda.max_memory_allocated(device_index))

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        # torch deprecated reset_max_memory_allocated in favour of the all-peaks reset
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        return dict(torch.cuda.memory_stats(device_index))

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index: int | None = None) -> int:
        return int(torch.cuda.memory_reserved(device_index))

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return int(torch.cuda.max_memory_reserved(device_index))

    def total_memory(self, device_index: int | None = None) -> int:
        return int(torch.cuda.get_device_properties(self._index(device_index)).total_memory)

    def available_memory(self, device_index: int | None = None) -> int:
        free, _total = torch.cuda.mem_get_info(self._index(device_index))
        return int(free)

    # dtypes and capabilities
    def is_bf16_supported(self) -> bool:
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())

    def is_fp16_supported(self) -> bool:
        if not torch.cuda.is_available():
            return False
        major, _minor = torch.cuda.get_device_capability()
        # half arithmetic is native from Pascal (sm_60); ROCm GPUs all have it
        return major >= 6 or torch.version.hip is not None

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def is_triton_supported(self) -> bool:
        if not torch.cuda.is_available():
            return False
        major, _minor = torch.cuda.get_device_capability()
        return major >= 8

    # profiling ranges
    def range_push(self, msg: str) -> None:
        torch.cuda.nvtx.range_push(msg)

    def range_pop(self) -> None:
        torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback: Callable[[], Any]) -> Any:
        return torch.cuda._lazy_call(callback)

    # graphs
    def create_graph(self) -> Any:
        return torch.cuda.CUDAGraph()

    def capture_to_graph(self, graph: Any, pool: Any = None, stream: Any = None) -> Any:
        return torch.cuda.graph(graph, pool=pool, stream=stream)

    def replay_graph(self, graph: Any) -> None:
        graph.replay()

    # pinning
    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory()

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return bool(tensor.is_pinned())

    # environment
    def export_envs(self) -> list[str]:
        return ["NCCL"]
