"""DeepSpeed's ``deepspeed.launcher.multinode_runner``: the multi-node runner classes.

They live in :mod:`shardspeed.launcher.backends`, one module per program; a runner builds its
command from a :class:`~shardspeed.launcher.backends.LaunchPlan`, and :meth:`add_export` /
``exports`` add variables to every rank as DeepSpeed's runners do.
"""

from shardspeed.launcher.backends import (
    IMPIRunner,
    LaunchPlan,
    MPICHRunner,
    MultiNodeRunner,
    MVAPICHRunner,
    OpenMPIRunner,
    PDSHRunner,
    SlurmRunner,
)

__all__ = [
    "IMPIRunner",
    "LaunchPlan",
    "MPICHRunner",
    "MVAPICHRunner",
    "MultiNodeRunner",
    "OpenMPIRunner",
    "PDSHRunner",
    "SlurmRunner",
]
