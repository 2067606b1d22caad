"""Version metadata of the installed package.

``__git_hash__`` / ``__git_branch__`` are read from the git checkout the package runs from (an
editable install from a clone), straight from the ``.git`` files (no ``git`` process, no
imports beyond the standard library); an installed wheel has no checkout and says
``"unknown"``.

``__version_major__`` / ``__version_minor__`` / ``__version_patch__`` are DeepSpeed's integer
version parts. They describe the DeepSpeed API level shardspeed stands in for
(:data:`DEEPSPEED_API_VERSION`, the public part of the version the ``deepspeed`` compatibility
package reports), not shardspeed's own release: callers compare them against DeepSpeed releases.
"""

from __future__ import annotations

from pathlib import Path

__version__ = "0.1.0"

DEEPSPEED_API_VERSION = "0.18.2"
"""The DeepSpeed release whose API shardspeed (and its compatibility package) stands in for:
0.18.2, the first Accelerate accepts for ALST sequence parallelism
(``ParallelismConfig(sp_backend="deepspeed")``); AutoTP training needs 0.16.4."""


def _int_parts(version: str) -> tuple[int, int, int]:
    """``"0.16.0"`` -> ``(0, 16, 0)`` (DeepSpeed parses its version into three ints too)."""
    major, minor, patch = (int(part) for part in version.split("+")[0].split(".")[:3])
    return major, minor, patch


__version_major__, __version_minor__, __version_patch__ = _int_parts(DEEPSPEED_API_VERSION)

_UNKNOWN = ("unknown", "unknown")


def _git_dir(root: Path) -> Path | None:
    dot_git = root / ".git"
    if dot_git.is_dir():
        return dot_git
    if dot_git.is_file():  # a worktree or submodule: "gitdir: <path>"
        text = dot_git.read_text().strip()
        if text.startswith("gitdir:"):
            target = Path(text.removeprefix("gitdir:").strip())
            return target if target.is_absolute() else (root / target).resolve()
    return None


def _ref_hash(git_dir: Path, ref: str) -> str | None:
    for folder in (git_dir, _common_dir(git_dir)):
        loose = folder / ref
        if loose.is_file():
            return loose.read_text().strip()
        packed = folder / "packed-refs"
        if packed.is_file():
            for line in packed.read_text().splitlines():
                parts = line.split()
                if len(parts) == 2 and parts[1] == ref:
                    return parts[0]
    return None


def _common_dir(git_dir: Path) -> Path:
    common = git_dir / "commondir"  # worktrees keep refs in the main repository
    return (git_dir / common.read_text().strip()).resolve() if common.is_file() else git_dir


def read_git_info(root: Path) -> tuple[str, str]:
    """(short commit hash, branch) of the checkout at ``root``; ("unknown", "unknown") when
    there is none or it cannot be read. A detached HEAD reports the branch as "HEAD"."""
    try:
        git_dir = _git_dir(root)
        if git_dir is None:
            return _UNKNOWN
        head = (git_dir / "HEAD").read_text().strip()
        if head.startswith("ref:"):
            ref = head.removeprefix("ref:").strip()
            commit = _ref_hash(git_dir, ref)
            branch = ref.removeprefix("refs/heads/")
        else:
            commit, branch = head, "HEAD"
        return (commit[:7], branch) if commit else ("unknown", branch)
    except OSError:
        return _UNKNOWN


__git_hash__, __git_branch__ = read_git_info(Path(__file__).resolve().parent.parent)
