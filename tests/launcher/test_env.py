"""Environment export to remote nodes: allowlist only, env files, quoting."""

from __future__ import annotations

import shlex
import subprocess

import pytest

from shardspeed.launcher.env import collect_exports, parse_env_file, shell_exports

ENVIRON = {
    "NCCL_DEBUG": "INFO",
    "NCCL_SOCKET_IFNAME": "eth0",
    "PYTHONPATH": "/opt/code",
    "PYTHONHASHSEED": "0",
    "CUDA_LAUNCH_BLOCKING": "1",
    "CUDA_VISIBLE_DEVICES": "0,1",
    "SHARDSPEED_LOG_LEVEL": "debug",
    "DS_ACCELERATOR": "cuda",
    "UCX_TLS": "tcp",
    "HOME": "/root",
    "PATH": "/usr/bin",
    "AWS_SECRET_ACCESS_KEY": "secret",
    "GITHUB_TOKEN": "ghp_x",
    "HF_TOKEN": "hf_x",
    "MY_NCCL_THING": "no",
    "LD_LIBRARY_PATH": "/x",
}


def test_allowlist_only(tmp_path) -> None:
    exports = collect_exports(ENVIRON, cwd=str(tmp_path), home=str(tmp_path))
    assert exports == {
        "CUDA_LAUNCH_BLOCKING": "1",
        "DS_ACCELERATOR": "cuda",
        "NCCL_DEBUG": "INFO",
        "NCCL_SOCKET_IFNAME": "eth0",
        "PYTHONHASHSEED": "0",
        "PYTHONPATH": "/opt/code",
        "SHARDSPEED_LOG_LEVEL": "debug",
        "UCX_TLS": "tcp",
    }
    # never credentials, HOME/PATH, or the node-local device list
    for name in (
        "AWS_SECRET_ACCESS_KEY",
        "GITHUB_TOKEN",
        "HF_TOKEN",
        "HOME",
        "PATH",
        "CUDA_VISIBLE_DEVICES",
        "MY_NCCL_THING",
        "LD_LIBRARY_PATH",
    ):
        assert name not in exports


def test_env_files_home_then_cwd(tmp_path) -> None:
    home, cwd = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    cwd.mkdir()
    (home / ".deepspeed_env").write_text("A=home\nB=home\n# comment\n\n")
    (cwd / ".deepspeed_env").write_text("B=cwd\nC='quoted value'\n")
    (cwd / ".shardspeed_env").write_text('export C="from shardspeed"\nNCCL_DEBUG=WARN\n')
    exports = collect_exports({"NCCL_DEBUG": "INFO"}, cwd=str(cwd), home=str(home))
    assert exports == {"NCCL_DEBUG": "WARN", "A": "home", "B": "cwd", "C": "from shardspeed"}


def test_ds_env_file_renames_deepspeed_env(tmp_path) -> None:
    (tmp_path / "custom_env").write_text("X=1\n")
    (tmp_path / ".deepspeed_env").write_text("Y=2\n")
    exports = collect_exports({"DS_ENV_FILE": "custom_env"}, cwd=str(tmp_path), home=str(tmp_path))
    assert exports == {"X": "1"}


@pytest.mark.parametrize(
    ("line", "shown"),
    [("NOEQUALS", "'NOEQUALS'"), ("1BAD=x", "'1BAD=x'"), ("A B=c", "'A B=c'"), ("=v", "'=v'")],
)
def test_env_file_errors(line: str, shown: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_env_file(f"OK=1\n{line}\n", "/w/.deepspeed_env")
    assert str(info.value) == (
        f"env file /w/.deepspeed_env line 2: {shown} is not KEY=VALUE with a shell variable "
        "name as KEY; fix or remove the line"
    )


def test_values_keep_equals_and_spaces() -> None:
    assert parse_env_file("A=b=c\nB = x y \n", "f") == {"A": "b=c", "B": "x y"}


def test_shell_exports_round_trip() -> None:
    values = {"A": "plain", "B": "has space", "C": "it's $HOME; rm -rf /", "D": ""}
    script = shell_exports(values) + 'printf "%s|%s|%s|%s" "$A" "$B" "$C" "$D"'
    out = subprocess.run(["sh", "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout == "plain|has space|it's $HOME; rm -rf /|"
    assert shlex.quote("has space") in shell_exports(values)
