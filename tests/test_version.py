"""The git commit and branch the package reports (startup log, shardspeed-report, DeepSpeed's
git_version_info) come from the checkout it runs from, not "unknown"."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

import shardspeed
from shardspeed.version import read_git_info

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(
    not (REPO / ".git").exists() or shutil.which("git") is None, reason="not a git checkout"
)
def test_an_editable_install_reports_its_checkout():
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()

    assert shardspeed.__git_hash__ == git("rev-parse", "--short=7", "HEAD")
    assert shardspeed.__git_branch__ == git("rev-parse", "--abbrev-ref", "HEAD")


def test_packed_refs_detached_head_worktree_and_no_checkout(tmp_path: Path):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "repo"
    (repo / ".git").mkdir(parents=True)
    (repo / ".git" / "HEAD").write_text("ref: refs/heads/feature/x\n")
    (repo / ".git" / "packed-refs").write_text(f"# pack-refs\n{commit} refs/heads/feature/x\n")
    assert read_git_info(repo) == ("0123456", "feature/x")
    (repo / ".git" / "HEAD").write_text(commit + "\n")
    assert read_git_info(repo) == ("0123456", "HEAD")
    # a worktree: .git is a file naming its git dir, whose refs live in the main repository
    worktree_git = repo / ".git" / "worktrees" / "wt"
    worktree_git.mkdir(parents=True)
    (worktree_git / "HEAD").write_text("ref: refs/heads/feature/x\n")
    (worktree_git / "commondir").write_text("../..\n")
    (tmp_path / "wt").mkdir()
    (tmp_path / "wt" / ".git").write_text(f"gitdir: {worktree_git}\n")
    assert read_git_info(tmp_path / "wt") == ("0123456", "feature/x")
    assert read_git_info(tmp_path / "nothing") == ("unknown", "unknown")
