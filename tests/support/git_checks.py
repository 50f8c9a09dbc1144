"""Checks of a repository's integrity, shared by the git, fault and crash tests."""

import subprocess
from pathlib import Path


def assert_fsck_clean(repo: Path) -> None:
    """`git fsck --strict` finds nothing wrong: no missing, empty or malformed object, no bad
    ref or reflog entry. Dangling objects (a blob staged by a write that was killed) are not
    damage, so they are not reported."""
    result = subprocess.run(
        ["git", "-C", str(repo), "fsck", "--strict", "--no-dangling", "--no-progress"],
        capture_output=True,
        text=True,
        check=False,
    )
    problems = (result.stdout + result.stderr).strip()
    assert not problems, f"git fsck of {repo}:\n{problems}"
    assert result.returncode == 0, f"git fsck of {repo} exited with {result.returncode}"


def git_output(repo: Path, *args: str) -> str:
    """`git -C repo ARGS`'s output, with an identity for commands that commit."""
    return subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=x", "-c", "user.email=x@y", *args],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
