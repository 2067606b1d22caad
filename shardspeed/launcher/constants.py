"""Names and defaults shared by the launcher modules."""

from __future__ import annotations

PDSH_LAUNCHER = "pdsh"
OPENMPI_LAUNCHER = "openmpi"
MPICH_LAUNCHER = "mpich"
IMPI_LAUNCHER = "impi"
MVAPICH_LAUNCHER = "mvapich"
SLURM_LAUNCHER = "slurm"
LAUNCHERS: tuple[str, ...] = (
    PDSH_LAUNCHER,
    OPENMPI_LAUNCHER,
    MVAPICH_LAUNCHER,
    MPICH_LAUNCHER,
    IMPI_LAUNCHER,
    SLURM_LAUNCHER,
)

DEFAULT_HOSTFILE = "/job/hostfile"
# torch.distributed's default rendezvous port, as DeepSpeed uses it
DEFAULT_MASTER_PORT = 29500
LOCALHOST_ADDR = "127.0.0.1"

# how long a rank gets between SIGTERM and SIGKILL when the job is torn down
TERMINATE_GRACE_S = 1.0
# how long the other ranks get to fail by themselves after the first failure, so that one
# error raised on every rank is reported once with all its ranks
FAILURE_GRACE_S = 0.3
# where --save_pid writes the pids of a node's ranks
PID_FILE_DIR = "/tmp"
PID_FILE_SUFFIX = ".shardspeed"
