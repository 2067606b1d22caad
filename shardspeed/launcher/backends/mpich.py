"""MPICH's Hydra ``mpirun`` (ranks see ``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``)."""

from __future__ import annotations

from shardspeed.launcher.backends.hydra import HydraRunner
from shardspeed.launcher.constants import MPICH_LAUNCHER


class MPICHRunner(HydraRunner):
    """``mpirun -n W -ppn P -hosts ... -genv K V ... python -u script``."""

    name = MPICH_LAUNCHER
