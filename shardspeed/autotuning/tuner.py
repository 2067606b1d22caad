"""Search strategies over the points that fit: grid, random, and model-based.

All three share :func:`search`: ask the tuner for the next point, measure it, tell the tuner,
until ``num_trials`` measurements, the space is exhausted, ``early_stopping`` trials in a row
did not improve the best, or (model-based) the cost model predicts nothing left beats the best.

The model-based tuner starts from a prior order (activation checkpointing off first: no
recomputation; then larger micro-batches: fewer micro-steps per optimizer step; then fewer
tensor/sequence-parallel ranks and pipeline stages per model copy, lower ZeRO stages and no offload: less
communication) and, once two trials are measured, fits a ridge least-squares model of
``log(metric)`` on simple features of a point (``1/micro_batch``, ``log2(micro_batch)``, one-hot
ZeRO stage, offload, ``log`` bucket size, ``log2(tp)``, ``log2(sp)``, ``log2(pp)``, checkpointing on) and
measures the unmeasured point with the best prediction next, the prior breaking ties. An axis
(micro-batch, stage, offload, bucket, tp, sp, pp, checkpointing) on which every measured point agrees
is explored first (the next point in prior order that differs there), as the model knows nothing
about it yet.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import TypeVar

from shardspeed.autotuning.space import Point

__all__ = ["GridSearchTuner", "ModelBasedTuner", "RandomTuner", "Tuner", "make_tuner", "search"]

R = TypeVar("R")
MAXIMIZED = {"throughput": True, "flops": True, "latency": False}


class Tuner:
    """Grid search: the points in the space's order."""

    def __init__(self, points: list[Point], metric: str) -> None:
        self.pending = list(points)
        self.metric = metric
        self.measured: list[tuple[Point, float]] = []

    def better(self, a: float, b: float) -> bool:
        """Whether metric value ``a`` beats ``b``."""
        return a > b if MAXIMIZED[self.metric] else a < b

    def next_point(self) -> Point | None:
        return self.pending.pop(0) if self.pending else None

    def update(self, point: Point, value: float | None) -> None:
        """Record a measurement (``None``: the experiment failed)."""
        if value is not None and value > 0:
            self.measured.append((point, value))

    def done_early(self, best: float | None) -> bool:
        """Whether the tuner itself sees no point in going on."""
        return False


GridSearchTuner = Tuner


class RandomTuner(Tuner):
    """The points in a seeded random order."""

    def __init__(self, points: list[Point], metric: str, seed: int = 0) -> None:
        super().__init__(points, metric)
        random.Random(seed).shuffle(self.pending)


def _prior_key(point: Point) -> tuple[float, ...]:
    return (
        bool(point.ckpt),
        -point.micro_batch,
        point.tp_size * point.sp_size * point.pp_size,
        point.stage,
        point.offload != "none",
        -(point.bucket or 0),
    )


_AXES: tuple[Callable[[Point], object], ...] = (
    lambda p: p.micro_batch,
    lambda p: p.stage,
    lambda p: p.offload,
    lambda p: p.bucket,
    lambda p: p.tp_size,
    lambda p: p.sp_size,
    lambda p: p.pp_size,
    lambda p: bool(p.ckpt),
)


def _features(point: Point) -> list[float]:
    return [
        1.0,
        1.0 / point.micro_batch,
        math.log2(point.micro_batch),
        float(point.stage == 1),
        float(point.stage == 2),
        float(point.stage == 3),
        float(point.offload != "none"),
        math.log10(point.bucket) - 8.0 if point.bucket else 0.0,
        math.log2(point.tp_size),
        math.log2(point.sp_size),
        math.log2(point.pp_size),
        float(bool(point.ckpt)),
    ]


def _ridge(rows: list[list[float]], ys: list[float], lam: float = 1e-2) -> list[float]:
    """Solve ``(X^T X + lam I') w = X^T y`` (no penalty on the intercept) by elimination."""
    n = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) for j in range(n)] for i in range(n)]
    b = [sum(r[i] * y for r, y in zip(rows, ys, strict=True)) for i in range(n)]
    for i in range(1, n):
        a[i][i] += lam
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        a[col], a[pivot] = a[pivot], a[col]
        b[col], b[pivot] = b[pivot], b[col]
        if abs(a[col][col]) < 1e-12:
            continue
        for r in range(n):
            if r != col and a[r][col]:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col], strict=True)]
                b[r] -= f * b[col]
    return [b[i] / a[i][i] if abs(a[i][i]) >= 1e-12 else 0.0 for i in range(n)]


class ModelBasedTuner(Tuner):
    """Measures next the point a cost model fitted to the trials so far predicts best."""

    #: stop when no unmeasured point is predicted to beat the best by this fraction
    min_gain = 0.0

    def __init__(self, points: list[Point], metric: str) -> None:
        super().__init__(sorted(points, key=_prior_key), metric)
        self.weights: list[float] | None = None

    def predict(self, point: Point) -> float | None:
        """The model's metric for ``point`` (None before two measurements)."""
        if self.weights is None:
            return None
        z = sum(w * f for w, f in zip(self.weights, _features(point), strict=True))
        return math.exp(z)

    def update(self, point: Point, value: float | None) -> None:
        super().update(point, value)
        if len(self.measured) >= 2:
            rows = [_features(p) for p, _ in self.measured]
            self.weights = _ridge(rows, [math.log(v) for _, v in self.measured])

    def _unexplored(self) -> Point | None:
        """The first pending point (prior order) that varies an axis every measured point shares:
        the model cannot tell how that axis matters until it has seen two of its values."""
        if not self.measured:
            return None
        for axis in _AXES:
            seen = {axis(p) for p, _ in self.measured}
            if len(seen) == 1:
                other = next((p for p in self.pending if axis(p) not in seen), None)
                if other is not None:
                    return other
        return None

    def next_point(self) -> Point | None:
        if not self.pending:
            return None
        explore = self._unexplored()
        if explore is not None:
            self.pending.remove(explore)
            return explore
        if self.weights is not None:
            sign = 1.0 if MAXIMIZED[self.metric] else -1.0
            # max() keeps the first of equals: the prior order breaks ties
            best = max(self.pending, key=lambda p: sign * (self.predict(p) or 0.0))
            self.pending.remove(best)
            return best
        return self.pending.pop(0)

    def done_early(self, best: float | None) -> bool:
        if self.weights is None or best is None or not self.pending:
            return False
        if self._unexplored() is not None:
            return False
        predictions = [self.predict(p) or 0.0 for p in self.pending]
        if MAXIMIZED[self.metric]:
            return max(predictions) <= best * (1.0 + self.min_gain)
        return min(predictions) >= best * (1.0 - self.min_gain)


def make_tuner(kind: str, points: list[Point], metric: str) -> Tuner:
    """The tuner named by ``autotuning.tuner_type``."""
    if kind == "gridsearch":
        return GridSearchTuner(points, metric)
    if kind == "random":
        return RandomTuner(points, metric)
    if kind == "model_based":
        return ModelBasedTuner(points, metric)
    raise ValueError(f"autotuning.tuner_type {kind!r}: use gridsearch, random or model_based")


def search(
    tuner: Tuner,
    evaluate: Callable[[Point], tuple[float | None, R]],
    num_trials: int,
    early_stopping: int,
) -> list[tuple[Point, R]]:
    """Run trials until a stopping rule fires; ``evaluate`` returns (metric or None, record)."""
    records: list[tuple[Point, R]] = []
    best: float | None = None
    since_best = 0
    while len(records) < num_trials:
        point = tuner.next_point()
        if point is None:
            break
        value, record = evaluate(point)
        records.append((point, record))
        tuner.update(point, value)
        if value is not None and (best is None or tuner.better(value, best)):
            best, since_best = value, 0
        else:
            since_best += 1
        if early_stopping and since_best >= early_stopping:
            break
        if tuner.done_early(best):
            break
    return records
