"""A transaction opens GitPython's `git.Repo` only when it needs git (store/git/commits.py):
the usual turn reads blocks the snapshot cache holds, and its two transactions (the user's
repository checked, the blocks read) each paid ~0.6 ms to open one for nothing. Counted, not
timed: a warm read opens none; a write, a history read, a cold cache and the recovery of an
interrupted write each open one, and the recovery still repairs."""

import collections
from collections.abc import Iterator
from pathlib import Path

import pytest

from durable_memory.bootstrap import MemoryStack, open_stack
from durable_memory.memory.store.git import commits
from durable_memory.memory.store.git.layout import block_path
from durable_memory.memory.store.git.locking import LOCK_FILE
from durable_memory.models.history import Author, AuthorKind
from durable_memory.models.operations import AddContext

ALICE = Author(name="alice", kind=AuthorKind.USER)


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[MemoryStack]:
    stack = open_stack(tmp_path / "data", profile="default")
    stack.blocks.ensure_user("alice")
    yield stack
    stack.close()


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> collections.Counter[str]:
    """How many repositories were opened, by work tree."""
    counts: collections.Counter[str] = collections.Counter()
    real = commits.RepoOpener.__call__

    def counting(self: commits.RepoOpener) -> object:
        if self._repo is None:
            counts[self.work_tree.name] += 1
        return real(self)

    monkeypatch.setattr(commits.RepoOpener, "__call__", counting)
    return counts


def test_a_warm_read_opens_no_repository(
    stack: MemoryStack, opened: collections.Counter[str]
) -> None:
    stack.blocks.read_blocks("alice")  # fills the snapshot cache
    opened.clear()
    for _ in range(3):
        admitted = stack.blocks.admit("alice")
        blocks = stack.blocks.read_blocks_and_base("alice", admitted.head).head
        assert blocks["human"].sha == admitted.head
    assert opened == {}


def test_writes_history_and_a_cold_cache_open_it(
    stack: MemoryStack, opened: collections.Counter[str]
) -> None:
    stack.edits.apply_direct("alice", "human", AddContext(note="prefers mornings"), ALICE)
    assert opened["alice"] >= 1  # the commit
    opened.clear()
    assert stack.git.history("alice", "human")
    assert opened["alice"] == 1
    opened.clear()
    stack.git.cache.forget("alice")
    stack.blocks.read_blocks("alice")
    assert opened["alice"] == 1


def test_an_interrupted_write_is_still_repaired(
    stack: MemoryStack, opened: collections.Counter[str]
) -> None:
    stack.blocks.read_blocks("alice")
    repo = stack.git.repo_path("alice")
    # What a git process killed mid-write leaves: its lock file, and a block file changed in
    # the work tree that no commit holds.
    (repo / ".git" / "index.lock").write_bytes(b"")
    (repo / block_path("human")).write_text("half written", encoding="utf-8")
    opened.clear()
    blocks = stack.blocks.read_blocks("alice")
    assert opened["alice"] == 1  # recovery opened it to check HEAD's history
    assert not (repo / ".git" / "index.lock").exists()
    assert (repo / ".git" / LOCK_FILE).exists()  # ours, not a stale git lock
    assert blocks["human"].sha is not None
    assert "half written" not in str(blocks["human"].fields)  # the commit's, not the file's
