"""Memory pruning: which points of the space fit on a device, before anything is launched.

Per rank, a point needs its model states plus its activations. Model states: with mixed precision
(``fp16``/``bf16`` enabled) ZeRO-2 and ZeRO-3 use DeepSpeed's estimators
(:mod:`shardspeed.runtime.zero.estimators`); ZeRO-0/1, and every stage in fp32, count bytes per
parameter (parameters, gradients, Adam's two moments plus a master copy in mixed precision), each
divided by the data-parallel ranks from the stage that shards it (optimizer from 1, gradients from
2, parameters from 3), and the optimizer states move off the device with ``offload_optimizer``.
Activations: the bytes per sample one profiled micro-step saved for backward
(``shardspeed.runtime.autotuning_probe``), times the micro-batch size.

The limit is ``autotuning.memory_limit_gb`` when set (e.g. to try a smaller device, or in
tests), else the accelerator's memory, else (CPU ranks) the machine's memory over the local ranks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from shardspeed.autotuning.space import Point

__all__ = ["Fit", "ModelInfo", "default_memory_limit", "fit_points", "memory_needed"]

GB = 2**30


@dataclass(frozen=True)
class ModelInfo:
    """What the profiling run measured (or the user gave in ``autotuning.model_info``)."""

    num_params: int
    largest_layer_params: int = 0
    activation_bytes_per_sample: float = 0.0
    hidden_size: int | None = None

    @classmethod
    def from_dict(cls, info: dict[str, Any]) -> ModelInfo:
        if "num_params" not in info:
            raise ValueError(
                "autotuning.model_info needs num_params (or profile: true to measure it)"
            )
        return cls(
            num_params=int(info["num_params"]),
            largest_layer_params=int(info.get("largest_layer_params", 0)),
            activation_bytes_per_sample=float(info.get("activation_bytes_per_sample", 0.0)),
            hidden_size=info.get("hidden_size"),
        )


@dataclass(frozen=True)
class Fit:
    """A point, the bytes per rank it is estimated to need, and whether that fits."""

    point: Point
    needed: int
    fits: bool


def _model_states(point: Point, info: ModelInfo, world: int, mixed: bool) -> float:
    total = info.num_params
    offload = point.offload != "none"
    if mixed and point.stage == 2:
        from shardspeed.runtime.zero.estimators import estimate_zero2_model_states_mem_needs

        return estimate_zero2_model_states_mem_needs(total, world, 1, cpu_offload=offload)[1]
    if mixed and point.stage == 3:
        from shardspeed.runtime.zero.estimators import estimate_zero3_model_states_mem_needs

        return estimate_zero3_model_states_mem_needs(
            total,
            info.largest_layer_params,
            world,
            1,
            cpu_offload=offload,
            cpu_offload_params=False,
        )[1]
    params: float = (2 if mixed else 4) * total
    grads: float = (2 if mixed else 4) * total
    optim: float = (12 if mixed else 8) * total  # Adam moments (+ fp32 master weights when mixed)
    if point.stage >= 1:
        optim /= world
    if point.stage >= 2:
        grads /= world
    if point.stage >= 3:
        params = params / world + 4 * info.largest_layer_params  # the gathered largest layer
    return params + grads + (0 if offload else optim)


def memory_needed(point: Point, info: ModelInfo, world: int, mixed: bool) -> int:
    """Estimated bytes one rank needs for ``point``."""
    states = _model_states(point, info, world, mixed)
    return int(states + info.activation_bytes_per_sample * point.micro_batch)


def default_memory_limit(ranks_per_node: int) -> int:
    """Bytes per rank: the accelerator's memory, or the machine's over the local CPU ranks."""
    try:
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.get_device_properties(0).total_memory)
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(total // max(ranks_per_node, 1))


def fit_points(
    points: list[Point], info: ModelInfo, world: int, mixed: bool, limit: int
) -> list[Fit]:
    """Every point with its estimate and verdict against ``limit`` bytes."""
    out = []
    for point in points:
        needed = memory_needed(point, info, world, mixed)
        out.append(Fit(point, needed, needed <= limit))
    return out
