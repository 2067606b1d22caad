"""``PipelineModule``: a model written as a list of layers, split into pipeline stages.

Each rank builds only the layers of its own stage (:class:`~.layer_spec.LayerSpec`\\ s of other
stages are never built; ``partition_method="parameters"`` counts their parameters on the meta
device). The implicit forward is ``for layer in layers: x = layer(x)`` over this stage's
layers. Layers are registered under their global index (``"3.weight"``), tied modules under
``tied_modules.<key>``, as DeepSpeed names them, so a layer's state is the same on every
partitioning and checkpoints move between pipeline degrees.
"""

from __future__ import annotations

import glob
import os
import random
import re
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
from torch import nn

from shardspeed import comm
from shardspeed.runtime.activation_checkpointing import checkpointing
from shardspeed.runtime.pipe.layer_spec import LayerSpec, TiedLayerSpec
from shardspeed.runtime.pipe.partition import partition_balanced, partition_uniform
from shardspeed.runtime.pipe.tied import TiedWeights
from shardspeed.runtime.pipe.topology import (
    PipeDataParallelTopology,
    PipelineParallelGrid,
    ProcessTopology,
)
from shardspeed.utils.logging import log_dist

__all__ = ["LayerSpec", "PipelineError", "PipelineModule", "TiedLayerSpec"]


class PipelineError(Exception):
    """Errors related to the use of pipeline parallelism (DeepSpeed's class)."""


class InvalidIntervalError(ValueError, AssertionError):
    """A negative checkpoint interval (DeepSpeed asserts ``interval >= 0``)."""


def _count_params(layer: Any) -> int:
    if isinstance(layer, LayerSpec):
        with torch.device("meta"):  # counted without allocating: another stage may own it
            layer = layer.build()
    if isinstance(layer, nn.Module):
        return sum(p.numel() for p in layer.parameters() if p.requires_grad)
    return 0


def _type_name(layer: Any) -> str:
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    return type(layer).__name__


class PipelineModule(nn.Module):
    """A sequence of layers partitioned over ``num_stages`` pipeline stages (or the ``pipe``
    axis of ``topology``); ``loss_fn(outputs, labels)`` gives the loss on the last stage."""

    def __init__(
        self,
        layers: Iterable[Any],
        num_stages: int | None = None,
        topology: ProcessTopology | None = None,
        loss_fn: Callable[..., Any] | None = None,
        seed_layers: bool = False,
        seed_fn: Callable[[int], Any] | None = None,
        base_seed: int = 1234,
        partition_method: str = "parameters",
        activation_checkpoint_interval: int = 0,
        activation_checkpoint_func: Callable[..., Any] = checkpointing.checkpoint,
        checkpointable_layers: list[str] | None = None,
        dynamic_shape: bool = False,
    ) -> None:
        super().__init__()
        if num_stages is None and topology is None:
            raise ValueError("PipelineModule needs num_stages= or topology= (a ProcessTopology)")
        if not comm.is_initialized():
            comm.init_distributed()
        self.world_size = comm.get_world_size()
        self.global_rank = comm.get_rank()
        if topology is None:
            assert num_stages is not None
            if num_stages < 1 or self.world_size % num_stages != 0:
                raise ValueError(
                    f"Pipeline stage count not divisible by total GPU count: num_stages="
                    f"{num_stages} does not divide the world size {self.world_size}; pick a "
                    "num_stages that divides the number of processes (the rest is data parallel)"
                )
            topology = PipeDataParallelTopology(num_stages, self.world_size // num_stages)
        elif num_stages is not None and num_stages != topology.get_dim("pipe"):
            raise ValueError(
                f"num_stages={num_stages} but topology has pipe={topology.get_dim('pipe')}; "
                "give one of them"
            )
        self._topo = topology
        self.num_stages = max(topology.get_dim("pipe"), 1)
        self._grid = PipelineParallelGrid(topology)
        self.stage_id = self._grid.get_stage_id()
        self.loss_fn = loss_fn
        self.seed_layers = seed_layers
        self.seed_fn = seed_fn
        self.base_seed = base_seed
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func
        #: whether each block of ``activation_checkpoint_interval`` layers is checkpointed,
        #: for the interval in ``is_checkpointable_results_interval`` (DeepSpeed's cache)
        self.is_checkpointable_results: list[bool] = []
        self.is_checkpointable_results_interval: int | None = None
        self.checkpointable_layers = checkpointable_layers
        self.dynamic_shape = dynamic_shape
        self.micro_offset = 0
        if isinstance(layers, nn.Sequential):
            layers = list(layers.children())
        self._layer_specs = list(layers)
        self._num_layers = len(self._layer_specs)
        if self.num_stages > self._num_layers:
            raise ValueError(
                f"PipelineModule has {self._num_layers} layers but {self.num_stages} stages; "
                "every stage needs at least one layer: use fewer stages or split the model "
                "into more layers"
            )
        self.parts = self._partition(partition_method)
        self._local_start = self.parts[self.stage_id]
        self._local_stop = self.parts[self.stage_id + 1]
        self.forward_funcs: list[Callable[..., Any]] = []
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self._build()
        self.tied = TiedWeights(self)
        self.tied.synchronize()
        # DeepSpeed's name for the tie groups: key -> ranks, group, weight_attr, module
        self.tied_comms = self.tied.as_comms()

    # -- building ----------------------------------------------------------------------------
    def _partition(self, method: str) -> list[int]:
        method_lower = method.lower()
        stages = self.num_stages
        if method_lower == "uniform":
            parts = partition_uniform(self._num_layers, stages)
        elif method_lower == "parameters":
            parts = partition_balanced([_count_params(s) for s in self._layer_specs], stages)
        elif method_lower.startswith("type:"):
            pattern = re.compile(method.split(":", 1)[1], re.IGNORECASE)
            weights = [1 if pattern.search(_type_name(s)) else 0 for s in self._layer_specs]
            if not any(weights):
                raise ValueError(
                    f"partition_method={method!r} matches no layer class; classes here: "
                    f"{sorted({_type_name(s) for s in self._layer_specs})}"
                )
            parts = partition_balanced(weights, stages)
        elif method_lower == "profile":
            raise NotImplementedError(
                "partition_method='profile' is not implemented in shardspeed; use 'parameters' "
                "(balanced parameter counts), 'uniform' or 'type:<regex>'"
            )
        else:
            raise ValueError(
                f"partition_method={method!r} is not known; use 'parameters', 'uniform' or "
                "'type:<regex>'"
            )
        if self.global_rank == 0:
            sizes = [parts[s + 1] - parts[s] for s in range(stages)]
            log_dist(f"pipeline partition ({method}): boundaries {parts}, layers {sizes}", [0])
        return parts

    def _build(self) -> None:
        for index in range(self._local_start, self._local_stop):
            spec = self._layer_specs[index]
            if self.seed_layers:
                self._seed(self.base_seed + index)
            if isinstance(spec, TiedLayerSpec):
                if spec.key not in self.tied_modules:
                    self.tied_modules[spec.key] = spec.build()
                    self.tied_weight_attrs[spec.key] = spec.tied_weight_attr
                module = self.tied_modules[spec.key]
                if spec.forward_fn is None:
                    self.forward_funcs.append(module)
                else:
                    self.forward_funcs.append(partial(spec.forward_fn, module))
            elif isinstance(spec, LayerSpec):
                module = spec.build()
                self.add_module(str(index), module)
                self.forward_funcs.append(module)
            elif isinstance(spec, nn.Module):
                self.add_module(str(index), spec)
                self.forward_funcs.append(spec)
            elif callable(spec):
                self.forward_funcs.append(spec)
            else:
                raise TypeError(
                    f"layer {index} of PipelineModule is {spec!r}: a layer must be a LayerSpec, "
                    "an nn.Module or a callable"
                )

    def _seed(self, seed: int) -> None:
        if self.seed_fn is not None:
            self.seed_fn(seed)
        else:
            random.seed(seed)
            torch.manual_seed(seed)

    # -- forward ---------------------------------------------------------------------------
    def _exec_range(self, start: int, end: int) -> Callable[..., Any]:
        """The layers ``start .. end - 1`` of this stage as one function."""

        def run(*inputs: Any) -> Any:
            x = inputs[0] if len(inputs) == 1 else inputs
            for offset, layer in enumerate(self.forward_funcs[start:end]):
                if self.seed_layers:
                    self._seed(
                        self.base_seed * self.micro_offset + self._local_start + start + offset
                    )
                x = layer(x)
            return x

        return run

    def _is_checkpointable(self, funcs: list[Callable[..., Any]]) -> bool:
        """Whether a block of layers is checkpointed: DeepSpeed's rule (GPT pipes under the
        reentrant function only their transformer layers, else ``checkpointable_layers`` by
        class name, else any block with parameters)."""
        names = [type(f).__name__ for f in funcs]
        if self.activation_checkpoint_func is not checkpointing.non_reentrant_checkpoint and (
            type(self).__name__ in ("GPTModelPipe", "GPT2ModelPipe")
        ):
            extra = self.checkpointable_layers or []
            return all("ParallelTransformerLayerPipe" in n or n in extra for n in names)
        if self.checkpointable_layers is not None:
            return all(n in self.checkpointable_layers for n in names)
        return any(isinstance(f, nn.Module) and any(True for _ in f.parameters()) for f in funcs)

    def _precompute_checkpointable_values(self) -> None:
        """Decide once per interval which blocks of layers are checkpointed
        (``is_checkpointable_results``); nothing to do when checkpointing is off or the
        results are for the current interval already."""
        interval = self.activation_checkpoint_interval
        if interval <= 0 or self.is_checkpointable_results_interval == interval:
            return
        count = len(self.forward_funcs)
        self.is_checkpointable_results = [
            self._is_checkpointable(self.forward_funcs[start : min(start + interval, count)])
            for start in range(0, count, interval)
        ]
        self.is_checkpointable_results_interval = interval

    def set_checkpoint_interval(self, interval: int) -> None:
        """Checkpoint activations every ``interval`` layers from now on (0 turns it off)."""
        if interval < 0:
            raise InvalidIntervalError(
                f"set_checkpoint_interval({interval}): the interval must be >= 0 (0 disables "
                "activation checkpointing)"
            )
        self.activation_checkpoint_interval = interval
        self._precompute_checkpointable_values()

    def forward(self, forward_input: Any) -> Any:
        """Run this stage's layers on ``forward_input`` (activation-checkpointed every
        ``activation_checkpoint_interval`` layers while training)."""
        self.micro_offset += 1
        count = len(self.forward_funcs)
        interval = self.activation_checkpoint_interval
        if interval == 0 or not torch.is_grad_enabled():
            return self._exec_range(0, count)(forward_input)
        self._precompute_checkpointable_values()  # the interval may have been set directly
        x = forward_input
        starts = range(0, count, interval)
        for start, checkpointed in zip(starts, self.is_checkpointable_results, strict=True):
            run = self._exec_range(start, min(start + interval, count))
            args = x if isinstance(x, tuple) else (x,)
            x = self.activation_checkpoint_func(run, *args) if checkpointed else run(*args)
        return x

    # -- DeepSpeed's queries ---------------------------------------------------------------
    def topology(self) -> ProcessTopology:
        return self._topo

    def mpu(self) -> PipelineParallelGrid:
        return self._grid

    def num_pipeline_stages(self) -> int:
        return self.num_stages

    def partitions(self) -> list[int]:
        """The layer boundaries of the stages: stage ``s`` holds ``parts[s] .. parts[s+1]-1``."""
        return self.parts

    def stage_owner(self, layer_idx: int) -> int:
        """The stage holding global layer ``layer_idx``."""
        if not 0 <= layer_idx < self._num_layers:
            raise ValueError(f"layer {layer_idx} is outside 0 .. {self._num_layers - 1}")
        return next(s for s in range(self.num_stages) if self.parts[s + 1] > layer_idx)

    def get_additional_losses(self) -> dict[str, torch.Tensor] | None:
        """Losses besides the main one (``{"name": value}``); none by default."""
        return None

    def allreduce_tied_weight_gradients(self) -> None:
        """Sum the gradients (``.grad``) of tied weights over the stages that hold them."""
        self.tied.allreduce_grads()

    def get_tied_weights_and_groups(self) -> list[tuple[torch.Tensor, Any]]:
        return self.tied.weights_and_groups()

    def compile(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        """``torch.compile`` each layer of this stage."""
        for index, layer in enumerate(self.forward_funcs):
            if isinstance(layer, nn.Module):
                layer.compile(*args, **kwargs)
            else:
                self.forward_funcs[index] = torch.compile(layer, *args, **kwargs)

    # -- checkpoint file names -------------------------------------------------------------
    def ckpt_prefix(self, checkpoints_path: str, tag: str) -> str:
        """The prefix of this rank's checkpoint files: ``<path>/<tag>/module-pipe_XX...``."""
        name = "module"
        coord = self._topo.get_coord(self.global_rank)
        for axis in self._topo.get_axis_names():
            if axis != "data":
                name += f"-{axis}_{getattr(coord, axis):02d}"
        return os.path.join(checkpoints_path, str(tag), name)

    def ckpt_layer_path(self, ckpt_dir: str, local_layer_idx: int) -> str:
        """``layer_XX[-model_YY]-model_states.pt`` for this stage's layer ``local_layer_idx``."""
        index = local_layer_idx + self._local_start
        path = os.path.join(ckpt_dir, f"layer_{index:02d}")
        rank_repr = self._topo.get_rank_repr(rank=self.global_rank)
        if rank_repr:
            path += f"-{rank_repr}"
        return path + "-model_states.pt"

    def ckpt_layer_path_list(self, ckpt_dir: str, local_layer_idx: int) -> list[str]:
        """Every saved file of layer ``local_layer_idx`` (one per tensor slice), sorted."""
        index = local_layer_idx + self._local_start
        return sorted(glob.glob(os.path.join(ckpt_dir, f"layer_{index:02d}-*model_states.pt")))

    def layer_states(self) -> dict[int, dict[str, torch.Tensor]]:
        """Each of this stage's layers with state, by global index: its ``state_dict()``."""
        modules = self.layer_modules(with_forward_fn=False)
        return {index: module.state_dict() for index, module in modules.items()}

    def layer_modules(self, with_forward_fn: bool = True) -> dict[int, nn.Module]:
        """This stage's layers that are modules, by global index; a tied layer with a
        ``forward_fn`` counts as its tied module unless ``with_forward_fn`` is False (DeepSpeed
        saves only the layers that are modules themselves)."""
        found = {}
        for local, layer in enumerate(self.forward_funcs):
            if isinstance(layer, partial) and with_forward_fn:
                layer = layer.args[0]
            if isinstance(layer, nn.Module):
                found[local + self._local_start] = layer
        return found
