"""The Hydra-style ``mpirun`` shared by MPICH, Intel MPI and MVAPICH2.

All three take ``-n`` (total ranks), ``-ppn`` (ranks per node), ``-hosts h1,h2`` and
``-genv NAME value``, and give each rank ``PMI_RANK``/``PMI_SIZE`` (MVAPICH2 also
``MV2_COMM_WORLD_*``), which ``shardspeed.comm.init_distributed`` reads.
"""

from __future__ import annotations

from shardspeed.launcher.backends.base import (
    LaunchPlan,
    PooledRunner,
    rank_program,
    rendezvous_env,
    require_prefix_slots,
    uniform_slots_per_node,
)


class HydraRunner(PooledRunner):
    """``mpirun -n W -ppn P -hosts h1,h2 [args] -genv K V ... python -u script args``."""

    binary = "mpirun"

    def validate(self, plan: LaunchPlan) -> None:
        super().validate(plan)
        if plan.ssh_port is not None:
            raise ValueError(
                f"--ssh_port is not supported with --launcher {self.name}; configure the port "
                "in ~/.ssh/config for the hosts instead"
            )
        require_prefix_slots(plan, self.name)
        uniform_slots_per_node(plan, self.name)

    def extra_env(self, plan: LaunchPlan) -> dict[str, str]:
        """Backend defaults added under the user's exports (the user's values win)."""
        return {}

    def get_cmd(self, plan: LaunchPlan) -> list[str]:
        per_node = uniform_slots_per_node(plan, self.name)
        cmd = ["mpirun", "-n", str(plan.world_size), "-ppn", str(per_node)]
        cmd += ["-hosts", ",".join(plan.hosts), *plan.launcher_args]
        env = {**self.extra_env(plan), **rendezvous_env(plan)}
        for key, value in env.items():
            cmd += ["-genv", key, value]
        return cmd + rank_program(plan)
