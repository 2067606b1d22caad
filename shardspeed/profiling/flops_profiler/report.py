"""Text rendering of a FLOPs profile: number formatting, the summary, the aggregated top modules
and the per-module tree."""

from __future__ import annotations

import sys
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from shardspeed.profiling.flops_profiler.profiler import FlopsProfiler

__all__ = [
    "duration_to_string",
    "emit",
    "engine_summary",
    "flops_to_string",
    "macs_to_string",
    "number_to_string",
    "params_to_string",
    "render_aggregated",
    "render_profile",
]

_RULE = "-" * 26
_LINE = "{:<70}  {:<8}"
_UNITS = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K"))


def number_to_string(num: float, units: str = "", precision: int = 2) -> str:
    """``12.35 G<units>`` style: the largest SI prefix that keeps the number >= 1."""
    for scale, prefix in _UNITS:
        if abs(num) >= scale:
            return f"{num / scale:.{precision}f} {prefix}{units}"
    return (
        f"{num:.{precision}f} {units}".rstrip()
        if isinstance(num, float)
        else f"{num} {units}".rstrip()
    )


def macs_to_string(macs: float, precision: int = 2) -> str:
    return number_to_string(macs, "MACs", precision)


def flops_to_string(flops: float, precision: int = 2) -> str:
    return number_to_string(flops, "FLOPS", precision)


def params_to_string(params: float, precision: int = 2) -> str:
    return number_to_string(params, "", precision)


def duration_to_string(seconds: float, precision: int = 2) -> str:
    if seconds >= 1:
        return f"{seconds:.{precision}f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.{precision}f} ms"
    return f"{seconds * 1e6:.{precision}f} us"


def _pct(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.2f}%" if whole else "0.00%"


def engine_summary(prof: FlopsProfiler) -> dict[str, Any] | None:
    """World/batch sizes and step latencies from the engine driving ``prof`` (None standalone)."""
    engine = prof.ds_engine
    if engine is None:
        return None
    observer = getattr(engine, "observability", None)
    timings = observer.profile_timings() if observer is not None else {}
    return {
        "world_size": int(getattr(engine, "world_size", getattr(engine, "dp_world_size", 1))),
        "dp_size": int(getattr(engine, "dp_world_size", 1)),
        "mp_size": 1 if getattr(engine, "mpu", None) is None else _mp_size(engine.mpu),
        "batch_size": int(engine.train_micro_batch_size_per_gpu()),
        **timings,
    }


def _mp_size(mpu: Any) -> int:
    getter = getattr(mpu, "get_model_parallel_world_size", None)
    return int(getter()) if getter is not None else 1


def render_profile(
    prof: FlopsProfiler,
    profile_step: int,
    module_depth: int,
    top_modules: int,
    detailed: bool,
    summary: dict[str, Any] | None,
) -> str:
    """The whole report as printed by ``print_model_profile``."""
    flops = int(prof.get_total_flops())
    macs = int(prof.get_total_macs())
    params = int(prof.get_total_params())
    fwd = float(prof.get_total_duration())
    out = [
        f"\n{_RULE} DeepSpeed Flops Profiler {_RULE}",
        f"Profile Summary at step {profile_step}:",
        "Notations:\ndata parallel size (dp_size), model parallel size(mp_size),\n"
        "number of parameters (params), number of multiply-accumulate operations(MACs),\n"
        "number of floating-point operations (flops), floating-point operations per second "
        "(FLOPS),\nfwd latency (forward propagation latency), bwd latency (backward propagation "
        "latency),\nstep (weights update latency), iter latency (sum of fwd, bwd and step "
        "latency)\n",
    ]
    mp = 1
    if summary is not None:
        mp = summary["mp_size"]
        out += [
            _LINE.format("world size: ", summary["world_size"]),
            _LINE.format("data parallel size: ", summary["dp_size"]),
            _LINE.format("model parallel size: ", mp),
            _LINE.format("batch size per GPU: ", summary["batch_size"]),
        ]
    out += [
        _LINE.format("params per GPU: ", params_to_string(params)),
        _LINE.format("params of model = params per GPU * mp_size: ", params_to_string(params * mp)),
        _LINE.format("fwd MACs per GPU: ", macs_to_string(macs)),
        _LINE.format("fwd flops per GPU: ", number_to_string(flops)),
        _LINE.format("fwd flops of model = fwd flops per GPU * mp_size: ", number_to_string(flops * mp)),
        _LINE.format("fwd latency: ", duration_to_string(fwd)),
        _LINE.format("fwd FLOPS per GPU = fwd flops per GPU / fwd latency: ", flops_to_string(flops / fwd if fwd else 0)),
    ]  # fmt: skip
    if summary is not None and summary.get("bwd_s"):
        out += _training_lines(prof, flops, fwd, summary)
    out.append(render_aggregated(prof, module_depth, top_modules))
    if detailed:
        out += [
            f"\n{_RULE} Detailed Profile per GPU {_RULE}",
            "Each module profile is listed after its name in the following order: \nparams, "
            "percentage of total params, MACs, percentage of total MACs, fwd latency, percentage "
            "of total fwd latency, fwd FLOPS\n",
            render_tree(prof, module_depth),
        ]
    out.append("-" * 78)
    return "\n".join(out)


def _training_lines(
    prof: FlopsProfiler, flops: int, fwd: float, summary: dict[str, Any]
) -> list[str]:
    factor = prof.recompute_fwd_factor
    bwd, step = float(summary["bwd_s"]), float(summary.get("step_s", 0.0))
    it = fwd + bwd + step
    rate = summary["batch_size"] / it if it else 0.0
    return [
        _LINE.format("bwd latency: ", duration_to_string(bwd)),
        _LINE.format(f"bwd FLOPS per GPU = {2 + factor:g} * fwd flops per GPU / bwd latency: ", flops_to_string((2 + factor) * flops / bwd)),
        _LINE.format(f"fwd+bwd FLOPS per GPU = {3 + factor:g} * fwd flops per GPU / (fwd+bwd latency): ", flops_to_string((3 + factor) * flops / (fwd + bwd))),
        _LINE.format("step latency: ", duration_to_string(step)),
        _LINE.format("iter latency: ", duration_to_string(it)),
        _LINE.format(f"FLOPS per GPU = {3 + factor:g} * fwd flops per GPU / iter latency: ", flops_to_string((3 + factor) * flops / it if it else 0)),
        _LINE.format("samples/second: ", f"{rate:.2f}"),
    ]  # fmt: skip


def _walk(module: nn.Module, name: str, depth: int, max_depth: int):  # type: ignore[no-untyped-def]
    yield name, module, depth
    if max_depth != -1 and depth >= max_depth:
        return
    for child_name, child in module.named_children():
        yield from _walk(child, child_name, depth + 1, max_depth)


def render_aggregated(prof: FlopsProfiler, module_depth: int = -1, top_modules: int = 1) -> str:
    """Per depth, the top module classes by params, MACs and forward latency (summed per class)."""
    by_depth: dict[int, dict[str, list[float]]] = defaultdict(
        lambda: defaultdict(lambda: [0, 0, 0.0])
    )
    for _, module, depth in _walk(prof.model, "", 0, module_depth):
        row = by_depth[depth][type(module).__name__]
        row[0] += prof.module_params(module)
        row[1] += prof.module_macs(module)
        row[2] += prof.module_duration(module)
    out = [f"\n{_RULE} Aggregated Profile per GPU {_RULE}",
           f"Top {top_modules} modules in terms of params, MACs or fwd latency at different model depths:"]  # fmt: skip
    for depth in sorted(by_depth):
        rows = by_depth[depth]

        def top(i: int, fmt: Any, rows: dict[str, list[float]] = rows) -> str:
            best = sorted(rows.items(), key=lambda kv: kv[1][i], reverse=True)[:top_modules]
            return "{" + ", ".join(f"'{k}': '{fmt(v[i])}'" for k, v in best) + "}"

        out += [
            f"depth {depth}:",
            f"    params      - {top(0, params_to_string)}",
            f"    MACs        - {top(1, macs_to_string)}",
            f"    fwd latency - {top(2, duration_to_string)}",
        ]
    return "\n".join(out)


def render_tree(prof: FlopsProfiler, module_depth: int = -1) -> str:
    """The module tree, each line carrying that module's profile."""
    total_params = max(prof.module_params(prof.model), 1)
    total_macs = max(prof.module_macs(prof.model), 1)
    total_time = prof.module_duration(prof.model) or 1.0
    lines = []
    for name, module, depth in _walk(prof.model, "", 0, module_depth):
        params, macs = prof.module_params(module), prof.module_macs(module)
        duration, flops = prof.module_duration(module), prof.module_flops(module)
        label = type(module).__name__ if depth == 0 else f"({name}): {type(module).__name__}"
        lines.append(
            f"{'  ' * depth}{label}({params_to_string(params)} = {_pct(params, total_params)} Params, "
            f"{macs_to_string(macs)} = {_pct(macs, total_macs)} MACs, "
            f"{duration_to_string(duration)} = {_pct(duration, total_time)} latency, "
            f"{flops_to_string(flops / duration if duration else 0)})"
        )
    return "\n".join(lines)


def emit(text: str, output_file: str | None) -> None:
    """Print ``text`` to stdout, or append it to ``output_file``."""
    if output_file is None:
        print(text, file=sys.stdout, flush=True)
        return
    with open(output_file, "a", encoding="utf-8") as handle:
        handle.write(text + "\n")
