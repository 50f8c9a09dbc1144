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
    that write to pass on (see `commits.run_git`). Closing it releases the flock.

    A lock obtained after waiting may be on a repository that was deleted meanwhile (a forget
    deletes it under this lock), or deleted and made again (the user started afresh): a lock
    file no longer in place excludes no one. So the file locked must be the one in place,
    else it is taken again on the one that is; FileNotFoundError if the repository is gone."""
    while True:
        lock = _open_lock(users_dir, user_id)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            in_place = _is_in_place(users_dir, user_id, lock)
        except BaseException:
            os.close(lock)
            raise
        if in_place:
            break
        os.close(lock)
    try:
        yield lock
    finally:
        os.close(lock)


def _open_lock(users_dir: Path, user_id: str) -> int:
    with open_dir(users_dir, [user_id, ".git"], "users") as git_fd:
        return os.open(
            LOCK_FILE,
            os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o644,
            dir_fd=git_fd,
        )


def _is_in_place(users_dir: Path, user_id: str, lock: int) -> bool:
    try:
        with open_dir(users_dir, [user_id, ".git"], "users") as git_fd:
            placed = os.stat(LOCK_FILE, dir_fd=git_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(lock)
    return (placed.st_dev, placed.st_ino) == (held.st_dev, held.st_ino)
