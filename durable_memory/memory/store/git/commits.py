"""Writing commits. Every git command that writes runs as a subprocess with settings that make
it safe on an untrusted repository and durable across a power loss (`SAFE_GIT_CONFIG`), and
with the user's lock descriptor passed on to it.

Also the repository as GitPython's `git.Repo` (`RepoOpener`), opened at its first use in a
transaction with those settings: opening one parses its config and sets up its object
database (~0.6 ms, twice a turn), and a transaction that reads only what the snapshot cache
holds (snapshots.py), the usual turn, never needs it: its lock, its crash recovery and its
reads go by the `.git` directory's files. A write, a fetch, a history read or a snapshot not
yet cached opens it; it is closed with the transaction, under its lock."""

import contextlib
import os
import subprocess
from collections.abc import Mapping
from pathlib import Path

import git

from durable_memory.faults import MID_COMMIT, crash_point
from durable_memory.memory.store.git.journal import clear_journal, write_journal
from durable_memory.memory.store.git.layout import (
    block_path,
    open_blocks_dir,
    open_user_dir,
)
from durable_memory.memory.store.git.messages import author_actor
from durable_memory.memory.store.git.refs import read_head
from durable_memory.memory.store.safe_files import write_bytes_at
from durable_memory.models.history import Author

SAFE_GIT_CONFIG = [
    # Object files, the index and refs reach the disk before git names them (git >= 2.36):
    # power lost right after a commit leaves the commit, not an empty object file.
    "core.fsync=objects,index,reference",
    "core.fsyncMethod=fsync",
    # The repository is untrusted input: none of its own settings may run a program.
    "core.hooksPath=/dev/null",
    "core.fsmonitor=false",
    "commit.gpgSign=false",
    # No `gc --auto` after a commit: it would run (or detach) outside the user's lock.
    "gc.auto=0",
    "maintenance.auto=false",
]
_COMMITTER = git.Actor("durable-memory", "durable-memory@localhost")


def git_process(
    *args: str,
    cwd: str | os.PathLike[str] | None,
    lock: int | None,
    stdin: bytes = b"",
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
) -> "subprocess.CompletedProcess[bytes]":
    """Run git with SAFE_GIT_CONFIG, none of our own environment's GIT_* variables, `env`
    added, and the user's lock descriptor passed on (if any); its exit status is the caller's
    to judge. Raises subprocess.TimeoutExpired after `timeout` seconds."""
    command = ["git", *(arg for option in SAFE_GIT_CONFIG for arg in ("-c", option)), *args]
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    return subprocess.run(
        command,
        cwd=cwd,
        input=stdin,
        capture_output=True,
        env={**inherited, **(env or {})},
        pass_fds=() if lock is None else (lock,),
        timeout=timeout,
        check=False,
    )


def run_git(
    repo: git.Repo, lock: int, *args: str, stdin: bytes = b"", env: Mapping[str, str] | None = None
) -> None:
    """A git command that writes to the repository, run with the user's lock descriptor passed
    on: if our process is killed, the git child still running keeps the lock until it exits,
    so the next writer never "recovers" (removes the lock files of) a write still under way."""
    result = git_process(*args, cwd=repo.working_tree_dir, lock=lock, stdin=stdin, env=env)
    if result.returncode != 0:
        raise git.GitCommandError(result.args, result.returncode, result.stderr)


def write_commit(
    repo: git.Repo,
    lock: int,
    users_dir: Path,
    user_id: str,
    head: str | None,
    changed: Mapping[str, str],
    message: str,
    author: Author,
    *,
    records: Mapping[str, str] | None = None,
) -> str:
    """Write the `changed` block files (label -> TOML text), and the changed `records`
    (`profile.toml`, `policies.toml`: name -> text), over HEAD `head` and commit them; return
    the new commit. The caller holds the user's lock and has checked that the working tree and
    the index hold nothing but HEAD for these files. A journal names the files while they are
    written, so recovery can put them back if the process dies before the commit."""
    git_dir = Path(repo.git_dir)
    records = records or {}
    write_journal(git_dir, head, list(changed), list(records))
    with open_blocks_dir(users_dir, user_id, create=True) as blocks:
        for label, text in changed.items():
            write_bytes_at(blocks, f"{label}.toml", text.encode("utf-8"))
    paths = [block_path(label) for label in changed]
    if records:
        with open_user_dir(users_dir, user_id) as top:
            for name, text in records.items():
                write_bytes_at(top, name, text.encode("utf-8"))
        paths.extend(records)
    # `git add` as a subprocess (cwd passed to it): GitPython's IndexFile.add chdirs the
    # whole process, which races with threads committing to other users' repositories.
    if paths:
        run_git(repo, lock, "add", "--", *paths)
    crash_point(MID_COMMIT)
    # `git commit` rather than GitPython's in-process writer: git fsyncs what it writes
    # (`core.fsync`), so a commit that returned survives a power loss.
    actor = author_actor(author)
    identity = {
        "GIT_AUTHOR_NAME": actor.name or "",
        "GIT_AUTHOR_EMAIL": actor.email or "",
        "GIT_COMMITTER_NAME": _COMMITTER.name or "",
        "GIT_COMMITTER_EMAIL": _COMMITTER.email or "",
    }
    run_git(
        repo,
        lock,
        "commit",
        "--quiet",
        "--no-verify",
        "--allow-empty",
        "--cleanup=verbatim",
        "--file=-",
        stdin=message.encode("utf-8"),
        env=identity,
    )
    new = read_head(git_dir)
    assert new is not None, "git commit returned without a commit"
    clear_journal(git_dir)
    return new


class RepoOpener:
    """The repository whose work tree is `work_tree` (its `.git` a directory, checked by the
    caller), opened by the first call and entered on `held`, the transaction's stack."""

    def __init__(self, work_tree: Path, held: contextlib.ExitStack) -> None:
        self.work_tree = work_tree
        self.git_dir = work_tree / ".git"
        self._held = held
        self._repo: git.Repo | None = None

    def __call__(self) -> git.Repo:
        if self._repo is None:
            repo = self._held.enter_context(git.Repo(self.work_tree))
            repo.git.set_persistent_git_options(c=SAFE_GIT_CONFIG)
            self._repo = repo
        return self._repo
