"""One git repository per user, holding `blocks/<label>.toml`. Every change is a commit.

Writers for one user (threads or processes) are serialised by an flock on a file inside the
user's `.git` directory, so there is no global lock and git's own `index.lock` is never
contended. Reads come from the HEAD commit, never from the working tree, so a half-written
or hand-edited file cannot leak into memory: hand edits are committed only through
`commit_hand_edits`, which validates them first.

A commit never changes, so the block files of a commit are cached in memory by (user, sha):
a turn resolves HEAD from the ref files (no git process) and finds its blocks in the cache.
Only a commit this process has not seen (made by another worker or by hand) costs a read
of git objects.
"""

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import git

from durable_memory.faults import MID_COMMIT, crash_point
from durable_memory.memory.errors import (
    DurableMemoryError,
    HandEditPending,
    UnknownCommit,
    UnknownUser,
)
from durable_memory.memory.ids import validate_label, validate_sha, validate_user_id
from durable_memory.models.history import Author, AuthorKind, CommitInfo

BLOCKS_DIR = "blocks"
_LOCK_FILE = "dmem-write.lock"
_JOURNAL_FILE = "dmem-journal"
_AUTHOR_NAME = re.compile(r"[^\x00-\x1f\x7f<>]{1,100}")
_TRAILER_KEY = re.compile(r"[A-Z][A-Za-z-]{0,39}")
_COMMITTER = git.Actor("durable-memory", "durable-memory@localhost")
_FULL_SHA = re.compile(r"[0-9a-f]{40}")
CACHED_COMMITS = 1024
"""Commits whose block files the cache keeps: a few KB each, so a few MB in all."""
CLOCK_SKEW = timedelta(hours=1)
"""How far apart two machines' clocks may be when one bounds a history walk by the other's
timestamp (see `find_trailer`)."""


def validate_author_name(name: object) -> str:
    """Names go into commit identities: 1-100 characters, no control characters, no '<' '>'."""
    if not isinstance(name, str) or not _AUTHOR_NAME.fullmatch(name) or name != name.strip():
        raise DurableMemoryError(
            f"invalid name {name!r:.60}: use 1-100 characters without control characters, "
            "'<', '>' or surrounding spaces"
        )
    return name


def block_path(label: str) -> str:
    return f"{BLOCKS_DIR}/{validate_label(label)}.toml"


def _one_line(value: str) -> str:
    return " ".join(value.split())


def format_message(summary: str, body: str = "", trailers: Mapping[str, str] | None = None) -> str:
    """A commit message: summary line, optional body, then `Key: value` trailers."""
    parts = [_one_line(summary)[:200] or "Update memory"]
    if body.strip():
        parts.append(body.strip())
    if trailers:
        for key in trailers:
            if not _TRAILER_KEY.fullmatch(key):
                raise ValueError(f"bad trailer key {key!r}")
        parts.append("\n".join(f"{k}: {_one_line(v)}" for k, v in trailers.items() if v))
    return "\n\n".join(parts) + "\n"


def _actor(author: Author) -> git.Actor:
    slug = re.sub(r"[^a-z0-9]+", "-", author.name.lower()).strip("-") or "someone"
    return git.Actor(validate_author_name(author.name), f"{author.kind.value}+{slug}@localhost")


def _parse_trailers(message: str) -> dict[str, str]:
    paragraphs = message.strip().split("\n\n")
    if len(paragraphs) < 2:
        return {}
    found: dict[str, str] = {}
    for line in paragraphs[-1].splitlines():
        key, sep, value = line.partition(": ")
        if not sep or not _TRAILER_KEY.fullmatch(key):
            return {}
        found[key] = value
    return found


def _message_str(commit: git.Commit) -> str:
    message = commit.message
    return message if isinstance(message, str) else message.decode("utf-8", errors="replace")


def _commit_info(commit: git.Commit) -> CommitInfo:
    email = commit.author.email or ""
    kind = email.split("+", 1)[0] if "+" in email else AuthorKind.SYSTEM.value
    message = _message_str(commit)
    return CommitInfo(
        sha=commit.hexsha,
        message=message.strip(),
        author=commit.author.name or "",
        author_kind=kind,
        timestamp=commit.authored_datetime.astimezone(UTC),
        trailers=_parse_trailers(message),
    )


@dataclass(frozen=True)
class Snapshot:
    """What one commit holds: its block files (label -> TOML text) and who made it."""

    blocks: Mapping[str, str]
    info: CommitInfo


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


def _blob_sha(text: str) -> bytes:
    """The id git gives a file with this content (what the index stores for it)."""
    data = text.encode("utf-8")
    return hashlib.sha1(b"blob %d\x00" % len(data) + data, usedforsecurity=False).digest()


def _head_sha(repo: git.Repo) -> str | None:
    """HEAD's commit, from the ref files alone (GitPython's repo.head asks a git process)."""
    try:
        return git.SymbolicReference.dereference_recursive(repo, "HEAD")
    except ValueError:  # an unborn branch: a repository without commits
        return None


@dataclass
class RepoTransaction:
    """Read-modify-write access to one user's repository while holding its lock."""

    repo: git.Repo
    user_id: str
    cache: SnapshotCache = field(default_factory=SnapshotCache)

    def __post_init__(self) -> None:
        # Nothing else writes while we hold the lock, so HEAD is read once per transaction.
        self._head = _head_sha(self.repo)

    @property
    def head(self) -> str | None:
        return self._head

    def snapshot(self, sha: str) -> Snapshot:
        """The commit's block files and author (cached); `sha` must be a full commit id."""
        found = self.cache.get(self.user_id, sha)
        if found is None:
            commit = self.repo.commit(sha)
            try:
                blobs = (commit.tree / BLOCKS_DIR).blobs
            except KeyError:
                blobs = []
            blocks = {
                b.name.removesuffix(".toml"): b.data_stream.read().decode("utf-8")
                for b in blobs
                if b.name.endswith(".toml")
            }
            found = Snapshot(blocks=blocks, info=_commit_info(commit))
            self.cache.put(self.user_id, sha, found)
        return found

    def read(self, label: str, sha: str | None = None) -> str | None:
        """The block file at `sha` (default HEAD), or None if it does not exist there."""
        validate_label(label)
        rev = sha or self.head
        if rev is None:
            return None
        if not _FULL_SHA.fullmatch(rev):
            rev = self.repo.commit(rev).hexsha
        return self.snapshot(rev).blocks.get(label)

    def labels(self) -> list[str]:
        return sorted(self.snapshot(self.head).blocks) if self.head else []

    def head_info(self) -> CommitInfo | None:
        return self.snapshot(self.head).info if self.head else None

    def working_copy(self, label: str) -> str | None:
        path = Path(self.repo.working_tree_dir or "") / block_path(label)
        try:
            return path.read_bytes().decode("utf-8", errors="replace")
        except FileNotFoundError:
            return None

    def find_trailer(self, key: str, value: str, since: datetime | None = None) -> str | None:
        """The newest commit whose message has the trailer `key: value` (e.g. a Diff-Id).

        With `since` (a time before the commit can have been made, e.g. the decision it
        records), the walk stops at older commits, so its cost does not grow with history.
        """
        if self.head is None:
            return None
        line = f"{key}: {value}"
        bound = []
        if since is not None:
            start = (since.astimezone(UTC) - CLOCK_SKEW).strftime("%Y-%m-%d %H:%M:%S +0000")
            bound = [f"--since={start}"]
        out: str = self.repo.git.log(
            "HEAD", *bound, "--fixed-strings", f"--grep={line}", "--format=%H"
        )
        for sha in out.split():
            if _parse_trailers(_message_str(self.repo.commit(sha))).get(key) == value:
                return sha
        return None

    def _staged_by_hand(self, head: Mapping[str, str]) -> list[str]:
        """Block files whose staged content is not HEAD's (`head`): someone ran `git add` by
        hand. Committing now would carry that unvalidated content into memory with ours."""
        expected = {f"{BLOCKS_DIR}/{label}.toml": _blob_sha(text) for label, text in head.items()}
        staged = {
            str(path): entry.binsha
            for (path, _stage), entry in self.repo.index.entries.items()
            if str(path).startswith(f"{BLOCKS_DIR}/") and str(path).endswith(".toml")
        }
        return sorted(
            p for p in expected.keys() | staged.keys() if expected.get(p) != staged.get(p)
        )

    def commit(
        self,
        files: Mapping[str, str],
        message: str,
        author: Author,
        *,
        allow_empty: bool = False,
        overwrite_hand_edits: bool = False,
    ) -> str:
        """Write `files` (label -> TOML text) and commit them. Returns the new commit sha.

        A change that alters nothing returns HEAD without a commit unless `allow_empty`.
        """
        changed = {label: text for label, text in files.items() if self.read(label) != text}
        if not changed and not allow_empty and self.head is not None:
            return self.head
        for label in () if overwrite_hand_edits else changed:
            on_disk = self.working_copy(label)
            if on_disk is not None and on_disk != self.read(label):
                raise HandEditPending(
                    f"{block_path(label)} of user '{self.user_id}' has changes made by hand that "
                    "are not committed; commit them with `dmem import` (validated) or discard "
                    "them with `git checkout`, then try again"
                )
        before = self.snapshot(self.head).blocks if self.head else {}
        staged = self._staged_by_hand(before)
        if staged:
            raise HandEditPending(
                f"{', '.join(staged)} of user '{self.user_id}' has changes staged by hand "
                "(git add) that are not committed; commit them with `dmem import` (validated) "
                "or unstage them with `git reset`, then try again"
            )
        git_dir = Path(self.repo.git_dir)
        journal = git_dir / _JOURNAL_FILE
        journal.write_text("\n".join(changed), encoding="utf-8")
        root = Path(self.repo.working_tree_dir or "")
        (root / BLOCKS_DIR).mkdir(exist_ok=True)
        for label, text in changed.items():
            target = root / block_path(label)
            tmp = target.with_suffix(".toml.tmp")
            tmp.write_text(text, encoding="utf-8", newline="")
            os.replace(tmp, target)
        # `git add` as a subprocess (cwd passed to it): GitPython's IndexFile.add chdirs the
        # whole process, which races with threads committing to other users' repositories.
        self.repo.git.add("--", *(block_path(label) for label in changed))
        crash_point(MID_COMMIT)
        actor = _actor(author)
        new = self.repo.index.commit(
            message,
            author=actor,
            committer=_COMMITTER,
            parent_commits=None,
            skip_hooks=True,
        )
        journal.unlink()
        # The index held HEAD plus our files (checked above), so this is the new commit.
        self._head = new.hexsha
        self.cache.put(
            self.user_id,
            new.hexsha,
            Snapshot(blocks={**before, **changed}, info=_commit_info(new)),
        )
        return self._head


class GitBlockStore:
    """The users' repositories under `<data_dir>/users/`."""

    def __init__(self, data_dir: str | Path, cache: SnapshotCache | None = None) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.users_dir = self.data_dir / "users"
        self.cache = cache or SnapshotCache()

    def repo_path(self, user_id: str) -> Path:
        path = (self.users_dir / validate_user_id(user_id)).resolve()
        if path.parent != self.users_dir:  # belt and braces: the pattern already forbids this
            raise DurableMemoryError(f"user id {user_id!r} escapes the data directory")
        return path

    def exists(self, user_id: str) -> bool:
        return (self.repo_path(user_id) / ".git").is_dir()

    def users(self) -> list[str]:
        if not self.users_dir.is_dir():
            return []
        return sorted(
            p.name
            for p in self.users_dir.iterdir()
            if (p / ".git").is_dir() and not p.name.startswith(".")  # not a repo being created
        )

    def _create(self, path: Path) -> None:
        """`git init` in a directory beside the user's, then rename it into place: no process
        ever opens a half-initialised repository. Of two creators racing, the second's rename
        fails (the directory is no longer empty) and it discards its copy."""
        self.users_dir.mkdir(parents=True, exist_ok=True)
        fresh = Path(tempfile.mkdtemp(prefix=f".init-{path.name}-", dir=self.users_dir))
        try:
            git.Repo.init(fresh, initial_branch="main").close()
            try:
                os.rename(fresh, path)
            except OSError:
                if not (path / ".git").is_dir():
                    raise DurableMemoryError(
                        f"cannot create the memory of user '{path.name}': {path} exists and is "
                        "not a git repository"
                    ) from None
        finally:
            shutil.rmtree(fresh, ignore_errors=True)

    @contextlib.contextmanager
    def transaction(self, user_id: str, *, create: bool = False) -> Iterator[RepoTransaction]:
        """Hold the user's write lock; recover from a write interrupted by a crash."""
        path = self.repo_path(user_id)
        if not (path / ".git").is_dir():
            if not create:
                raise UnknownUser(f"user '{user_id}' has no memory yet")
            self._create(path)
        with open(path / ".git" / _LOCK_FILE, "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                with git.Repo(path) as repo:
                    self._recover(repo)
                    yield RepoTransaction(repo=repo, user_id=user_id, cache=self.cache)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    @staticmethod
    def _recover(repo: git.Repo) -> None:
        """Undo the working-tree half of a write that crashed before or after its commit."""
        journal = Path(repo.git_dir) / _JOURNAL_FILE
        if not journal.exists():
            return
        labels = [line for line in journal.read_text(encoding="utf-8").split("\n") if line]
        root = Path(repo.working_tree_dir or "")
        for label in labels:
            target = root / block_path(label)
            target.with_suffix(".toml.tmp").unlink(missing_ok=True)
            if repo.head.is_valid():
                try:
                    blob = repo.head.commit.tree / block_path(label)
                    target.write_bytes(blob.data_stream.read())
                    continue
                except KeyError:
                    pass
            target.unlink(missing_ok=True)
        if repo.head.is_valid():
            repo.index.reset(paths=[block_path(label) for label in labels])
        journal.unlink()

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
            return [_commit_info(c) for c in commits]

    def _resolve(self, tx: RepoTransaction, sha: str) -> git.Commit:
        validate_sha(sha)
        try:
            commit = tx.repo.commit(sha)
        except (git.BadName, ValueError):
            raise UnknownCommit(f"no commit {sha} in the memory of user '{tx.user_id}'") from None
        return commit

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
