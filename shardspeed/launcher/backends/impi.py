"""Intel MPI's ``mpirun`` (ranks see ``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``)."""

from __future__ import annotations

from shardspeed.launcher.backends.hydra import HydraRunner
from shardspeed.launcher.constants import IMPI_LAUNCHER


class IMPIRunner(HydraRunner):
    """``mpirun -n W -ppn P -hosts ... -genv K V ... python -u script``."""

    name = IMPI_LAUNCHER
