"""The FLOPs profiler: latency, FLOPs, MACs and parameters of every module in a forward pass.

Counting works by intercepting torch functionals while profiling (see :mod:`.counters` for the
formulas); module hooks attribute each counted call to the innermost module running it. The
per-module figures live in a side table keyed by module, so nothing is attached to the model.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardspeed.accelerator import get_accelerator
from shardspeed.profiling.flops_profiler import report
from shardspeed.profiling.flops_profiler.counters import patched_functionals

__all__ = ["FlopsProfiler", "get_model_profile"]


@dataclass
class ModuleStats:
    """What one module did itself during profiling (children not included)."""

    self_flops: int = 0
    self_macs: int = 0
    duration: float = 0.0
    calls: int = 0


class FlopsProfiler:
    """Measures latency, estimated FLOPs and parameters of each module in the forward pass.

    ``ds_engine`` (optional) lets :meth:`print_model_profile` add the training-step figures
    (backward and step latency, world and batch sizes); ``recompute_fwd_factor`` is the share of
    the forward recomputed in backward (1.0 with full activation checkpointing).
    """

    def __init__(
        self, model: nn.Module, ds_engine: Any = None, recompute_fwd_factor: float = 0.0
    ) -> None:
        self.model = model
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = float(recompute_fwd_factor)
        self.started = False
        self.func_patched = False
        self._stats: dict[nn.Module, ModuleStats] = {}
        self._handles: list[Any] = []
        self._stack: list[tuple[nn.Module, float]] = []
        self._patches: ExitStack | None = None
        self._unattributed = ModuleStats()

    # -- lifecycle --------------------------------------------------------------------------
    def start_profile(self, ignore_list: Iterable[type[nn.Module]] | None = None) -> None:
        """Hook every module (except instances of ``ignore_list`` types, whose work goes to their
        parent) and start intercepting the torch functionals."""
        self.reset_profile()
        ignored = tuple(ignore_list or ())
        for module in self.model.modules():
            if ignored and isinstance(module, ignored):
                continue
            self._handles.append(module.register_forward_pre_hook(self._pre_hook))
            self._handles.append(module.register_forward_hook(self._post_hook, always_call=True))
        self._patches = ExitStack()
        self._patches.enter_context(patched_functionals(self._record))
        self.func_patched = True
        self.started = True

    def stop_profile(self) -> None:
        """Stop intercepting functionals and timing modules; the figures stay readable."""
        if self._patches is not None:
            self._patches.close()
            self._patches = None
        self.func_patched = False
        self._remove_hooks()

    def reset_profile(self) -> None:
        """Zero every module's figures."""
        self._stats = {module: ModuleStats() for module in self.model.modules()}
        self._unattributed = ModuleStats()
        self._stack.clear()

    def end_profile(self) -> None:
        """Stop profiling (if running) and forget the figures."""
        self.stop_profile()
        self._stats.clear()
        self.started = False

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # -- hooks ------------------------------------------------------------------------------
    def _pre_hook(self, module: nn.Module, args: Any) -> None:
        _sync()
        self._stack.append((module, time.perf_counter()))

    def _post_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        _sync()
        # always_call hooks run on exceptions too; pop down to this module to stay consistent.
        while self._stack:
            top, started = self._stack.pop()
            if top is module:
                stats = self._stats.setdefault(module, ModuleStats())
                stats.duration += time.perf_counter() - started
                stats.calls += 1
                break

    def _record(self, flops: int, macs: int) -> None:
        if self._stack:
            stats = self._stats.setdefault(self._stack[-1][0], ModuleStats())
        else:
            stats = self._unattributed
        stats.self_flops += flops
        stats.self_macs += macs

    # -- queries ----------------------------------------------------------------------------
    def module_flops(self, module: nn.Module) -> int:
        """FLOPs of ``module`` including its children."""
        return self._aggregate(module, "self_flops")

    def module_macs(self, module: nn.Module) -> int:
        """MACs of ``module`` including its children."""
        return self._aggregate(module, "self_macs")

    def module_duration(self, module: nn.Module) -> float:
        """Seconds spent in ``module``'s forward (summed over its calls)."""
        stats = self._stats.get(module)
        if stats is None or stats.calls == 0:
            # An ignored or unhooked module: its time is inside its parent; sum the children.
            return sum(self.module_duration(child) for child in module.children())
        return stats.duration

    @staticmethod
    def module_params(module: nn.Module) -> int:
        """Parameters held by this rank under ``module`` (shared ones once)."""
        return sum(p.numel() for p in module.parameters())

    def _aggregate(self, module: nn.Module, field: str) -> int:
        seen: set[int] = set()
        total = 0
        for sub in module.modules():  # modules() yields each shared submodule once
            if id(sub) not in seen:
                seen.add(id(sub))
                stats = self._stats.get(sub)
                total += getattr(stats, field) if stats is not None else 0
        return total

    def get_total_flops(self, as_string: bool = False) -> int | str:
        """Total FLOPs of the profiled forward pass(es)."""
        flops = self.module_flops(self.model)
        return report.number_to_string(flops, "FLOPS") if as_string else flops

    def get_total_macs(self, as_string: bool = False) -> int | str:
        """Total multiply-accumulate operations of the profiled forward pass(es)."""
        macs = self.module_macs(self.model)
        return report.number_to_string(macs, "MACs") if as_string else macs

    def get_total_duration(self, as_string: bool = False) -> float | str:
        """Latency of the profiled forward pass(es), in seconds."""
        duration = self.module_duration(self.model)
        return report.duration_to_string(duration) if as_string else duration

    def get_total_params(self, as_string: bool = False) -> int | str:
        """Parameters stored on this rank."""
        params = self.module_params(self.model)
        return report.number_to_string(params, "") if as_string else params

    # -- printing ---------------------------------------------------------------------------
    def print_model_profile(
        self,
        profile_step: int = 1,
        module_depth: int = -1,
        top_modules: int = 1,
        detailed: bool = True,
        output_file: str | None = None,
    ) -> None:
        """Print the summary, the top modules and (``detailed``) the module tree with each
        module's profile, to stdout or ``output_file``."""
        if not self.started:
            return
        text = report.render_profile(
            self, profile_step, module_depth, top_modules, detailed, report.engine_summary(self)
        )
        report.emit(text, output_file)

    def print_model_aggregated_profile(self, module_depth: int = -1, top_modules: int = 1) -> None:
        """Print the top ``top_modules`` modules by latency, FLOPs and params at a depth."""
        if not self.started:
            return
        print(report.render_aggregated(self, module_depth, top_modules))


def _sync() -> None:
    accel = get_accelerator()
    if not accel.is_synchronized_device():
        accel.synchronize()


def get_model_profile(
    model: nn.Module,
    input_shape: tuple[int, ...] | None = None,
    args: list[Any] = [],  # noqa: B006 - DeepSpeed's signature; never mutated
    kwargs: dict[str, Any] = {},  # noqa: B006 - DeepSpeed's signature; never mutated
    print_profile: bool = True,
    detailed: bool = True,
    module_depth: int = -1,
    top_modules: int = 1,
    warm_up: int = 1,
    as_string: bool = True,
    output_file: str | None = None,
    ignore_modules: list[type[nn.Module]] | None = None,
    mode: str = "forward",
) -> tuple[int | str, int | str, int | str]:
    """Profile one call of ``model`` and return ``(flops, macs, params)``.

    The call is ``model(torch.ones(input_shape), *args, **kwargs)`` when ``input_shape`` is
    given, else ``model(*args, **kwargs)``; ``mode='generate'`` calls ``model.generate`` instead.
    ``warm_up`` unprofiled calls run first so the latency excludes one-off costs.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"get_model_profile(model=...) takes an nn.Module, got {type(model)}")
    if mode not in ("forward", "generate"):
        raise ValueError(f"get_model_profile(mode={mode!r}): use 'forward' or 'generate'")
    call_args = list(args)
    if input_shape is not None:
        if not isinstance(input_shape, tuple | list) or len(input_shape) < 1:
            raise ValueError(f"input_shape must be a non-empty tuple, got {input_shape!r}")
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        dtype = next((p.dtype for p in model.parameters()), torch.float32)
        call_args = [torch.ones(tuple(input_shape), device=device, dtype=dtype), *call_args]
    run: Callable[..., Any] = model if mode == "forward" else getattr(model, "generate")  # noqa: B009 - mypy sees nn.Module attributes as Tensors
    prof = FlopsProfiler(model)
    with torch.no_grad():
        for _ in range(max(0, warm_up)):
            run(*call_args, **kwargs)
        prof.start_profile(ignore_list=ignore_modules)
        try:
            run(*call_args, **kwargs)
        finally:
            prof.stop_profile()
    flops, macs, params = prof.get_total_flops(), prof.get_total_macs(), prof.get_total_params()
    if print_profile:
        prof.print_model_profile(
            profile_step=warm_up,
            module_depth=module_depth,
            top_modules=top_modules,
            detailed=detailed,
            output_file=output_file,
        )
    prof.end_profile()
    if as_string:
        return (
            report.number_to_string(int(flops), "FLOPS"),
            report.macs_to_string(int(macs)),
            report.number_to_string(int(params), ""),
        )
    return flops, macs, params
