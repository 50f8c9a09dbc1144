"""What the domain needs from a block repository, whatever keeps it: per-user transactions
that read blocks (and the record naming the user's profile) at HEAD or at a commit, find the
commit that records a decision by its trailer, and commit new block files; and reads of
history. `GitBlockStore` (store/git/) is the
local implementation, `RemoteGitBlockStore` (store/git/remote.py) the distributed one, whose
commits can lose a race to another host: every read-check-write is wrapped in
`compare_and_set`."""

import functools
import random
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from datetime import datetime
from typing import ParamSpec, Protocol, TypeVar

from durable_memory.memory.core.errors import GitRemoteContended
from durable_memory.models.history import Author, CommitInfo


class BlockTransaction(Protocol):
    """One user's blocks while their write lock is held: nothing else commits meanwhile."""

    @property
    def user_id(self) -> str: ...

    @property
    def head(self) -> str | None:
        """The newest commit, None before the first one."""
        ...

    def read(self, label: str, sha: str | None = None) -> str | None:
        """The block's TOML at commit `sha` (default HEAD), None if it does not exist there."""
        ...

    def labels(self) -> list[str]:
        """The labels of the block files at HEAD."""
        ...

    def head_info(self) -> CommitInfo | None:
        """HEAD's commit (who, when, why), None before the first one."""
        ...

    def read_profile(self) -> str | None:
        """HEAD's profile record (the text naming the user's profile), None if it has none."""
        ...

    def read_policies(self) -> str | None:
        """HEAD's standing approvals (the text of the user's policies record), None if none."""
        ...

    def working_copy(self, label: str) -> str | None:
        """The block's file as a person left it in the working tree, None if absent."""
        ...

    def working_files(self) -> list[str]:
        """The names in the working tree's `blocks/` directory."""
        ...

    def find_trailer(self, key: str, value: str, since: datetime | None = None) -> str | None:
        """The newest commit with the trailer `key: value`; `since` bounds the walk: a time
        before the commit can have been made."""
        ...

    def in_history(self, sha: str) -> bool:
        """Whether `sha` is HEAD or one of its ancestors (not merely an object git still
        holds: a commit a rewrite left behind, or one of another branch, is not)."""
        ...

    def commit(
        self,
        files: Mapping[str, str],
        message: str,
        author: Author,
        *,
        allow_empty: bool = False,
        overwrite_hand_edits: bool = False,
        profile: str | None = None,
        policies: str | None = None,
    ) -> str:
        """Commit `files` (label -> TOML text), and `profile` as the profile record and
        `policies` as the standing approvals if given; the new HEAD (HEAD itself if nothing
        changed and not `allow_empty`)."""
        ...


class BlockRepository(Protocol):
    """Every user's blocks and their history."""

    def transaction(
        self, user_id: str, *, create: bool = False
    ) -> AbstractContextManager[BlockTransaction]:
        """Hold the user's write lock (creating the user's memory if `create`)."""
        ...

    def users(self) -> list[str]: ...

    def drop_clones(self, closed: Callable[[list[str]], list[str]]) -> list[str]:
        """Delete this host's cached clones of the users `closed` picks among those it holds
        (none where the repositories are the memory itself); the users dropped."""
        ...

    def pinned(self) -> AbstractContextManager[None]:
        """Within it (on this thread), each user's memory is synchronised with its source of
        truth once; later reads see it as it was then. For the reads of one activity."""
        ...

    def head_info(self, user_id: str) -> CommitInfo | None:
        """The newest commit, None before the first one."""
        ...

    def history(self, user_id: str, label: str | None, limit: int = 20) -> list[CommitInfo]:
        """Newest first: the commits that changed the block (every commit when label is None)."""
        ...

    def read_at(self, user_id: str, label: str, sha: str) -> str: ...

    def diff(self, user_id: str, label: str, a: str, b: str) -> str:
        """Unified diff of the block's TOML between two commits."""
        ...


CAS_ATTEMPTS = 8
"""Read-check-write rounds a writer gets when other hosts keep moving the user's branch."""

P = ParamSpec("P")
R = TypeVar("R")


def compare_and_set(write: Callable[P, R]) -> Callable[P, R]:
    """Run `write` (a read-check-write of one user's memory) again on fresh history while its
    push is refused because another writer moved the branch first; CAS_ATTEMPTS in all, with
    a short random pause between, then the last GitRemoteContended (retryable). With a local
    repository nothing is pushed, so this never repeats anything."""

    @functools.wraps(write)
    def attempts(*args: P.args, **kwargs: P.kwargs) -> R:
        for attempt in range(1, CAS_ATTEMPTS):
            try:
                return write(*args, **kwargs)
            except GitRemoteContended:
                time.sleep(random.uniform(0, 0.02 * attempt))
        return write(*args, **kwargs)

    return attempts
