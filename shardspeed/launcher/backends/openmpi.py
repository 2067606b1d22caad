"""OpenMPI's ``mpirun``: one process per rank; ranks read ``OMPI_COMM_WORLD_*`` for their identity.

``--host h1:2,h2:2`` places the ranks (no temporary hostfile needed, and ``--include`` /
``--exclude`` / ``--num_nodes`` shape it); ``-x NAME=value`` carries the allowlisted environment
and the rendezvous address. No ``--mca`` defaults are forced: network choices such as
``btl_tcp_if_include`` belong in ``--launcher_args``.
"""

from __future__ import annotations

from shardspeed.launcher.backends.base import (
    LaunchPlan,
    PooledRunner,
    rank_program,
    rendezvous_env,
    require_prefix_slots,
)
from shardspeed.launcher.constants import OPENMPI_LAUNCHER


class OpenMPIRunner(PooledRunner):
    """``mpirun -n W --host h1:n1,h2:n2 [args] -x K=V ... python -u script args``."""

    name = OPENMPI_LAUNCHER
    binary = "mpirun"

    def validate(self, plan: LaunchPlan) -> None:
        super().validate(plan)
        require_prefix_slots(plan, self.name)

    def get_cmd(self, plan: LaunchPlan) -> list[str]:
        hosts = ",".join(f"{host}:{len(slots)}" for host, slots in plan.resources.items())
        cmd = ["mpirun", "-n", str(plan.world_size), "--host", hosts]
        if plan.ssh_port is not None:
            cmd += ["--mca", "plm_rsh_args", f"-p {plan.ssh_port}"]
        cmd += list(plan.launcher_args)
        for key, value in rendezvous_env(plan).items():
            cmd += ["-x", f"{key}={value}"]
        return cmd + rank_program(plan)
