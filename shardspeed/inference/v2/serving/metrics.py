"""The server's Prometheus metrics, served at ``GET /metrics`` in Prometheus's text format.

The request path records counters and latency histograms as requests are submitted and their
tokens come out (:mod:`generation`); gauges (running and waiting requests, KV-cache use) are
read from the engine when scraped. Names are vLLM's with the ``shardspeed:`` prefix, so a
dashboard made for a vLLM server carries over by renaming the prefix.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

__all__ = ["CONTENT_TYPE", "Histogram", "ServingMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "shardspeed:"

# vLLM's buckets, in seconds
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
FINISH_REASONS = ("stop", "length", "abort")


class Histogram:
    """Observations counted into fixed upper bounds (``le``), with their sum and count."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * len(self.bounds)  # per bucket, not cumulative
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        """Count ``value`` in the first bucket whose bound is >= it."""
        at = bisect.bisect_left(self.bounds, value)
        if at < len(self.counts):
            self.counts[at] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: str) -> list[str]:
        """The ``_bucket`` (cumulative), ``_sum`` and ``_count`` samples."""
        out, running = [], 0
        for bound, count in zip(self.bounds, self.counts, strict=True):
            running += count
            out.append(f'{name}_bucket{{{labels},le="{bound}"}} {running}')
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {self.count}')
        out.append(f"{name}_sum{{{labels}}} {self.sum!r}")
        out.append(f"{name}_count{{{labels}}} {self.count}")
        return out


def _label(value: str) -> str:
    """A label value escaped as the text format asks (backslash, quote, newline)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class ServingMetrics:
    """What the server counts for ``model_name``; the asyncio thread records and renders."""

    def __init__(self, model_name: str) -> None:
        self.labels = f'model_name="{_label(model_name)}"'
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: Counter[str] = Counter()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        # uid -> [submitted, previous token's time, tokens so far] of each request not ended
        self._open: dict[int, list[float]] = {}

    def submitted(self, uid: int, prompt_tokens: int) -> None:
        """Request ``uid`` (one choice) entered the engine with ``prompt_tokens`` tokens."""
        now = time.monotonic()
        self._open[uid] = [now, now, 0]
        self.prompt_tokens += prompt_tokens

    def token(self, uid: int, at: float = 0.0) -> None:
        """Request ``uid`` produced a token at ``at`` (``time.monotonic()``, when the step that
        made it ended; 0: now): its time to first token, or the time since its previous
        token."""
        state = self._open.get(uid)
        if state is None:
            return
        now = at or time.monotonic()
        (self.itl if state[2] else self.ttft).observe(max(0.0, now - state[1]))
        state[1] = now
        state[2] += 1
        self.generation_tokens += 1

    def ended(self, uid: int, reason: str, at: float = 0.0) -> None:
        """Request ``uid`` ended at ``at`` (0: now) ("stop", "length", or "abort": cancelled,
        or its client gone); a request already ended is not counted twice."""
        state = self._open.pop(uid, None)
        if state is None:
            return
        self.finished[reason if reason in FINISH_REASONS else "abort"] += 1
        self.e2e.observe(max(0.0, (at or time.monotonic()) - state[0]))

    def render(self, backend: Any) -> str:
        """Every metric in Prometheus's text format; gauges read from ``backend`` (the
        generation engine: its ``scheduler`` and that scheduler's ``engine``)."""
        scheduler = getattr(backend, "scheduler", None)
        engine = getattr(scheduler, "engine", None)
        total = int(getattr(engine, "total_blocks", 0) or 0)
        free = int(getattr(engine, "free_blocks", 0) or 0)
        out: list[str] = []

        def metric(name: str, kind: str, text: str, samples: list[str]) -> None:
            out.append(f"# HELP {PREFIX}{name} {text}")
            out.append(f"# TYPE {PREFIX}{name} {kind}")
            out.extend(samples)

        def one(name: str, kind: str, text: str, value: float) -> None:
            metric(name, kind, text, [f"{PREFIX}{name}{{{self.labels}}} {value}"])

        one("num_requests_running", "gauge", "Requests holding KV-cache blocks.",
            int(getattr(scheduler, "num_running", 0)))  # fmt: skip
        one("num_requests_waiting", "gauge", "Requests waiting to be admitted.",
            int(getattr(scheduler, "num_waiting", 0)))  # fmt: skip
        one("kv_cache_usage_perc", "gauge", "Fraction of KV-cache blocks in use (1 = full).",
            (total - free) / total if total else 0.0)  # fmt: skip
        one("num_preemptions_total", "counter", "Sequences preempted to free KV-cache blocks.",
            int(getattr(scheduler, "num_preemptions", 0)))  # fmt: skip
        one("prefix_cache_hits_total", "counter",
            "Prompt tokens taken from the prefix cache instead of computed.",
            int(getattr(engine, "prefix_hit_tokens", 0)))  # fmt: skip
        one("prompt_tokens_total", "counter", "Prompt tokens of submitted requests.",
            self.prompt_tokens)  # fmt: skip
        one("generation_tokens_total", "counter", "Tokens generated.", self.generation_tokens)
        metric("request_success_total", "counter", "Requests ended, by finish reason.", [
            f'{PREFIX}request_success_total{{{self.labels},finished_reason="{reason}"}} '
            f"{self.finished[reason]}"
            for reason in FINISH_REASONS
        ])  # fmt: skip
        for name, text, histogram in (
            ("time_to_first_token_seconds", "Time to first token.", self.ttft),
            ("inter_token_latency_seconds", "Time between a request's tokens.", self.itl),
            ("e2e_request_latency_seconds", "Time from submission to end.", self.e2e),
        ):
            metric(name, "histogram", text, histogram.lines(PREFIX + name, self.labels))
        return "\n".join(out) + "\n"
