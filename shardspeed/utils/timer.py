"""Wall-clock timers: named, device-synchronized phase timers and a throughput meter.

``SynchronizedWallClockTimer`` holds named timers that synchronize the accelerator on start and
stop (so queued device work is charged to the phase that issued it). When created disabled, every
call is a cheap no-op. ``ThroughputTimer`` turns per-step durations into samples/s, tokens/s and,
when the model's FLOPs per sample are known, TFLOP/s.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import psutil

from shardspeed.accelerator import get_accelerator
from shardspeed.utils.logging import log_dist, logger

__all__ = [
    "BACKWARD_GLOBAL_TIMER",
    "BACKWARD_INNER_GLOBAL_TIMER",
    "BACKWARD_REDUCE_GLOBAL_TIMER",
    "FORWARD_GLOBAL_TIMER",
    "STEP_GLOBAL_TIMER",
    "NoopTimer",
    "SynchronizedWallClockTimer",
    "ThroughputTimer",
]

FORWARD_GLOBAL_TIMER = "fwd"
BACKWARD_GLOBAL_TIMER = "bwd"
BACKWARD_INNER_GLOBAL_TIMER = "bwd_inner"
BACKWARD_REDUCE_GLOBAL_TIMER = "bwd_allreduce"
STEP_GLOBAL_TIMER = "step"


def _synchronize() -> None:
    get_accelerator().synchronize()


class _Timer:
    """One named timer; times accumulate across start/stop pairs until :meth:`reset`."""

    def __init__(self, name: str, synchronize: bool = True) -> None:
        self.name = name
        self.synchronize = synchronize
        self.started = False
        self._start = 0.0
        self._elapsed = 0.0
        self._records: list[float] = []

    def start(self) -> None:
        if self.started:
            raise RuntimeError(f"timer {self.name!r} has already been started")
        if self.synchronize:
            _synchronize()
        self._start = time.perf_counter()
        self.started = True

    def stop(self, reset: bool = False, record: bool = False) -> None:
        """Stop and add the interval (``record`` also keeps it for :meth:`mean`)."""
        if not self.started:
            raise RuntimeError(f"timer {self.name!r} is not started")
        if self.synchronize:
            _synchronize()
        interval = time.perf_counter() - self._start
        self._elapsed = interval if reset else self._elapsed + interval
        if record:
            self._records.append(interval)
        self.started = False

    def reset(self) -> None:
        self.started = False
        self._elapsed = 0.0
        self._records.clear()

    def elapsed(self, reset: bool = True) -> float:
        """Accumulated milliseconds (a running timer is included up to now)."""
        running = self.started
        if running:
            self.stop()
        value = self._elapsed * 1000.0
        if reset:
            self._elapsed = 0.0
        if running:
            self.start()
        return value

    def mean(self) -> float:
        """Mean recorded interval in milliseconds (0 when none)."""
        return 1000.0 * sum(self._records) / len(self._records) if self._records else 0.0


class NoopTimer:
    """A timer that does nothing, for when timing is disabled."""

    def start(self) -> None: ...

    def stop(self, reset: bool = False, record: bool = False) -> None: ...

    def reset(self) -> None: ...

    def elapsed(self, reset: bool = True) -> float:
        return 0.0

    def mean(self) -> float:
        return 0.0


_NOOP = NoopTimer()


class SynchronizedWallClockTimer:
    """Named timers: ``timers("fwd").start()`` ... ``timers("fwd").stop()``; ``timers.log([...])``.

    ``enabled=False`` makes every timer a shared no-op, so instrumented code costs nothing.
    """

    def __init__(self, enabled: bool = True, synchronize: bool = True) -> None:
        self.enabled = enabled
        self.synchronize = synchronize
        self.timers: dict[str, _Timer] = {}

    def __call__(self, name: str) -> _Timer | NoopTimer:
        if not self.enabled:
            return _NOOP
        timer = self.timers.get(name)
        if timer is None:
            timer = self.timers[name] = _Timer(name, self.synchronize)
        return timer

    def get_timers(self) -> dict[str, _Timer]:
        return self.timers

    def has(self, name: str) -> bool:
        return name in self.timers

    @staticmethod
    def memory_usage() -> str:
        """Device allocated / peak / reserved and host RSS, in GB, as one short string."""
        accel = get_accelerator()
        gib = float(2**30)
        return (
            f" | mem_allocated: {accel.memory_allocated() / gib:.4f} GB"
            f" | max_mem_allocated: {accel.max_memory_allocated() / gib:.4f} GB"
            f" | mem_reserved: {accel.memory_reserved() / gib:.4f} GB"
            f" | host_rss: {psutil.Process().memory_info().rss / gib:.4f} GB"
        )

    def get_mean(
        self, names: Iterable[str], normalizer: float = 1.0, reset: bool = True
    ) -> dict[str, float]:
        """Milliseconds per ``normalizer`` for each existing timer in ``names``."""
        if normalizer <= 0:
            raise ValueError(f"normalizer must be positive, got {normalizer}")
        return {
            name: self.timers[name].elapsed(reset=reset) / normalizer
            for name in names
            if name in self.timers
        }

    def log(
        self,
        names: Iterable[str],
        normalizer: float = 1.0,
        reset: bool = True,
        memory_breakdown: bool = False,
        ranks: list[int] | None = None,
    ) -> str:
        """Log ``time (ms) | name: value | ...`` on ``ranks`` (default rank 0); returns the line."""
        means = self.get_mean(names, normalizer, reset)
        line = "time (ms)" + "".join(f" | {name}: {value:.2f}" for name, value in means.items())
        if memory_breakdown:
            line += self.memory_usage()
        if self.enabled and means:
            log_dist(line, ranks=ranks or [0])
        return line


class ThroughputTimer:
    """Samples/s over the steps since ``start_step``; tokens/s and TFLOP/s when known.

    Call :meth:`start` before a micro-step's forward and :meth:`stop` after it; pass
    ``global_step=True`` at an optimizer step. Every ``steps_per_output`` optimizer steps a line
    is passed to ``logging_fn``.
    """

    def __init__(
        self,
        config: Any = None,
        batch_size: int = 1,
        start_step: int = 2,
        steps_per_output: int | None = None,
        monitor_memory: bool = False,
        logging_fn: Callable[[str], None] | None = None,
    ) -> None:
        self.enabled = bool(getattr(config, "enabled", True))
        self.synchronized = bool(getattr(config, "synchronized", True))
        self.batch_size = max(1, int(batch_size))
        self.start_step = start_step
        self.steps_per_output = steps_per_output
        self.monitor_memory = monitor_memory
        self.logging = logging_fn or logger.info
        self.tokens_per_sample: int | None = None
        self.flops_per_sample: float | None = None
        self.world_size = 1
        self.reset()

    def reset(self) -> None:
        self.started = False
        self.micro_step_count = 0
        self.global_step_count = 0
        self.total_elapsed_time = 0.0
        self.step_elapsed_time = 0.0
        self._start_time = 0.0

    def start(self) -> None:
        if not self.enabled or self.started:
            return
        if self.global_step_count >= self.start_step and self.synchronized:
            _synchronize()
        self._start_time = time.perf_counter()
        self.started = True

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        if not self.enabled or not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if self.global_step_count < self.start_step:
            return  # still warming up: these steps include one-off costs
        if self.synchronized:
            _synchronize()
        duration = time.perf_counter() - self._start_time
        self.total_elapsed_time += duration
        self.step_elapsed_time += duration
        every = self.steps_per_output
        if global_step and report_speed and every and self.global_step_count % every == 0:
            self.logging(self.report())
            self.step_elapsed_time = 0.0

    @property
    def _measured_steps(self) -> int:
        return max(0, self.global_step_count - self.start_step)

    def avg_samples_per_sec(self) -> float:
        """Mean samples per second since warm-up ended (0 before any measured step)."""
        if self._measured_steps <= 0 or self.total_elapsed_time <= 0:
            return 0.0
        return self.batch_size * self._measured_steps / self.total_elapsed_time

    def avg_tokens_per_sec(self) -> float | None:
        if self.tokens_per_sample is None:
            return None
        return self.avg_samples_per_sec() * self.tokens_per_sample

    def avg_tflops_per_sec(self) -> float | None:
        """Training TFLOP/s per rank (needs ``flops_per_sample``, e.g. from the FLOPs profiler)."""
        if self.flops_per_sample is None:
            return None
        return self.avg_samples_per_sec() * self.flops_per_sample / self.world_size / 1e12

    def report(self) -> str:
        """``epoch_step=..., samples/sec=...`` plus tokens/s, TFLOP/s and memory when known."""
        parts = [
            f"global_step={self.global_step_count}",
            f"samples/sec={self.avg_samples_per_sec():.2f}",
        ]
        tokens = self.avg_tokens_per_sec()
        if tokens is not None:
            parts.append(f"tokens/sec={tokens:.1f}")
        tflops = self.avg_tflops_per_sec()
        if tflops is not None:
            parts.append(f"TFLOP/s per rank={tflops:.4f}")
        line = ", ".join(parts)
        if self.monitor_memory:
            vm = psutil.virtual_memory()
            line += f", host memory used={vm.percent}%"
        return line
