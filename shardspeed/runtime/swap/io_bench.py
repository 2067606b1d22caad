"""``shardspeed-io``: swapper read/write bandwidth against ``dd``, and the best ``aio`` settings.

The job of DeepSpeed's ``ds_io`` / ``ds_nvme_tune``, in pure Python. On the folder given (the
intended ``nvme_path``) it times ``dd`` with ``oflag=direct`` / ``iflag=direct`` and the
:class:`~shardspeed.runtime.swap.TensorSwapper` over a grid of block sizes, queue depths and
thread counts, in the same run (interleaved, round by round), each figure the median and range of ``--repeats``
rounds, and prints the ``aio`` section that was fastest (write plus read GB/s), with the best
swapper figures (at that one setting) against the best ``dd`` figures (over all block sizes)::

    shardspeed-io --folder /local_nvme --size-mb 512 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shardspeed.config.aio import AioConfig
from shardspeed.runtime.swap.aligned import direct_io_supported
from shardspeed.runtime.swap.swapper import TensorSwapper

__all__ = ["Figure", "dd_once", "main", "run", "swapper_once"]

MB = 1 << 20


@dataclass
class Figure:
    """Median and spread (min, max) of GB/s over repeats."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, samples: Sequence[float]) -> Figure:
        return cls(statistics.median(samples), min(samples), max(samples))

    def as_json(self) -> dict[str, float]:
        return {
            "gbps": round(self.median, 3),
            "min": round(self.low, 3),
            "max": round(self.high, 3),
        }


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def dd_once(path: str, nbytes: int, block_size: int) -> tuple[float, float] | None:
    """``dd`` overwriting ``path`` in place (``oflag=direct conv=notrunc``) then reading it
    (``iflag=direct``): GB/s each way; None if ``dd`` refuses (no ``O_DIRECT`` there)."""
    count = max(1, nbytes // block_size)
    moved = count * block_size
    sizes = [f"bs={block_size}", f"count={count}"]
    write = ["dd", "if=/dev/zero", f"of={path}", *sizes, "oflag=direct", "conv=notrunc"]
    read = ["dd", f"if={path}", "of=/dev/null", *sizes, "iflag=direct"]
    try:
        write_s = _timed(lambda: subprocess.run(write, check=True, capture_output=True))
        read_s = _timed(lambda: subprocess.run(read, check=True, capture_output=True))
    except (subprocess.CalledProcessError, FileNotFoundError):
        return None
    return _gbps(moved, write_s), _gbps(moved, read_s)


def swapper_once(
    folder: str, aio: AioConfig, src: torch.Tensor, dst: torch.Tensor
) -> tuple[float, float]:
    """The swapper overwriting key ``bench`` with ``src`` then reading it into ``dst`` (aligned
    buffers): GB/s each way. The file is kept for the next call (steady state, as each training
    step swaps into the same space)."""
    nbytes = src.numel() * src.element_size()
    swapper = TensorSwapper(folder, aio)
    try:
        swapper.reserve("bench", nbytes)
        write_s = _timed(lambda: swapper.write("bench", src).wait())
        dst.zero_()
        read_s = _timed(lambda: swapper.read("bench", dst).wait())
    finally:
        swapper.close(remove_files=False)
    if not torch.equal(src, dst):
        raise RuntimeError("shardspeed-io: data read back differs from data written")
    return _gbps(nbytes, write_s), _gbps(nbytes, read_s)


def run(
    folder: str,
    *,
    size_mb: int,
    block_sizes: Sequence[int],
    queue_depths: Sequence[int],
    threads: Sequence[int],
    repeats: int,
) -> dict[str, Any]:
    """The whole sweep as one JSON-ready dict; ``dd`` and the swapper interleave in each round."""
    nbytes = size_mb * MB
    probe = TensorSwapper(folder)
    src = probe.allocate(nbytes, torch.uint8)
    dst = probe.allocate(nbytes, torch.uint8)
    probe.close()
    src.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    configs = [(bs, qd, nt) for bs in block_sizes for qd in queue_depths for nt in threads]
    dd_samples: dict[int, list[tuple[float, float]]] = {bs: [] for bs in block_sizes}
    samples: dict[tuple[int, int, int], list[tuple[float, float]]] = {c: [] for c in configs}
    dd_path = os.path.join(folder, "shardspeed_io_dd.bin")
    try:
        # untimed first writes: both then overwrite allocated, written blocks (steady state)
        dd_once(dd_path, nbytes, MB)
        swapper_once(folder, AioConfig(), src, dst)
        for _ in range(repeats):
            for bs in block_sizes:
                figures = dd_once(dd_path, nbytes, bs)
                if figures is not None:
                    dd_samples[bs].append(figures)
                for qd, nt in [(qd, nt) for qd in queue_depths for nt in threads]:
                    aio = AioConfig(block_size=bs, queue_depth=qd, intra_op_parallelism=nt)
                    samples[(bs, qd, nt)].append(swapper_once(folder, aio, src, dst))
    finally:
        for leftover in (dd_path, os.path.join(folder, "bench.swp")):
            if os.path.exists(leftover):
                os.unlink(leftover)
    grid: list[dict[str, Any]] = [
        {"block_size": bs, "queue_depth": qd, "threads": nt, **_both(samples[(bs, qd, nt)])}
        for bs, qd, nt in configs
    ]
    best = max(grid, key=lambda row: row["write"]["gbps"] + row["read"]["gbps"])
    result: dict[str, Any] = {
        "folder": folder,
        "size_mb": size_mb,
        "repeats": repeats,
        "o_direct": direct_io_supported(folder),
        "dd": {str(bs): _both(s) for bs, s in dd_samples.items() if s},
        "swapper": grid,
        "best_aio": {
            "block_size": best["block_size"],
            "queue_depth": best["queue_depth"],
            "intra_op_parallelism": best["threads"],
            "single_submit": False,
            "overlap_events": True,
        },
    }
    if result["dd"]:
        result["per_block_size"] = _per_block_size(result["dd"], grid)
        dd_best = {
            way: max(row[way]["gbps"] for row in result["dd"].values()) for way in ("write", "read")
        }
        result["best"] = {
            "swapper_write_gbps": best["write"]["gbps"],
            "swapper_read_gbps": best["read"]["gbps"],
            "dd_write_gbps": dd_best["write"],
            "dd_read_gbps": dd_best["read"],
            "write_vs_dd": round(best["write"]["gbps"] / dd_best["write"], 3),
            "read_vs_dd": round(best["read"]["gbps"] / dd_best["read"], 3),
        }
    return result


def _per_block_size(
    dd: dict[str, dict[str, dict[str, float]]], grid: list[dict[str, Any]]
) -> dict[str, dict[str, float]]:
    """At each block size: ``dd`` against the swapper's best queue depth and thread count."""
    out = {}
    for bs, figures in dd.items():
        rows = [row for row in grid if str(row["block_size"]) == bs]
        line = {}
        for way in ("write", "read"):
            best = max(row[way]["gbps"] for row in rows)
            line[f"dd_{way}_gbps"] = figures[way]["gbps"]
            line[f"swapper_{way}_gbps"] = best
            line[f"{way}_vs_dd"] = round(best / figures[way]["gbps"], 3)
        out[bs] = line
    return out


def _both(samples: Sequence[tuple[float, float]]) -> dict[str, dict[str, float]]:
    return {
        "write": Figure.of([w for w, _ in samples]).as_json(),
        "read": Figure.of([r for _, r in samples]).as_json(),
    }


def _sizes(text: str) -> list[int]:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    out = []
    for item in text.split(","):
        item = item.strip().lower()
        scale = units.get(item[-1], 1)
        out.append(int(item[:-1] if scale != 1 else item) * scale)
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardspeed-io", description=__doc__.split("\n\n")[0])
    p.add_argument("--folder", default=None, help="folder to test (nvme_path); default: a temp dir")
    p.add_argument("--size-mb", type=int, default=512, help="bytes moved per figure, in MiB")
    p.add_argument("--block-sizes", type=_sizes, default=_sizes("256k,1m,4m,16m"))
    p.add_argument("--queue-depths", type=_sizes, default=[1, 4, 8, 16])
    p.add_argument("--threads", type=_sizes, default=[1, 2, 4])
    p.add_argument("--repeats", type=int, default=3)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point: print one JSON line; the best ``aio`` section is its ``best_aio``."""
    args = parser().parse_args(argv)
    if args.folder is None:
        with tempfile.TemporaryDirectory(prefix="shardspeed_io_", dir=os.getcwd()) as folder:
            result = _run_args(folder, args)
    else:
        result = _run_args(args.folder, args)
    print(json.dumps(result))
    return 0


def _run_args(folder: str, args: argparse.Namespace) -> dict[str, Any]:
    return run(
        folder,
        size_mb=args.size_mb,
        block_sizes=args.block_sizes,
        queue_depths=args.queue_depths,
        threads=args.threads,
        repeats=args.repeats,
    )


if __name__ == "__main__":
    sys.exit(main())
