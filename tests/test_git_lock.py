"""The per-user write lock holds on the repository in place. A writer that waited for it
while a forget deleted the repository (under the same lock) gets the forget's answer, not a
path error; one that waited while the repository was deleted and made again (the user
started afresh) holds the new repository's lock, never the deleted one's, which excludes no
one."""

import fcntl
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from durable_memory.memory.core.errors import UnknownUser
from durable_memory.memory.store.bare_repos import discard_tree
from durable_memory.memory.store.git import GitBlockStore
from durable_memory.memory.store.git.locking import LOCK_FILE, user_lock
from durable_memory.models.history import SYSTEM_AUTHOR

BLOCKS = {"notes": 'value = "hello"\n'}


def _is_locked(store: GitBlockStore, user_id: str) -> bool:
    """Whether someone holds the lock file now in the user's repository."""
    fd = os.open(store.repo_path(user_id) / ".git" / LOCK_FILE, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


@contextmanager
def _waiting_transaction(
    store: GitBlockStore, user_id: str, create: bool = False
) -> Iterator[dict[str, object]]:
    """A transaction of `user_id` started in a thread while this holds the user's lock: it
    waits; the body runs (still holding), then the lock is released and the thread's
    outcome is in the dict: "head" and "locked" (whether the file in place was held while it
    ran), or "error"."""
    outcome: dict[str, object] = {}
    entered = threading.Event()

    def run() -> None:
        try:
            entered.set()
            with store.transaction(user_id, create=create) as tx:
                outcome["head"] = tx.head
                outcome["locked"] = _is_locked(store, user_id)
        except Exception as error:  # the outcome asserted on
            outcome["error"] = error

    with user_lock(store.users_dir, user_id):
        thread = threading.Thread(target=run)
        thread.start()
        entered.wait()
        thread.join(0.5)  # it waits for the lock
        assert thread.is_alive()
        yield outcome
    thread.join(30)
    assert not thread.is_alive()


def _make(store: GitBlockStore, user_id: str) -> str:
    with store.transaction(user_id, create=True) as tx:
        return tx.commit(BLOCKS, "Create memory", SYSTEM_AUTHOR, allow_empty=True)


def test_a_writer_that_waited_while_the_repository_was_made_again_locks_the_new_one(
    tmp_path: Path,
) -> None:
    store = GitBlockStore(tmp_path / "data")
    _make(store, "alice")
    with _waiting_transaction(store, "alice") as outcome:
        discard_tree(store.repo_path("alice"))  # the forget's deletion, under the lock
        new_head = _make(store, "alice")  # started afresh: the new repository's own lock
    assert outcome == {"head": new_head, "locked": True}


def test_a_writer_that_waited_while_the_repository_was_deleted_is_told_so(
    tmp_path: Path,
) -> None:
    store = GitBlockStore(tmp_path / "data")
    _make(store, "alice")
    with _waiting_transaction(store, "alice") as outcome:
        discard_tree(store.repo_path("alice"))
    assert isinstance(outcome["error"], UnknownUser)
    assert "any more" in str(outcome["error"])
    assert not store.repo_path("alice").exists()


def test_a_writer_that_may_create_makes_again_what_was_deleted_while_it_waited(
    tmp_path: Path,
) -> None:
    """A user's first turn after they were started afresh (`create`), waiting while a late
    forget step deletes the repository: it makes a new one, empty, and holds its lock."""
    store = GitBlockStore(tmp_path / "data")
    _make(store, "alice")
    with _waiting_transaction(store, "alice", create=True) as outcome:
        discard_tree(store.repo_path("alice"))
    assert outcome == {"head": None, "locked": True}


def test_a_forget_of_a_repository_deleted_meanwhile_deletes_nothing_else(tmp_path: Path) -> None:
    """Two forgets of one user: the second found the repository, then waited for the lock
    while the first deleted it."""
    store = GitBlockStore(tmp_path / "data")
    _make(store, "alice")
    _make(store, "bob")
    with user_lock(store.users_dir, "alice"):
        done: dict[str, int] = {}
        second = threading.Thread(target=lambda: done.update(n=store.forget_user("alice")))
        second.start()
        second.join(0.5)
        assert second.is_alive()
        discard_tree(store.repo_path("alice"))
    second.join(30)
    assert done == {"n": 0}
    assert store.users() == ["bob"]
