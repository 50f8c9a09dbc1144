"""`GitBlockStore`: one git repository per user under `<data_dir>/users/`, holding
`blocks/<label>.toml`; every change is a commit. A transaction holds the user's lock
(locking.py), repairs what a crash left (recovery.py) and then reads and commits
(transaction.py). It is the `BlockRepository` (store/block_repository.py) of the domain."""

import contextlib
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import git

from durable_memory.memory.core.errors import (
    DurableMemoryError,
    StoreBusy,
    UnknownCommit,
    UnknownUser,
    UnsafeFile,
)
from durable_memory.memory.core.ids import validate_sha, validate_user_id
from durable_memory.memory.store.bare_repos import discard_tree
from durable_memory.memory.store.git.commits import RepoOpener
from durable_memory.memory.store.git.layout import block_path
from durable_memory.memory.store.git.locking import user_lock
from durable_memory.memory.store.git.messages import commit_info
from durable_memory.memory.store.git.recovery import recover
from durable_memory.memory.store.git.snapshots import SnapshotCache
from durable_memory.memory.store.git.transaction import RepoTransaction
from durable_memory.memory.store.redaction.history import move_main, purge
from durable_memory.memory.store.safe_files import kind_of
from durable_memory.models.history import CommitInfo

log = logging.getLogger(__name__)

HOLD_ATTEMPTS = 3
"""How many times a transaction takes the user's lock on a repository deleted (and perhaps
made again) while it waited, before it gives up (StoreBusy, retried)."""


class GitBlockStore:
    """The users' repositories under `<data_dir>/users/`."""

    def __init__(self, data_dir: str | Path, cache: SnapshotCache | None = None) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.users_dir = self.data_dir / "users"
        self.cache = cache or SnapshotCache()

    def repo_path(self, user_id: str) -> Path:
        # Not resolved: `users/<id>` may be a symlink, which `_is_repository` refuses rather
        # than follows (the user id pattern already forbids '/', '.' first and '..').
        return self.users_dir / validate_user_id(user_id)

    def _is_repository(self, user_id: str) -> bool:
        """Whether `users/<id>` holds a repository; a symlink or a file in place of the user's
        directory or of its `.git` (a `gitdir:` link elsewhere) is refused, never followed."""
        path = self.repo_path(user_id)
        for where, shown in ((path, f"users/{user_id}"), (path / ".git", f"users/{user_id}/.git")):
            try:
                mode = where.lstat().st_mode
            except FileNotFoundError:
                return False
            if not stat.S_ISDIR(mode):
                raise UnsafeFile(
                    f"{shown} is {kind_of(mode)}, not a directory: refused, nothing was read "
                    "from it"
                )
        return True

    def exists(self, user_id: str) -> bool:
        return self._is_repository(user_id)

    def users(self) -> list[str]:
        if not self.users_dir.is_dir():
            return []
        found = []
        for name in sorted(os.listdir(self.users_dir)):
            if name.startswith("."):  # a repository being created
                continue
            try:
                if self._is_repository(name):
                    found.append(name)
            except DurableMemoryError as error:  # an invalid name or an unsafe directory
                log.warning("skipping users/%s: %s", name, error)
        return found

    def drop_clones(self, closed: Callable[[list[str]], list[str]]) -> list[str]:  # noqa: ARG002
        """Nothing: this host's repositories are the users' memory, not clones of it (a
        forget deletes them in its own step)."""
        return []

    def _create(self, user_id: str) -> None:
        """`git init` in a directory beside the user's, then rename it into place: no process
        ever opens a half-initialised repository. Of two creators racing, the second's rename
        fails (the directory is no longer empty) and it discards its copy."""
        path = self.repo_path(user_id)
        self.users_dir.mkdir(parents=True, exist_ok=True)
        fresh = Path(tempfile.mkdtemp(prefix=f".init-{path.name}-", dir=self.users_dir))
        try:
            git.Repo.init(fresh, initial_branch="main").close()
            try:
                os.rename(fresh, path)
            except OSError:
                if not self._is_repository(user_id):
                    raise DurableMemoryError(
                        f"cannot create the memory of user '{path.name}': {path} exists and is "
                        "not a git repository"
                    ) from None
        finally:
            shutil.rmtree(fresh, ignore_errors=True)

    def forget_user(self, user_id: str) -> int:
        """Delete the user's repository from this host's disk, every version with it (1 if
        there was one, else 0); idempotent. Taken out of place under the user's lock, so no
        writer of ours on this host is mid-commit in it; then deleted."""
        path = self.repo_path(user_id)
        self.cache.forget(user_id)
        try:
            present = self._is_repository(user_id)
        except UnsafeFile:  # a symlink or a file in its place: removed, never followed
            present = False
        if present:
            # Gone meanwhile (another forget's deletion): nothing to lock.
            with contextlib.suppress(FileNotFoundError), user_lock(self.users_dir, user_id):
                return int(discard_tree(path))
        return int(discard_tree(path))

    def replace_history(self, tx: RepoTransaction, old: str, new: str) -> None:
        """Move main from `old` to the rewritten history `new` (compare-and-swap) and drop
        every object of the old one (`dmem redact`, store/redaction/history.py)."""
        move_main(tx.repo, tx.lock, new, old)
        self.purge_history(tx)

    def purge_history(self, tx: RepoTransaction) -> None:
        """Drop what is unreachable from main, here and in memory (idempotent)."""
        self.cache.forget(tx.user_id)
        purge(tx.repo, tx.lock, extra_refs=("ORIG_HEAD",))

    @contextlib.contextmanager
    def pinned(self) -> Iterator[None]:
        """One activity's reads in one state of memory: with local repositories, nothing to
        do (see RemoteGitBlockStore.pinned)."""
        yield

    @contextlib.contextmanager
    def transaction(self, user_id: str, *, create: bool = False) -> Iterator[RepoTransaction]:
        """Hold the user's write lock; recover from a write interrupted by a crash."""
        with contextlib.ExitStack() as held:
            opener, lock, head = self._hold(held, user_id, create)
            yield RepoTransaction(
                open_repo=opener,
                lock=lock,
                user_id=user_id,
                users_dir=self.users_dir,
                head=head,
                cache=self.cache,
            )

    def _hold(
        self, held: contextlib.ExitStack, user_id: str, create: bool
    ) -> tuple[RepoOpener, int, str | None]:
        """The user's repository under their lock, repaired after any crash (entered on
        `held`): the repository (opened at its first use), the lock's descriptor and HEAD
        (verified readable). A missing one is `_make`'s to make or refuse, also when it is
        deleted while this waits for its lock (a forget), a bounded number of times."""
        gone = False
        for _ in range(HOLD_ATTEMPTS):
            if not self._is_repository(user_id):
                self._make(user_id, create, gone)
            try:
                lock = held.enter_context(user_lock(self.users_dir, user_id))
            except FileNotFoundError:  # deleted while this waited for its lock
                gone = True
                continue
            opener = RepoOpener(self.repo_path(user_id), held)
            return opener, lock, recover(opener, lock, self.users_dir, user_id, self.cache)
        raise StoreBusy(
            f"the repository of user '{user_id}' was deleted {HOLD_ATTEMPTS} times while this "
            "waited for it; try again"
        )

    def _make(self, user_id: str, create: bool, gone: bool) -> None:
        """A missing repository: made if the transaction may create it, else UnknownUser
        (`gone`: it was there when this began to wait for it)."""
        if not create:
            raise UnknownUser(f"user '{user_id}' has no memory {'any more' if gone else 'yet'}")
        self._create(user_id)

    def head(self, user_id: str) -> str | None:
        with self.transaction(user_id) as tx:
            return tx.head

    def head_info(self, user_id: str) -> CommitInfo | None:
        """The newest commit, read from HEAD (no history walk)."""
        with self.transaction(user_id) as tx:
            return tx.head_info()

    def history(self, user_id: str, label: str | None, limit: int = 20) -> list[CommitInfo]:
        """Newest first: the commits that changed the block (every commit when label is None)."""
        if limit <= 0:
            raise DurableMemoryError(f"history limit must be positive, got {limit}")
        paths = block_path(label) if label is not None else ""
        with self.transaction(user_id) as tx:
            if tx.head is None:
                return []
            commits = tx.repo.iter_commits("HEAD", paths=paths, max_count=limit)
            return [commit_info(c) for c in commits]

    def _resolve(self, tx: RepoTransaction, sha: str) -> git.Commit:
        validate_sha(sha)
        return tx.repo.commit(tx.commit_id(sha))

    def read_at(self, user_id: str, label: str, sha: str) -> str:
        with self.transaction(user_id) as tx:
            commit = self._resolve(tx, sha)
            text = tx.read(label, commit.hexsha)
            if text is None:
                raise UnknownCommit(f"block '{label}' does not exist at commit {sha}")
            return text

    def diff(self, user_id: str, label: str, a: str, b: str) -> str:
        """Unified diff of the block's TOML between two commits."""
        with self.transaction(user_id) as tx:
            first, second = self._resolve(tx, a), self._resolve(tx, b)
            out: str = tx.repo.git.diff(first.hexsha, second.hexsha, "--", block_path(label))
            return out
