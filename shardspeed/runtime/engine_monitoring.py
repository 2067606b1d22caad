"""Everything the engine reports about itself: wall-clock breakdown, throughput, monitor events,
the FLOPs profile at ``flops_profiler.profile_step`` and the progress display.

The engine calls four hooks: ``forward(inputs)`` and ``backward(loss)`` (context managers around
its verbs), ``phase(name)`` around the inner pieces, and ``after_step(boundary)`` at the end of
``step()``. At each optimizer step rank 0 writes, with x = ``global_samples``:

- ``Train/Samples/train_loss``: the mean of the losses passed to ``backward`` over the
  accumulation window, averaged over the data-parallel group (one scalar all-reduce per step,
  only when a monitor is enabled);
- ``Train/Samples/lr`` (first param group) and, with fp16, ``Train/Samples/loss_scale``;
- with ``wall_clock_breakdown`` (or the FLOPs profiler), ``Train/Samples/elapsed_time_ms_<phase>``
  for forward, backward, backward_inner, backward_allreduce and step: the milliseconds spent in
  that phase during this step's accumulation window on rank 0.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from shardspeed import comm
from shardspeed.monitor.monitor import MonitorMaster
from shardspeed.profiling.flops_profiler.profiler import FlopsProfiler
from shardspeed.runtime.engine_progress import ProgressDisplay, progress_requested
from shardspeed.runtime.train_state import TrainState
from shardspeed.runtime.zero.comm_group import CommGroup
from shardspeed.utils.logging import log_dist
from shardspeed.utils.timer import (
    BACKWARD_GLOBAL_TIMER,
    BACKWARD_INNER_GLOBAL_TIMER,
    BACKWARD_REDUCE_GLOBAL_TIMER,
    FORWARD_GLOBAL_TIMER,
    STEP_GLOBAL_TIMER,
    SynchronizedWallClockTimer,
    ThroughputTimer,
)

__all__ = ["PHASE_EVENT_NAMES", "EngineObservability"]

PHASE_EVENT_NAMES = {
    FORWARD_GLOBAL_TIMER: "Train/Samples/elapsed_time_ms_forward",
    BACKWARD_GLOBAL_TIMER: "Train/Samples/elapsed_time_ms_backward",
    BACKWARD_INNER_GLOBAL_TIMER: "Train/Samples/elapsed_time_ms_backward_inner",
    BACKWARD_REDUCE_GLOBAL_TIMER: "Train/Samples/elapsed_time_ms_backward_allreduce",
    STEP_GLOBAL_TIMER: "Train/Samples/elapsed_time_ms_step",
}


class EngineObservability:
    """Timers, throughput, monitor events, FLOPs profile and progress for one engine."""

    def __init__(
        self,
        config: Any,
        module: torch.nn.Module,
        state: TrainState,
        data_parallel: CommGroup,
        global_rank: int,
        needs_loss_scaling: bool,
    ) -> None:
        self.config = config
        self.state = state
        self.data_parallel = data_parallel
        self.needs_loss_scaling = needs_loss_scaling
        self.is_rank0 = global_rank == 0
        self.breakdown = bool(config.wall_clock_breakdown_enabled)
        self.memory_breakdown = bool(config.memory_breakdown)
        self.timers = SynchronizedWallClockTimer(enabled=self.breakdown)
        self.throughput = ThroughputTimer(
            config.timers.throughput,
            batch_size=config.train_batch_size,
            steps_per_output=config.steps_per_print,
            monitor_memory=self.memory_breakdown,
            logging_fn=lambda line: log_dist(line, ranks=[0]),
        )
        self.throughput.world_size = comm.get_world_size() if comm.is_initialized() else 1
        self.monitor = MonitorMaster(config.monitor_config)
        profiler_cfg = config.flops_profiler
        self.profiler_config = profiler_cfg
        self.flops_profiler: FlopsProfiler | None = None
        if profiler_cfg.enabled:
            self.flops_profiler = FlopsProfiler(
                module, recompute_fwd_factor=profiler_cfg.recompute_fwd_factor
            )
        self._profiling = False
        self._profile_window = False
        self._profile_timings: dict[str, float] = {}
        self.progress = ProgressDisplay(self.is_rank0 and progress_requested())
        # per-step work only when something reads it: the loss float (a host sync on a device)
        # for monitors and the progress display; the throughput timer (which synchronizes the
        # device at every forward) for steps_per_print logs, the progress display and profiles
        self._wants_loss = self.monitor.enabled or self.progress.enabled
        if not (config.steps_per_print or self.progress.enabled or self.flops_profiler):
            self.throughput.enabled = False
        self._loss_sum: torch.Tensor | None = None
        self._loss_count = 0
        self._window_micro = 0
        self._inputs_seen = False
        self._print_sums: dict[str, float] = {}
        self._print_steps = 0
        self.last_events: list[tuple[str, float, int]] = []
        self.last_breakdown: dict[str, float] = {}
        self.last_loss: float | None = None

    def attach_engine(self, engine: Any) -> None:
        """Let the FLOPs profile report the engine's step figures (DeepSpeed's ``ds_engine``)."""
        if self.flops_profiler is not None:
            self.flops_profiler.ds_engine = engine

    # -- hooks the engine calls -------------------------------------------------------------
    @contextmanager
    def forward(self, inputs: tuple[Any, ...]) -> Iterator[None]:
        """Around the module's forward: throughput start, forward timer, FLOPs profiling."""
        if not self._inputs_seen:
            self._inputs_seen = True
            if inputs:
                self.throughput.tokens_per_sample = _sequence_length(inputs[0])
        self.throughput.start()
        start_profile = (
            self.flops_profiler is not None
            and self.state.global_steps == self.profiler_config.profile_step
            and self._window_micro == 0
            and not self._profile_window
        )
        if start_profile:
            assert self.flops_profiler is not None
            self.flops_profiler.start_profile(ignore_list=None)
            self._profiling = self._profile_window = True
        self.timers(FORWARD_GLOBAL_TIMER).start()
        try:
            yield
        finally:
            self.timers(FORWARD_GLOBAL_TIMER).stop()
            if self._profiling:
                assert self.flops_profiler is not None
                self.flops_profiler.stop_profile()
                self._profiling = False

    @contextmanager
    def backward(self, loss: torch.Tensor) -> Iterator[None]:
        """Around the whole backward verb: remember the loss, time the phase."""
        if self._wants_loss:
            value = loss.detach().float().reshape(())
            self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
            self._loss_count += 1
        self.timers(BACKWARD_GLOBAL_TIMER).start()
        try:
            yield
        finally:
            self.timers(BACKWARD_GLOBAL_TIMER).stop()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time one named phase (``bwd_inner``, ``bwd_allreduce``, ``step``)."""
        timer = self.timers(name)
        timer.start()
        try:
            yield
        finally:
            timer.stop()

    def after_step(self, boundary: bool, lrs: list[float], loss_scale: float) -> None:
        """End of ``engine.step()``; at an optimizer step, report everything (``lrs``: each
        parameter group's learning rate, ``loss_scale``: the current loss scale)."""
        self.throughput.stop(global_step=boundary)
        self._window_micro += 1
        if not boundary:
            return
        self._window_micro = 0
        loss = self._window_loss()
        phases = self._read_phases()
        if self.monitor.enabled:
            self._write_events(loss, phases, lrs, loss_scale)
        if self._profile_window:
            self._print_profile(phases)
        self._log_breakdown(phases)
        self.progress.update(
            self.state.global_steps, self.last_loss, self.throughput.avg_samples_per_sec()
        )

    # -- reporting --------------------------------------------------------------------------
    def _window_loss(self) -> float | None:
        if self._loss_sum is None:
            return None
        mean = self._loss_sum / max(1, self._loss_count)
        self._loss_sum, self._loss_count = None, 0
        dp = self.data_parallel
        if self.monitor.enabled and dp.world_size > 1:
            comm.all_reduce(mean, group=dp.group)
            mean = mean / dp.world_size
        self.last_loss = float(mean)
        return self.last_loss

    def _read_phases(self) -> dict[str, float]:
        if not self.breakdown:
            return {}
        phases = {name: self.timers(name).elapsed(reset=True) for name in PHASE_EVENT_NAMES}
        self.last_breakdown = phases
        return phases

    def _write_events(
        self, loss: float | None, phases: dict[str, float], lrs: list[float], loss_scale: float
    ) -> None:
        x = self.state.global_samples
        events: list[tuple[str, float, int]] = []
        if loss is not None:
            events.append(("Train/Samples/train_loss", loss, x))
        if lrs:
            events.append(("Train/Samples/lr", float(lrs[0]), x))
        if self.needs_loss_scaling:
            events.append(("Train/Samples/loss_scale", float(loss_scale), x))
        events += [(PHASE_EVENT_NAMES[name], ms, x) for name, ms in phases.items()]
        self.last_events = events
        self.monitor.write_events(events)

    def _log_breakdown(self, phases: dict[str, float]) -> None:
        if not phases:
            return
        for name, ms in phases.items():
            self._print_sums[name] = self._print_sums.get(name, 0.0) + ms
        self._print_steps += 1
        every = self.config.steps_per_print
        if not every or self.state.global_steps % every != 0:
            return
        line = "time (ms)" + "".join(
            f" | {name}: {total / self._print_steps:.2f}"
            for name, total in self._print_sums.items()
        )
        if self.memory_breakdown:
            line += self.timers.memory_usage()
        log_dist(line, ranks=[0])
        self._print_sums, self._print_steps = {}, 0

    def profile_timings(self) -> dict[str, Any]:
        """Backward and step latency (s per micro-batch / per step) of the profiled step."""
        return dict(self._profile_timings)

    def _print_profile(self, phases: dict[str, float]) -> None:
        prof, cfg = self.flops_profiler, self.profiler_config
        assert prof is not None
        gas = self.config.gradient_accumulation_steps
        self._profile_timings = {
            "world_size": self.throughput.world_size,
            "bwd_s": phases.get(BACKWARD_GLOBAL_TIMER, 0.0) / 1000.0 / gas,
            "step_s": phases.get(STEP_GLOBAL_TIMER, 0.0) / 1000.0,
        }
        fwd_flops = int(prof.get_total_flops())
        micro = max(1, self.config.train_micro_batch_size_per_gpu)
        self.throughput.flops_per_sample = (3 + prof.recompute_fwd_factor) * fwd_flops / micro
        if self.is_rank0:
            prof.print_model_profile(
                profile_step=cfg.profile_step,
                module_depth=cfg.module_depth,
                top_modules=cfg.top_modules,
                detailed=cfg.detailed,
                output_file=cfg.output_file,
            )
        prof.end_profile()
        self._profile_window = False

    def close(self) -> None:
        """Flush and close the monitors and the progress display."""
        self.monitor.close()
        self.progress.close()


def _sequence_length(first_input: Any) -> int | None:
    """Tokens per sample when the input looks like a batch of sequences: integer ids shaped
    (batch, seq) or embeddings shaped (batch, seq, hidden); None otherwise."""
    if not isinstance(first_input, torch.Tensor):
        return None
    if first_input.dim() == 2 and not first_input.is_floating_point():
        return int(first_input.shape[1])
    if first_input.dim() == 3 and first_input.is_floating_point():
        return int(first_input.shape[1])
    return None
