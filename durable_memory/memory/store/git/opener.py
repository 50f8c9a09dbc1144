"""A user's repository as GitPython's `git.Repo`, opened at its first use in a transaction.

Opening one parses the repository's config and sets up its object database: ~0.6 ms, twice a
turn (the repository checked, then the blocks read), and a transaction that reads only what
the snapshot cache holds (snapshots.py), the usual turn, never needs it: its lock, its crash
recovery and its reads go by the `.git` directory's files. A write, a fetch, a history read
or a snapshot not yet cached opens it; it is closed with the transaction, under its lock."""

import contextlib
from pathlib import Path

import git

from durable_memory.memory.store.git.commits import SAFE_GIT_CONFIG


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
