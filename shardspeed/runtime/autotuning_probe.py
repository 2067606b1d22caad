"""The engine side of autotuning: measure one experiment, write its metric file, and exit.

The autotuner launches the user's script with an experiment config whose ``autotuning`` section
is enabled and names a ``metric_path``. The engine then times optimizer steps
``start_profile_step`` to ``end_profile_step`` and, as DeepSpeed does, writes
``{"throughput", "latency", "flops"}`` to that file on global rank 0 and ends the process: an
experiment needs no more steps. ``latency`` is the median step time over the window (seconds),
``throughput`` the samples per second at that latency, ``flops`` about ``6 * params * tokens``
per second. With ``autotuning.model_info.profile`` the engine instead counts
the model's parameters and the activation bytes one training micro-step saves for backward (device
independent: the tensors autograd keeps, parameters excluded), writes them to ``model_info_path``
and ends the process; the autotuner prunes its search space with those figures.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn

from shardspeed.accelerator import get_accelerator

__all__ = ["AutotuningProbe", "count_model_params"]


def count_model_params(module: nn.Module) -> dict[str, int]:
    """Total and trainable parameters (shared tensors once) and the largest module's own count."""
    unique = {p.data_ptr(): p for p in module.parameters()}
    largest = max(
        (sum(p.numel() for p in m.parameters(recurse=False)) for m in module.modules()), default=0
    )
    return {
        "num_params": sum(p.numel() for p in unique.values()),
        "trainable_num_params": sum(p.numel() for p in unique.values() if p.requires_grad),
        "largest_layer_params": largest,
    }


class _SavedTensorCounter:
    """Counts the bytes autograd saves for backward during one forward (activations)."""

    def __init__(self, module: nn.Module) -> None:
        self.param_storages = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self.seen: set[int] = set()
        self.bytes = 0
        self._ctx: Any = None

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        ptr = tensor.untyped_storage().data_ptr()
        if ptr not in self.param_storages and ptr not in self.seen:
            self.seen.add(ptr)
            self.bytes += tensor.untyped_storage().nbytes()
        return tensor

    def start(self) -> None:
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()

    def stop(self) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(None, None, None)
            self._ctx = None


class AutotuningProbe:
    """Times the profiled steps of one experiment (or profiles the model) for the autotuner."""

    def __init__(
        self,
        module: nn.Module,
        train_batch_size: int,
        micro_batch_size: int,
        start_step: int,
        end_step: int,
        metric_path: str | None,
        model_info_path: str | None,
        is_writer: bool,
    ) -> None:
        self.train_batch_size = train_batch_size
        self.micro_batch_size = micro_batch_size
        self.start_step, self.end_step = start_step, max(end_step, start_step + 1)
        self.metric_path, self.model_info_path = metric_path, model_info_path
        self.is_writer = is_writer
        self.params = count_model_params(module)
        self.hidden_size = _hidden_size(module)
        self.tokens_per_sample = 1
        self._t0: float | None = None
        self._step_times: list[float] = []
        self._counter: _SavedTensorCounter | None = None
        self._handles: list[Any] = []
        counter = _SavedTensorCounter(module) if model_info_path else None
        self._counter = counter

        def pre(_mod: nn.Module, inputs: tuple[Any, ...]) -> None:
            first = inputs[0] if inputs else None
            if isinstance(first, torch.Tensor) and first.dim() >= 2:
                self.tokens_per_sample = int(first.shape[1])
            if counter is not None and _mod.training and counter.bytes == 0:
                counter.start()

        def post(_mod: nn.Module, _inputs: Any, _output: Any) -> None:
            if counter is not None:
                counter.stop()

        self._handles = [module.register_forward_pre_hook(pre)]
        if counter is not None:
            self._handles.append(module.register_forward_hook(post))

    @classmethod
    def from_config(
        cls,
        config: Any,
        module: nn.Module,
        global_rank: int,
        train_batch_size: int,
        micro_batch_size: int,
    ) -> AutotuningProbe | None:
        """The probe an engine needs, or None when this run is not an autotuning experiment."""
        at = config.autotuning
        info = at.model_info or {}
        profile = bool(info.get("profile")) and at.model_info_path
        if not at.enabled or not (at.metric_path or profile):
            return None
        return cls(
            module,
            train_batch_size,
            micro_batch_size,
            at.start_profile_step,
            at.end_profile_step,
            at.metric_path,
            at.model_info_path if profile else None,
            is_writer=global_rank == 0,
        )

    def after_step(self, global_steps: int) -> None:
        """Called after each optimizer step with the new step count; may end the process."""
        if self.model_info_path:
            self._write_model_info()
            self._exit()
        if global_steps >= self.start_step:
            get_accelerator().synchronize()  # the step's device work belongs to its time
        now = time.perf_counter()
        if global_steps > self.start_step and self._t0 is not None:
            self._step_times.append(now - self._t0)
        if global_steps >= self.start_step:
            self._t0 = now
        if global_steps >= self.end_step and self._step_times:
            # the median step: one step slowed by another process on a shared machine does not
            # move it (DeepSpeed takes the mean over the window)
            latency = statistics.median(self._step_times)
            throughput = self.train_batch_size / latency
            # training costs about 6 FLOPs per parameter per token (forward 2, backward 4)
            flops = 6.0 * self.params["num_params"] * self.tokens_per_sample * throughput
            metric = {"throughput": throughput, "latency": latency, "flops": flops}
            self._write(self.metric_path, metric)
            self._exit()

    def _write_model_info(self) -> None:
        act = self._counter.bytes if self._counter is not None else 0
        info: dict[str, Any] = dict(self.params)
        info["activation_mem_per_gpu"] = act
        info["activation_bytes_per_sample"] = act / max(self.micro_batch_size, 1)
        info["profiled_micro_batch_size"] = self.micro_batch_size
        info["tokens_per_sample"] = self.tokens_per_sample
        if self.hidden_size:
            info["hidden_size"] = self.hidden_size
        self._write(self.model_info_path, info)

    def _write(self, path: str | None, payload: dict[str, Any]) -> None:
        if not self.is_writer or not path:
            return
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp"
        with open(tmp, "w") as fd:
            json.dump(payload, fd)
        os.replace(tmp, path)  # the autotuner never reads a half-written file

    def _exit(self) -> None:
        for handle in self._handles:
            handle.remove()
        sys.stdout.flush()
        sys.stderr.flush()
        # DeepSpeed ends an experiment the same way: the script's remaining steps are not needed
        sys.exit(0)


def _hidden_size(module: nn.Module) -> int | None:
    config = getattr(module, "config", None)
    for name in ("hidden_size", "n_embd", "d_model"):
        value = getattr(config, name, None) if config is not None else None
        if isinstance(value, int):
            return value
    return None
