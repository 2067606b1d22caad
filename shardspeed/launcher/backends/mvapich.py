"""MVAPICH2's Hydra ``mpirun`` (ranks see ``MV2_COMM_WORLD_RANK/SIZE/LOCAL_RANK``)."""

from __future__ import annotations

from shardspeed.launcher.backends.base import LaunchPlan
from shardspeed.launcher.backends.hydra import HydraRunner
from shardspeed.launcher.constants import MVAPICH_LAUNCHER

# MVAPICH2's own affinity pins every rank's threads to one core, which starves torch's intra-op
# pool; CMA needs ptrace rights containers rarely grant.
MVAPICH_DEFAULTS: dict[str, str] = {
    "MV2_SMP_USE_CMA": "0",
    "MV2_DEBUG_SHOW_BACKTRACE": "1",
    "MV2_SUPPORT_DL": "1",
    "MV2_ENABLE_AFFINITY": "0",
}


class MVAPICHRunner(HydraRunner):
    """Hydra ``mpirun`` plus MVAPICH2 defaults (and ``MV2_USE_CUDA=1`` on GPU nodes)."""

    name = MVAPICH_LAUNCHER

    def extra_env(self, plan: LaunchPlan) -> dict[str, str]:
        env = dict(MVAPICH_DEFAULTS)
        if plan.uses_gpus:
            env["MV2_USE_CUDA"] = "1"
        return env
