"""The results of a tune: a table (``summary.txt``, also printed), every trial as JSON
(``results.json``) and, when matplotlib is installed, the metric per trial (``trials.png``)."""

from __future__ import annotations

import json
import os
from typing import Any

from shardspeed.utils.logging import logger

__all__ = ["format_table", "plot_trials", "write_results"]

GB = 2**30


def format_table(rows: list[dict[str, Any]], metric: str) -> str:
    """One line per trial: order, name, memory estimate, status, metric, cause."""
    header = ["#", "experiment", "est. GiB/rank", "status", metric, "note"]
    body = []
    for i, row in enumerate(rows, 1):
        value = row.get("metrics", {}).get(metric)
        body.append(
            [
                str(i),
                row["name"],
                f"{row['memory_bytes'] / GB:.3f}",
                row["status"] + (" (resumed)" if row.get("resumed") else ""),
                f"{value:.4g}" if value is not None else "-",
                row.get("cause", "")[:60],
            ]
        )
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in [header]]
    lines.append("-+-".join("-" * w for w in widths))
    lines += [" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in body]
    return "\n".join(lines)


def plot_trials(rows: list[dict[str, Any]], metric: str, path: str) -> str:
    """Write the metric per trial to ``path``; returns a note on what was done."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (pip install matplotlib)"
    values = [r.get("metrics", {}).get(metric, 0.0) if r["status"] == "ok" else 0.0 for r in rows]
    fig, ax = plt.subplots(figsize=(max(4.0, 0.6 * len(rows)), 3.5))
    ax.bar(range(1, len(rows) + 1), values)
    ax.set_xticks(range(1, len(rows) + 1), [r["name"] for r in rows], rotation=60, ha="right")
    ax.set_ylabel(metric)
    ax.set_title("autotuning trials (0: failed)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return f"plot: {path}"


def write_results(results_dir: str, rows: list[dict[str, Any]], metric: str, footer: str) -> str:
    """Write ``summary.txt``, ``results.json`` and the plot; returns the table."""
    os.makedirs(results_dir, exist_ok=True)
    table = format_table(rows, metric)
    note = plot_trials(rows, metric, os.path.join(results_dir, "trials.png"))
    with open(os.path.join(results_dir, "summary.txt"), "w") as fd:
        fd.write(f"{table}\n\n{footer}\n{note}\n")
    with open(os.path.join(results_dir, "results.json"), "w") as fd:
        json.dump(rows, fd, indent=2)
    logger.info(f"autotuning results:\n{table}\n{footer}\n{note}")
    return table
