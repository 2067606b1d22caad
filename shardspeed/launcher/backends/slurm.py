"""Slurm's ``srun``: one task per rank; ranks read ``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID``.

srun hands tasks the caller's environment by default (``--export=ALL``); the allowlisted exports
and the rendezvous address are added explicitly so they are set even where a site changes that
default. srun's ``--export`` list is comma-separated, so a value containing ``,`` cannot be carried.
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
from shardspeed.launcher.constants import SLURM_LAUNCHER


class SlurmRunner(PooledRunner):
    """``srun -n W -N nodes --ntasks-per-node P -w h1,h2 --export=ALL,K=V [args] python -u ...``."""

    name = SLURM_LAUNCHER
    binary = "srun"

    def validate(self, plan: LaunchPlan) -> None:
        super().validate(plan)
        if plan.ssh_port is not None:
            raise ValueError("--ssh_port has no meaning with --launcher slurm (srun uses no ssh)")
        require_prefix_slots(plan, self.name)
        uniform_slots_per_node(plan, self.name)
        for key, value in rendezvous_env(plan).items():
            if "," in value:
                raise ValueError(
                    f"cannot export {key}={value!r} through srun --export (its list is "
                    f"comma-separated); set {key} in the job script or drop it from the env file"
                )

    def get_cmd(self, plan: LaunchPlan) -> list[str]:
        per_node = uniform_slots_per_node(plan, self.name)
        exports = ",".join(f"{k}={v}" for k, v in rendezvous_env(plan).items())
        cmd = ["srun", "-n", str(plan.world_size), "-N", str(len(plan.hosts))]
        cmd += ["--ntasks-per-node", str(per_node), "-w", ",".join(plan.hosts)]
        cmd += [f"--export=ALL,{exports}", *plan.launcher_args]
        return cmd + rank_program(plan)
