"""Memory pruning: which points of the space fit on a device, before anything is launched.

Per rank, a point needs its model states plus its activations. Model states: with mixed precision
(``fp16``/``bf16`` enabled) ZeRO-2 and ZeRO-3 use DeepSpeed's estimators
(:mod:`shardspeed.runtime.zero.estimators`); ZeRO-0/1, and every stage in fp32, count bytes per
parameter (parameters, gradients, Adam's two moments plus a master copy in mixed precision), each
divided by the data-parallel ranks from the stage that shards it (optimizer from 1, gradients from
2, parameters from 3), and the optimizer states move off the device with ``offload_optimizer``.
Activations: the bytes per sample one profiled micro-step saved for backward
(``shardspeed.runtime.autotuning_probe``), times the micro-batch size.

The parallel layout: AutoTP splits (nearly) every weight, so a point with tensor-parallel size
``tp`` holds ``1/tp`` of the parameters, which ZeRO then shards over the ``world / tp`` data x
sequence-parallel ranks (the sequence-parallel ranks are ZeRO ranks too). Activations are divided
by ``sp`` (each rank holds ``1/sp`` of every sequence) and, inside the split attention and MLP,
by ``tp``: Megatron-style tensor parallelism splits about 24 of the 34 ``s*b*h`` activation
bytes a transformer layer keeps and replicates the rest (Korthikanti et al., 2022), so
activations scale by ``REPLICATED_ACTIVATIONS + (1 - REPLICATED_ACTIVATIONS) / tp``.

Pipeline stages (``pp``): each stage holds ``1/pp`` of the layers, so the model states are
divided by ``pp`` (the largest layer is whole on its stage) and ZeRO shards them over the
``world / (tp * pp)`` data-parallel ranks of the stage. Activations under the 1F1B schedule: a
stage keeps its ``1/pp`` of the layers' activations for each micro-batch in flight, and the first
stage has the most in flight: ``min(pp, gradient_accumulation_steps)`` (its warm-up forwards
before the first backward). So activations scale by ``min(pp, gas) / pp``: with at least ``pp``
micro-batches per step a stage keeps what the whole model keeps for one micro-batch. The figures
are those of the first stage, the one that needs the most.

Activation checkpointing divides the activation bytes by ``CHECKPOINTING_DIVISOR`` (2: the
layer inputs kept plus one layer recomputed at a time save far more in deep models, but little
in shallow ones where the logits dominate; 2 keeps the pruning on the safe side) unless the model
info gives the measured figure, ``activation_bytes_per_sample_checkpointed``.

The limit is ``autotuning.memory_limit_gb`` when set (e.g. to try a smaller device, or in
tests), else the accelerator's memory, else (CPU ranks) the machine's memory over the local ranks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from shardspeed.autotuning.space import Point

__all__ = [
    "CHECKPOINTING_DIVISOR",
    "REPLICATED_ACTIVATIONS",
    "Fit",
    "ModelInfo",
    "default_memory_limit",
    "fit_points",
    "memory_needed",
    "whole_model_info",
]

GB = 2**30
#: activation bytes divided by this with activation checkpointing on (no measured figure)
CHECKPOINTING_DIVISOR = 2.0
#: the share of a transformer layer's activations tensor parallelism does not split (10 of 34)
REPLICATED_ACTIVATIONS = 10.0 / 34.0


@dataclass(frozen=True)
class ModelInfo:
    """What the profiling run measured (or the user gave in ``autotuning.model_info``)."""

    num_params: int
    largest_layer_params: int = 0
    activation_bytes_per_sample: float = 0.0
    hidden_size: int | None = None
    activation_bytes_per_sample_checkpointed: float | None = None

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
            activation_bytes_per_sample_checkpointed=(
                float(info["activation_bytes_per_sample_checkpointed"])
                if info.get("activation_bytes_per_sample_checkpointed") is not None
                else None
            ),
        )

    def activation_bytes(self, point: Point) -> float:
        """Activation bytes one rank keeps for ``point``'s micro-batch and layout."""
        per_sample = self.activation_bytes_per_sample
        if point.ckpt:
            measured = self.activation_bytes_per_sample_checkpointed
            per_sample = measured if measured is not None else per_sample / CHECKPOINTING_DIVISOR
        split = REPLICATED_ACTIVATIONS + (1.0 - REPLICATED_ACTIVATIONS) / point.tp_size
        # 1F1B: the first stage holds min(pp, gas) micro-batches of its 1/pp of the layers
        in_flight = min(point.pp_size, point.grad_accum) / point.pp_size
        return per_sample * point.micro_batch * split / point.sp_size * in_flight


@dataclass(frozen=True)
class Fit:
    """A point, the bytes per rank it is estimated to need, and whether that fits."""

    point: Point
    needed: int
    fits: bool


def _model_states(point: Point, info: ModelInfo, world: int, mixed: bool) -> float:
    # this rank's share: AutoTP splits the weights, a pipeline stage holds 1/pp of the layers
    total = -(-info.num_params // (point.tp_size * point.pp_size))
    largest = -(-info.largest_layer_params // point.tp_size)
    offload = point.offload != "none"
    if mixed and point.stage == 2:
        from shardspeed.runtime.zero.estimators import estimate_zero2_model_states_mem_needs

        return estimate_zero2_model_states_mem_needs(total, world, 1, cpu_offload=offload)[1]
    if mixed and point.stage == 3:
        from shardspeed.runtime.zero.estimators import estimate_zero3_model_states_mem_needs

        return estimate_zero3_model_states_mem_needs(
            total,
            largest,
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
        params = params / world + 4 * largest  # the gathered largest layer
    return params + grads + (0 if offload else optim)


def memory_needed(point: Point, info: ModelInfo, world: int, mixed: bool) -> int:
    """Estimated bytes one rank needs for ``point``; ``world``: the ranks the layout splits
    (ZeRO shards over ``world / (tp * pp)`` of them)."""
    states = _model_states(point, info, max(world // (point.tp_size * point.pp_size), 1), mixed)
    return int(states + info.activation_bytes(point))


def whole_model_info(measured: dict[str, Any], probe: Point) -> dict[str, Any]:
    """The whole model's figures from a profile run at ``probe``'s layout and checkpointing
    (one rank of a split model counts its share): the inverse of :meth:`ModelInfo.
    activation_bytes` and of the split in :func:`memory_needed`. A pipelined probe measured
    the first stage (global rank 0): its parameters and one micro-batch's activations are taken
    as ``1/pp`` of the model's (balanced stages)."""
    info = dict(measured)
    tp, sp, pp = probe.tp_size, probe.sp_size, probe.pp_size
    for key in ("num_params", "trainable_num_params"):
        if key in info:
            info[key] = int(info[key]) * tp * pp
    if "largest_layer_params" in info:
        info["largest_layer_params"] = int(info["largest_layer_params"]) * tp
    per_sample = float(info.get("activation_bytes_per_sample", 0.0))
    # the probe counts one micro-batch's forward, not the micro-batches in flight
    per_sample *= sp * pp / (REPLICATED_ACTIVATIONS + (1.0 - REPLICATED_ACTIVATIONS) / tp)
    if probe.ckpt:
        info["activation_bytes_per_sample_checkpointed"] = per_sample
        per_sample *= CHECKPOINTING_DIVISOR
    info["activation_bytes_per_sample"] = per_sample
    info["profiled_layout"] = {"tp": tp, "sp": sp, "activation_checkpointing": bool(probe.ckpt)}
    if probe.pp is not None:
        info["profiled_layout"]["pp"] = pp
    return info


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
