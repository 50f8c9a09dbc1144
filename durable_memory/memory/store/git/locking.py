"""The per-user write lock: an flock on a file inside the user's `.git` directory. Writers for
one user (threads or processes) are serialised by it, so there is no global lock and git's own
`index.lock` is never contended."""

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from durable_memory.memory.store.safe_files import open_dir

LOCK_FILE = "dmem-write.lock"


@contextlib.contextmanager
def user_lock(users_dir: Path, user_id: str) -> Iterator[int]:
    """Hold the user's write lock; yields the descriptor that holds it, for the git commands
    that write to pass on (see `commits.run_git`). Closing it releases the flock."""
    with open_dir(users_dir, [user_id, ".git"], "users") as git_fd:
        lock = os.open(
            LOCK_FILE,
            os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o644,
            dir_fd=git_fd,
        )
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield lock
    finally:
        os.close(lock)
