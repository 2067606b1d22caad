"""``shardspeed-report``: what this machine offers shardspeed (DeepSpeed's ``ds_report``).

Versions (shardspeed, torch, Python, CUDA, NCCL), what ``import deepspeed`` gives (shardspeed's
compatibility package, a real DeepSpeed, or nothing), the accelerator with its device count and
memory, the torch.distributed backends built in, the fact that no native op needs building,
``/dev/shm`` size (with a warning below 512 MiB), whether the working directory can do O_DIRECT
I/O for NVMe offload, which optional monitors and launcher programs are installed. ``--json``
prints the same data as one JSON object.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import mmap
import os
import platform
import shutil
import sys
import tempfile
from typing import Any

SHM_PATH = "/dev/shm"
SHM_WARN_BYTES = 512 * 1024**2
O_DIRECT_BLOCK = 4096
MONITOR_PACKAGES = ("tensorboard", "wandb", "comet_ml")
LAUNCHER_PROGRAMS = ("pdsh", "mpirun", "srun", "ssh")
COMM_BACKENDS = ("gloo", "nccl", "mpi", "ucc", "xccl")


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name.replace("_", "-"))
    except importlib.metadata.PackageNotFoundError:
        module = sys.modules.get(name)
        return getattr(module, "__version__", None)


def deepspeed_import_info() -> dict[str, Any]:
    """What ``import deepspeed`` gives: shardspeed's compatibility package, a real DeepSpeed, or
    nothing (found without importing it)."""
    from shardspeed.compat.deepspeed_shim import which_deepspeed

    return which_deepspeed()


def shardspeed_info() -> dict[str, Any]:
    """The installed shardspeed: version, git metadata, install path."""
    import shardspeed

    return {
        "version": shardspeed.__version__,
        "git_hash": shardspeed.__git_hash__,
        "git_branch": shardspeed.__git_branch__,
        "install_path": os.path.dirname(os.path.abspath(shardspeed.__file__)),
    }


def python_info() -> dict[str, Any]:
    """The interpreter and operating system."""
    return {
        "version": platform.python_version(),
        "executable": sys.executable,
        "platform": platform.platform(),
    }


def torch_info() -> dict[str, Any]:
    """torch's version and the CUDA / HIP / NCCL / cuDNN versions it was built with."""
    import torch

    nccl: str | None = None
    if torch.version.cuda and torch.cuda.is_available():
        try:
            raw = torch.cuda.nccl.version()
            nccl = ".".join(map(str, raw)) if isinstance(raw, tuple) else str(raw)
        except (RuntimeError, AttributeError):
            nccl = None
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "version": torch.__version__,
        "install_path": os.path.dirname(os.path.abspath(torch.__file__)),
        "cuda_version": torch.version.cuda,
        "hip_version": getattr(torch.version, "hip", None),
        "nccl_version": nccl,
        "cudnn_version": cudnn,
    }


def accelerator_info() -> dict[str, Any]:
    """The accelerator shardspeed would pick here, its devices and their memory."""
    from shardspeed.accelerator import get_accelerator

    accel = get_accelerator()
    count = accel.device_count()
    devices = []
    for index in range(count):
        try:
            total = int(accel.total_memory(index))
        except (RuntimeError, NotImplementedError, TypeError):
            total = None
        devices.append({"index": index, "total_memory_bytes": total})
    return {
        "name": accel.device_name(),
        "requested": os.environ.get("DS_ACCELERATOR") or "auto-detected",
        "device_count": count,
        "devices": devices,
        "communication_backend": accel.communication_backend_name(),
    }


def comm_backend_info() -> dict[str, bool]:
    """Which torch.distributed backends this torch build includes."""
    from shardspeed.comm import available_backends

    return available_backends(tuple(COMM_BACKENDS))


def native_ops_info() -> dict[str, Any]:
    """shardspeed has no C++/CUDA extensions, so nothing is built or JIT-compiled."""
    return {
        "required": False,
        "note": "pure Python on PyTorch: no C++/CUDA extension is built or JIT-compiled",
    }


def shm_info(path: str = SHM_PATH) -> dict[str, Any]:
    """Size and free space of ``/dev/shm``, with a warning when it is under 512 MiB."""
    try:
        stat = os.statvfs(path)
    except OSError as exc:
        return {
            "path": path,
            "size_bytes": None,
            "free_bytes": None,
            "warning": f"{path} is not available ({exc.strerror})",
        }
    size = stat.f_blocks * stat.f_frsize
    warning = None
    if size < SHM_WARN_BYTES:
        warning = (
            f"{path} is only {size / 1024**2:.0f} MiB; data loader workers and NCCL's shared-"
            "memory transport may fail. If running in docker increase to at least "
            "--shm-size='1gb'"
        )
    return {
        "path": path,
        "size_bytes": size,
        "free_bytes": stat.f_bavail * stat.f_frsize,
        "warning": warning,
    }


def _mount_of(path: str) -> tuple[str | None, str | None]:
    """``(device, filesystem type)`` of the mount holding ``path``, from /proc/mounts."""
    best: tuple[str, str | None, str | None] = ("", None, None)
    try:
        with open("/proc/mounts", encoding="utf-8") as handle:
            for line in handle:
                fields = line.split()
                if len(fields) < 3:
                    continue
                device, mount_point, fs_type = fields[0], fields[1], fields[2]
                inside = path == mount_point or path.startswith(mount_point.rstrip("/") + "/")
                if inside and len(mount_point) > len(best[0]):
                    best = (mount_point, device, fs_type)
    except OSError:
        return None, None
    return best[1], best[2]


def _try_o_direct(directory: str) -> str | None:
    """Write and read back one aligned block with O_DIRECT; ``None`` on success, else why not."""
    flag = getattr(os, "O_DIRECT", None)
    if flag is None:
        return "this OS has no O_DIRECT"
    try:
        fd_tmp, name = tempfile.mkstemp(prefix=".shardspeed_odirect_", dir=directory)
    except OSError as exc:
        return f"cannot create a file here ({exc.strerror})"
    os.close(fd_tmp)
    # an anonymous mapping is page aligned, as O_DIRECT requires of the buffer
    buffer = mmap.mmap(-1, O_DIRECT_BLOCK)
    buffer.write(b"\x5a" * O_DIRECT_BLOCK)
    try:
        fd = os.open(name, os.O_RDWR | flag)
        try:
            os.write(fd, buffer)
            os.lseek(fd, 0, os.SEEK_SET)
            back = mmap.mmap(-1, O_DIRECT_BLOCK)
            os.readv(fd, [back])
            if back[:] != buffer[:]:
                return "data read back differs from data written"
        finally:
            os.close(fd)
    except OSError as exc:
        return f"O_DIRECT I/O failed ({exc.strerror})"
    finally:
        os.remove(name)
    return None


def nvme_info(directory: str | None = None) -> dict[str, Any]:
    """Whether ``directory`` (default: the working directory) suits NVMe offload (O_DIRECT)."""
    directory = os.path.abspath(directory or os.getcwd())
    device, fs_type = _mount_of(directory)
    problem = _try_o_direct(directory)
    return {
        "path": directory,
        "device": device,
        "filesystem": fs_type,
        "on_nvme_device": bool(device and "nvme" in device),
        "o_direct": problem is None,
        "detail": problem or "aligned O_DIRECT write and read succeeded",
    }


def monitor_info() -> dict[str, dict[str, Any]]:
    """Which optional monitoring packages are installed, and their versions."""
    result: dict[str, dict[str, Any]] = {}
    for name in MONITOR_PACKAGES:
        installed = importlib.util.find_spec(name) is not None
        result[name] = {
            "installed": installed,
            "version": _package_version(name) if installed else None,
        }
    return result


def launcher_info() -> dict[str, str | None]:
    """Where the multi-node launcher programs are, if installed."""
    return {name: shutil.which(name) for name in LAUNCHER_PROGRAMS}


def collect_report(directory: str | None = None) -> dict[str, Any]:
    """Every section of the report; a section that fails holds ``{"error": ...}`` instead."""
    sections = {
        "shardspeed": shardspeed_info,
        "deepspeed_import": deepspeed_import_info,
        "python": python_info,
        "torch": torch_info,
        "accelerator": accelerator_info,
        "comm_backends": comm_backend_info,
        "native_ops": native_ops_info,
        "shm": shm_info,
        "nvme": lambda: nvme_info(directory),
        "monitors": monitor_info,
        "launchers": launcher_info,
    }
    report: dict[str, Any] = {}
    warnings: list[str] = []
    for key, probe in sections.items():
        try:
            report[key] = probe()
        except Exception as exc:  # noqa: BLE001 - one broken probe must not hide the rest
            report[key] = {"error": f"{type(exc).__name__}: {exc}"}
            warnings.append(f"{key}: {type(exc).__name__}: {exc}")
    if report["shm"].get("warning"):
        warnings.append(report["shm"]["warning"])
    if report["nvme"].get("o_direct") is False:
        warnings.append(f"NVMe offload: {report['nvme']['path']}: {report['nvme']['detail']}")
    report["warnings"] = warnings
    return report


_TITLES = {
    "comm_backends": "comm backends",
    "native_ops": "native ops",
    "shm": "/dev/shm",
    "nvme": "nvme / O_DIRECT",
    "deepspeed_import": "import deepspeed",
}
_LABELS = {"o_direct": "O_DIRECT", "comet_ml": "comet_ml"}


def _human_bytes(value: float | None) -> str:
    if value is None:
        return "unknown"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def _render_value(key: str, value: Any) -> str:
    if key.endswith("_bytes"):
        return _human_bytes(value)
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, dict) and set(value) == {"installed", "version"}:
        return f"installed {value['version'] or ''}".strip() if value["installed"] else "no"
    return "-" if value is None else str(value)


def _section_rows(section: dict[str, Any]) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    for key, value in section.items():
        if key == "devices":
            # one row per device: "device 0 total memory  80.0 GiB"
            for dev in value:
                memory = _human_bytes(dev.get("total_memory_bytes"))
                rows.append((f"device {dev['index']} total memory", memory))
            continue
        label = _LABELS.get(key) or key.removesuffix("_bytes").replace("_", " ")
        rows.append((label, _render_value(key, value)))
    return rows


def format_report(
    report: dict[str, Any],
    hide_operator_status: bool = False,
    hide_errors_and_warnings: bool = False,
) -> str:
    """The report as an aligned, human-readable table (one block per section)."""
    sections = {
        key: _section_rows(value)
        for key, value in report.items()
        if key != "warnings" and not (hide_operator_status and key == "native_ops")
    }
    width = max(len(label) for rows in sections.values() for label, _ in rows) + 2
    lines = ["shardspeed environment report", "=" * 60]
    for title, rows in sections.items():
        lines.append(f"[{_TITLES.get(title, title)}]")
        lines += [f"  {label:<{width}}{value}" for label, value in rows]
    if not hide_errors_and_warnings and "warnings" in report:
        lines.append("[warnings]")
        lines += [f"  WARNING: {w}" for w in report["warnings"]] or ["  none"]
    return "\n".join(lines)


def main(hide_operator_status: bool = False, hide_errors_and_warnings: bool = False) -> None:
    """Print the human-readable report (DeepSpeed's ``env_report.main``)."""
    print(format_report(collect_report(), hide_operator_status, hide_errors_and_warnings))


def cli_main(argv: list[str] | None = None) -> int:
    """Console entry point of ``shardspeed-report``."""
    parser = argparse.ArgumentParser(
        prog="shardspeed-report", description="Report what this machine offers shardspeed."
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--path", default=None, help="directory to test for O_DIRECT (default: .)")
    parser.add_argument(
        "--hide_operator_status", action="store_true", help="leave out the native-op section"
    )
    parser.add_argument(
        "--hide_errors_and_warnings", action="store_true", help="leave out the warnings"
    )
    args = parser.parse_args(argv)
    report = collect_report(args.path)
    if args.hide_errors_and_warnings:
        report.pop("warnings")
    if args.hide_operator_status:
        report.pop("native_ops")
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=False))
    else:
        print(format_report(report, args.hide_operator_status, args.hide_errors_and_warnings))
    return 0


if __name__ == "__main__":
    sys.exit(cli_main())
