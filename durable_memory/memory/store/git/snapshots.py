"""What one commit holds, read from git objects once and cached: a commit never changes, so
its block files are kept in memory by (user, sha), and a turn that finds HEAD in the cache
reads no git object at all."""

import logging
import stat
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import git
from git.objects.base import IndexObject

from durable_memory.memory.core.errors import UnsafeFile
from durable_memory.memory.store.git.layout import (
    BLOCKS_DIR,
    PROFILE_FILE,
    RECORD_FILES,
    block_label,
)
from durable_memory.memory.store.git.messages import commit_info
from durable_memory.memory.store.safe_files import MAX_FILE_BYTES, decode_utf8, kind_of
from durable_memory.models.history import CommitInfo

log = logging.getLogger(__name__)

CACHED_COMMITS = 1024
"""Commits whose block files the cache keeps: a few KB each, so a few MB in all."""
UNREADABLE_OBJECT = (ValueError, git.GitError, git.ODBError, zlib.error)
"""What GitPython raises when an object is missing or corrupt (ValueError: `cat-file` says
"missing"), as opposed to our own refusals of what a readable object holds."""


@dataclass(frozen=True)
class Snapshot:
    """What one commit holds: its block files (label -> TOML text), its records
    (`profile.toml`, `policies.toml`: name -> text, absent if it has none) and who made it.

    `refused` names what under `blocks/` (or a record) was not read, and why: a symlink
    or a submodule committed in place of a file, text that is not UTF-8, a file that is not
    `<label>.toml`."""

    blocks: Mapping[str, str]
    info: CommitInfo
    refused: Mapping[str, str] = field(default_factory=dict)
    records: Mapping[str, str] = field(default_factory=dict)

    @property
    def profile(self) -> str | None:
        """The profile record, None if the commit has none."""
        return self.records.get(PROFILE_FILE)


class SnapshotCache:
    """Snapshots by (user, commit sha), least recently used out first; thread-safe."""

    def __init__(self, size: int = CACHED_COMMITS) -> None:
        self.size = size
        self._entries: OrderedDict[tuple[str, str], Snapshot] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, user_id: str, sha: str) -> Snapshot | None:
        with self._lock:
            found = self._entries.get((user_id, sha))
            if found is not None:
                self._entries.move_to_end((user_id, sha))
            return found

    def put(self, user_id: str, sha: str, snapshot: Snapshot) -> None:
        with self._lock:
            self._entries[(user_id, sha)] = snapshot
            self._entries.move_to_end((user_id, sha))
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)

    def forget(self, user_id: str) -> None:
        """Drop every snapshot of the user (their memory is being erased)."""
        with self._lock:
            for key in [key for key in self._entries if key[0] == user_id]:
                del self._entries[key]


def _read_tree_blocks(commit: git.Commit) -> tuple[dict[str, str], dict[str, str]]:
    """The block files of a commit and the entries under `blocks/` that are refused."""
    blocks: dict[str, str] = {}
    refused: dict[str, str] = {}
    try:
        entry = commit.tree / BLOCKS_DIR
    except KeyError:
        return blocks, refused
    if not isinstance(entry, git.Tree):
        refused[BLOCKS_DIR] = f"{_entry_kind(entry.mode)}, not a directory"
        return blocks, refused
    for item in entry:
        name = str(item.path).rsplit("/", 1)[-1]  # a submodule has no `name` without a .gitmodules
        path = f"{BLOCKS_DIR}/{name}"
        label = block_label(name)
        if label is None and isinstance(item, git.Blob) and stat.S_ISREG(item.mode):
            refused[path] = "not a block file (blocks/<label>.toml)"
            continue
        text = _read_file(item, path, refused)
        if text is not None and label is not None:
            blocks[label] = text
    return blocks, refused


def _read_file(item: IndexObject, path: str, refused: dict[str, str]) -> str | None:
    """The text of a committed regular file; else None, with the reason in `refused`."""
    if not isinstance(item, git.Blob) or not stat.S_ISREG(item.mode):
        refused[path] = f"{_entry_kind(item.mode)}, not a regular file"
    elif item.size > MAX_FILE_BYTES:
        refused[path] = f"{item.size} bytes, over {MAX_FILE_BYTES}"
    else:
        try:
            return decode_utf8(item.data_stream.read(), path)
        except UnsafeFile:
            refused[path] = "not valid UTF-8"
    return None


def _read_records(commit: git.Commit, refused: dict[str, str]) -> dict[str, str]:
    """The commit's records (name -> text); one it lacks, or that is refused (see `refused`),
    is absent."""
    records: dict[str, str] = {}
    for name in RECORD_FILES:
        try:
            entry = commit.tree / name
        except KeyError:
            continue
        text = _read_file(entry, name, refused)
        if text is not None:
            records[name] = text
    return records


def _entry_kind(mode: int) -> str:
    if stat.S_IFMT(mode) == 0o160000:  # a gitlink: no file type of the OS has this mode
        return "a submodule"
    return kind_of(mode)


def load_snapshot(
    repo: Callable[[], git.Repo], user_id: str, sha: str, cache: SnapshotCache
) -> Snapshot:
    """The snapshot of commit `sha` (a full id), from the cache or else from git's objects:
    `repo` opens the repository (commits.RepoOpener), which a cached commit never needs."""
    found = cache.get(user_id, sha)
    if found is None:
        commit = repo().commit(sha)
        blocks, refused = _read_tree_blocks(commit)
        records = _read_records(commit, refused)
        for path, why in refused.items():
            log.warning("user '%s': commit %s: %s is %s: not read", user_id, sha[:12], path, why)
        found = Snapshot(blocks=blocks, info=commit_info(commit), refused=refused, records=records)
        cache.put(user_id, sha, found)
    return found
