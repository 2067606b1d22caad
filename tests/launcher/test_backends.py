"""Each multi-node backend's command line, compared as data."""

from __future__ import annotations

import pytest

from shardspeed.launcher.backends import (
    IMPIRunner,
    LaunchPlan,
    MPICHRunner,
    MVAPICHRunner,
    OpenMPIRunner,
    PDSHRunner,
    SlurmRunner,
    get_runner,
)
from shardspeed.launcher.world_info import encode_world_info

RES = {"worker-0": [0, 1], "worker-1": [0, 1]}
WI = encode_world_info(RES)


def plan(**overrides) -> LaunchPlan:
    base = dict(
        resources=RES,
        user_script="train.py",
        user_args=("--deepspeed_config", "ds.json"),
        master_addr="worker-0",
        master_port=29500,
        exports={"NCCL_DEBUG": "INFO", "PYTHONPATH": "/opt/my code"},
        python="/usr/bin/python3",
        cwd="/work/job",
    )
    base.update(overrides)
    return LaunchPlan(**base)


def test_pdsh_ssh_mode() -> None:
    cmd = PDSHRunner().get_cmd(plan(launch_flags=("--save_pid=42",)))
    script = (
        "export NCCL_DEBUG=INFO; export PYTHONPATH='/opt/my code'; cd /work/job; "
        f"/usr/bin/python3 -u -m shardspeed.launcher.launch --world_info={WI} "
        "--master_addr=worker-0 --master_port=29500 --save_pid=42 --node_rank=%n "
        "train.py --deepspeed_config ds.json"
    )
    assert cmd == ["pdsh", "-S", "-f", "1024", "-w", "worker-0,worker-1", script]


def test_pdsh_exec_mode_and_percent_escaping() -> None:
    p = plan(
        launcher_args=("-R", "exec"),
        user_args=("--note", "50%"),
        exports={},
        module=True,
        no_local_rank=True,
    )
    cmd = PDSHRunner().get_cmd(p)
    assert cmd[:8] == ["pdsh", "-S", "-f", "1024", "-w", "worker-0,worker-1", "-R", "exec"]
    assert cmd[8:10] == ["sh", "-c"]
    assert cmd[10] == (
        f"cd /work/job; /usr/bin/python3 -u -m shardspeed.launcher.launch --world_info={WI} "
        "--master_addr=worker-0 --master_port=29500 --module --no_local_rank --node_rank=%n "
        "train.py --note 50%%"
    )
    assert PDSHRunner().get_cmd(plan(exports={}), {"PDSH_RCMD_TYPE": "exec"})[-3:-1] == [
        "sh",
        "-c",
    ]


def test_pdsh_env_and_venv() -> None:
    runner = PDSHRunner()
    env = runner.get_env(plan(ssh_port=2222), {"PDSH_SSH_ARGS_APPEND": "-q"})
    assert env["PDSH_RCMD_TYPE"] == "ssh"
    assert env["PDSH_SSH_ARGS_APPEND"] == "-q -p 2222"
    assert runner.get_env(plan(), {"PDSH_RCMD_TYPE": "rsh"})["PDSH_RCMD_TYPE"] == "rsh"
    script = runner.get_cmd(plan(exports={}, venv_script="/opt/venv/bin/activate"))[-1]
    assert script.startswith(". /opt/venv/bin/activate; cd /work/job; ")


def test_openmpi() -> None:
    p = plan(launcher_args=("--mca", "btl_tcp_if_include", "eth0"))
    assert OpenMPIRunner().get_cmd(p) == [
        "mpirun",
        "-n",
        "4",
        "--host",
        "worker-0:2,worker-1:2",
        "--mca",
        "btl_tcp_if_include",
        "eth0",
        "-x",
        "NCCL_DEBUG=INFO",
        "-x",
        "PYTHONPATH=/opt/my code",
        "-x",
        "MASTER_ADDR=worker-0",
        "-x",
        "MASTER_PORT=29500",
        "/usr/bin/python3",
        "-u",
        "train.py",
        "--deepspeed_config",
        "ds.json",
    ]
    uneven = plan(resources={"a": [0, 1, 2], "b": [0]}, exports={}, ssh_port=2222, module=True)
    assert OpenMPIRunner().get_cmd(uneven) == [
        "mpirun",
        "-n",
        "4",
        "--host",
        "a:3,b:1",
        "--mca",
        "plm_rsh_args",
        "-p 2222",
        "-x",
        "MASTER_ADDR=worker-0",
        "-x",
        "MASTER_PORT=29500",
        "/usr/bin/python3",
        "-u",
        "-m",
        "train.py",
        "--deepspeed_config",
        "ds.json",
    ]


@pytest.mark.parametrize("runner", [MPICHRunner(), IMPIRunner()])
def test_hydra(runner) -> None:
    assert runner.get_cmd(plan(exports={"NCCL_DEBUG": "INFO"})) == [
        "mpirun",
        "-n",
        "4",
        "-ppn",
        "2",
        "-hosts",
        "worker-0,worker-1",
        "-genv",
        "NCCL_DEBUG",
        "INFO",
        "-genv",
        "MASTER_ADDR",
        "worker-0",
        "-genv",
        "MASTER_PORT",
        "29500",
        "/usr/bin/python3",
        "-u",
        "train.py",
        "--deepspeed_config",
        "ds.json",
    ]


def test_mvapich_defaults() -> None:
    cmd = MVAPICHRunner().get_cmd(plan(exports={"MV2_ENABLE_AFFINITY": "1"}, uses_gpus=True))
    pairs = {cmd[i + 1]: cmd[i + 2] for i, tok in enumerate(cmd) if tok == "-genv"}
    assert pairs == {
        "MV2_SMP_USE_CMA": "0",
        "MV2_DEBUG_SHOW_BACKTRACE": "1",
        "MV2_SUPPORT_DL": "1",
        "MV2_ENABLE_AFFINITY": "1",  # the user's export wins over the default
        "MV2_USE_CUDA": "1",
        "MASTER_ADDR": "worker-0",
        "MASTER_PORT": "29500",
    }


def test_slurm() -> None:
    p = plan(launcher_args=("--partition", "gpu"), no_python=True, user_script="/bin/prog")
    assert SlurmRunner().get_cmd(p) == [
        "srun",
        "-n",
        "4",
        "-N",
        "2",
        "--ntasks-per-node",
        "2",
        "-w",
        "worker-0,worker-1",
        "--export=ALL,NCCL_DEBUG=INFO,PYTHONPATH=/opt/my code,MASTER_ADDR=worker-0,"
        "MASTER_PORT=29500",
        "--partition",
        "gpu",
        "/bin/prog",
        "--deepspeed_config",
        "ds.json",
    ]


@pytest.mark.parametrize(
    ("runner", "p", "message"),
    [
        (
            OpenMPIRunner(),
            plan(resources={"a": [0, 2]}),
            "--launcher openmpi places ranks by count and cannot use slots [0, 2] on host 'a'; "
            "select slots 0..n-1 (e.g. --num_gpus n) or use --launcher pdsh",
        ),
        (
            MPICHRunner(),
            plan(resources={"a": [0, 1], "b": [0]}),
            "--launcher mpich needs the same number of slots on every host (got a=2, b=1); use "
            "--num_gpus to even them out",
        ),
        (
            IMPIRunner(),
            plan(ssh_port=22),
            "--ssh_port is not supported with --launcher impi; configure the port in "
            "~/.ssh/config for the hosts instead",
        ),
        (
            SlurmRunner(),
            plan(exports={"NCCL_SOCKET_IFNAME": "eth0,eth1"}),
            "cannot export NCCL_SOCKET_IFNAME='eth0,eth1' through srun --export (its list is "
            "comma-separated); set NCCL_SOCKET_IFNAME in the job script or drop it from the env "
            "file",
        ),
        (
            OpenMPIRunner(),
            plan(launch_flags=("--bind_cores_to_rank", "--save_pid=3")),
            "--launcher openmpi starts every rank itself, so the per-node options "
            "--bind_cores_to_rank --save_pid=3 cannot apply; drop them or use --launcher pdsh "
            "/ --no_ssh",
        ),
        (
            SlurmRunner(),
            plan(venv_script="/v"),
            "--venv_script is only supported with --launcher pdsh; with slurm, activate the "
            "environment in your job script instead",
        ),
    ],
)
def test_validation_errors(runner, p: LaunchPlan, message: str) -> None:
    with pytest.raises(ValueError) as info:
        runner.validate(p)
    assert str(info.value) == message


def test_registry() -> None:
    assert type(get_runner("OpenMPI")) is OpenMPIRunner
    with pytest.raises(ValueError) as info:
        get_runner("torchrun")
    assert str(info.value) == (
        "unknown --launcher 'torchrun'; choose one of pdsh, openmpi, mvapich, mpich, impi, slurm"
    )
    PDSHRunner().validate(plan(launch_flags=("--bind_cores_to_rank",)))  # pdsh honours them


def test_backends_never_inherit_a_rank_identity() -> None:
    # a launch from a process with a rank (RANK/WORLD_SIZE exported by an in-process engine)
    environ = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "PATH": "/bin", "NCCL_X": "1"}
    for runner in (OpenMPIRunner(), PDSHRunner()):
        env = runner.get_env(plan(), environ)
        assert not {"RANK", "WORLD_SIZE", "LOCAL_RANK"} & set(env), runner.name
        assert env["PATH"] == "/bin" and env["NCCL_X"] == "1"
