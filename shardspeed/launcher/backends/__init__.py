"""Multi-node backends, one module per runner program; :func:`get_runner` picks one by name."""

from __future__ import annotations

from shardspeed.launcher.backends.base import LaunchPlan, MultiNodeRunner, rank_program
from shardspeed.launcher.backends.impi import IMPIRunner
from shardspeed.launcher.backends.mpich import MPICHRunner
from shardspeed.launcher.backends.mvapich import MVAPICHRunner
from shardspeed.launcher.backends.openmpi import OpenMPIRunner
from shardspeed.launcher.backends.pdsh import PDSHRunner
from shardspeed.launcher.backends.slurm import SlurmRunner

RUNNERS: dict[str, type[MultiNodeRunner]] = {
    runner.name: runner
    for runner in (
        PDSHRunner,
        OpenMPIRunner,
        MVAPICHRunner,
        MPICHRunner,
        IMPIRunner,
        SlurmRunner,
    )
}


def get_runner(name: str) -> MultiNodeRunner:
    """The backend called ``name`` (case-insensitive); ``ValueError`` lists the valid names."""
    runner = RUNNERS.get(name.lower())
    if runner is None:
        raise ValueError(f"unknown --launcher {name!r}; choose one of {', '.join(RUNNERS)}")
    return runner()


__all__ = [
    "RUNNERS",
    "get_runner",
    "LaunchPlan",
    "MultiNodeRunner",
    "rank_program",
    "IMPIRunner",
    "MPICHRunner",
    "MVAPICHRunner",
    "OpenMPIRunner",
    "PDSHRunner",
    "SlurmRunner",
]
