"""A save killed at any point loses nothing: real processes, real SIGKILLs.

A 2-rank job trains, saves tag A, trains, and saves tag B; one rank, the other or both SIGKILL
themselves at chosen points of the save of B (driven by file-write counts through
:mod:`shardspeed.checkpoint.crash_points`, never by timing): in the middle of a file's bytes,
between a rank's files, after every file is written but before the manifest, after the manifest
but before the tag is renamed into place, after that but before ``latest`` moves, and after. Each
time a new job loads what ``latest`` names (A, or B once ``latest`` moved) and trains on in exact
parity with the uninterrupted run; a B folder, if there is one, is complete and resumes too.
"""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path
from typing import Any

import pytest

from tests.checkpoint import crash_job
from tests.harness.distributed import free_port

SURVIVOR_TIMEOUT_S = 60


def _points(events: Path) -> list[tuple[int, str]]:
    return [
        (int(k), label)
        for k, label in (line.split() for line in events.read_text().split("\n") if line)
    ]


def _choose(points: list[tuple[int, str]]) -> dict[str, int]:
    """The points of one rank's save of B worth killing at, by name."""
    writes = [k for k, label in points if label == "write"]
    renamed = [k for k, label in points if label == "renamed"]
    chosen = {
        "first-write": writes[0],
        "mid-first-file": (writes[0] + renamed[0]) // 2,
        "between-files": renamed[0],
        "last-write": writes[-1],
    }
    for label in ("manifest", "commit", "latest", "done"):  # the committing rank's steps
        found = [k for k, name in points if name == label]
        if found:
            chosen[f"before-{label}" if label != "done" else "after-latest"] = found[0]
    return chosen


def _run_killed_job(folder: Path, kill_at: dict[int, int]) -> list[int | None]:
    ctx: Any = mp.get_context("forkserver")
    port = free_port()
    procs = [
        ctx.Process(target=crash_job.killed_job, args=(rank, port, str(folder), kill_at))
        for rank in range(2)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(SURVIVOR_TIMEOUT_S)
    codes = []
    for proc in procs:
        if proc.is_alive():  # should not happen: a dead peer fails the survivor's collective
            proc.kill()
            proc.join()
            codes.append(None)
        else:
            codes.append(proc.exitcode)
    return codes


@pytest.mark.timeout(600)
def test_a_save_killed_anywhere_leaves_a_loadable_checkpoint(dist_pool, tmp_path):
    mp.get_context("forkserver").set_forkserver_preload(["torch", "tests.checkpoint.crash_job"])
    pool = dist_pool(2)
    ref_dir = tmp_path / "reference"
    pool.run(crash_job.reference_run, str(ref_dir), str(tmp_path / "events"))
    reference = str(ref_dir / "ref.pt")
    rank0 = _choose(_points(tmp_path / "events.0"))
    rank1 = _choose(_points(tmp_path / "events.1"))
    cases: dict[str, dict[int, int]] = {f"rank0-{n}": {0: k} for n, k in rank0.items()}
    cases.update({f"rank1-{n}": {1: k} for n, k in rank1.items()})
    cases["both-mid-file"] = {0: rank0["mid-first-file"], 1: rank1["mid-first-file"]}
    # both die before any collective (a rank killed later would never get there: its peer's
    # death stops it in the save's first collective)
    cases["both-between-and-last-write"] = {0: rank0["between-files"], 1: rank1["last-write"]}
    for case, kill_at in cases.items():
        folder = tmp_path / case
        codes = _run_killed_job(folder, kill_at)
        killed = [rank for rank, code in enumerate(codes) if code == -9]
        assert killed == sorted(kill_at), (case, codes)
        assert None not in codes, f"{case}: a surviving rank hung ({codes})"
        expected = "B" if case == "rank0-after-latest" else "A"
        assert (folder / "latest").read_text() == expected, case
        assert pool.run(crash_job.resume, str(folder), reference)[0] == expected, case
        if (folder / "B").exists():  # renamed into place: complete
            assert (folder / "B" / "manifest.json").is_file(), case
            pool.run(crash_job.resume, str(folder), reference, "B")
        else:
            assert case not in ("rank0-before-latest", "rank0-after-latest"), case
