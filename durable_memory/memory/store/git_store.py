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
import logging
import os
import re
import shutil
import stat
import subprocess
import tempfile
import threading
import zlib
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import git

from durable_memory.faults import MID_COMMIT, crash_point
from durable_memory.memory.core.errors import (
    DamagedRepository,
    DurableMemoryError,
    HandEditPending,
    UnknownCommit,
    UnknownUser,
    UnsafeFile,
)
from durable_memory.memory.core.ids import validate_label, validate_sha, validate_user_id
from durable_memory.memory.store.safe_files import (
    MAX_FILE_BYTES,
    decode_utf8,
    kind_of,
    open_dir,
    read_bytes_at,
    write_bytes_at,
)
from durable_memory.models.history import Author, AuthorKind, CommitInfo

log = logging.getLogger(__name__)

BLOCKS_DIR = "blocks"
_LOCK_FILE = "dmem-write.lock"
_JOURNAL_FILE = "dmem-journal"
_JOURNAL_BASE = "base="
"""The journal's first line: the HEAD a write started from, a known-good commit to go back to."""
_BRANCH_REF = "refs/heads/main"
_SET_ASIDE_DIR = "dmem-set-aside"
"""Where a repair keeps working copies it had to put back (`.git/dmem-set-aside/`)."""
_SAFE_GIT_CONFIG = [
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
    """What one commit holds: its block files (label -> TOML text) and who made it.

    `refused` names what under `blocks/` was not read, and why: a symlink or a submodule
    committed in place of a file, text that is not UTF-8, a file that is not `<label>.toml`."""

    blocks: Mapping[str, str]
    info: CommitInfo
    refused: Mapping[str, str] = field(default_factory=dict)


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
        label = _block_label(name)
        if not isinstance(item, git.Blob) or not stat.S_ISREG(item.mode):
            refused[path] = f"{_entry_kind(item.mode)}, not a regular file"
        elif label is None:
            refused[path] = "not a block file (blocks/<label>.toml)"
        elif item.size > MAX_FILE_BYTES:
            refused[path] = f"{item.size} bytes, over {MAX_FILE_BYTES}"
        else:
            try:
                blocks[label] = decode_utf8(item.data_stream.read(), path)
            except UnsafeFile:
                refused[path] = "not valid UTF-8"
    return blocks, refused


def _entry_kind(mode: int) -> str:
    if stat.S_IFMT(mode) == 0o160000:  # a gitlink: no file type of the OS has this mode
        return "a submodule"
    return kind_of(mode)


def _block_label(name: str) -> str | None:
    """The label of a file named `<label>.toml`, or None for any other name."""
    stem = name.removesuffix(".toml")
    if stem == name:
        return None
    try:
        return validate_label(stem)
    except DurableMemoryError:
        return None


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


_UNREADABLE_OBJECT = (ValueError, git.GitError, git.ODBError, zlib.error)
"""What GitPython raises when an object is missing or corrupt (ValueError: `cat-file` says
"missing"), as opposed to our own refusals of what a readable object holds."""


def _run_git(
    repo: git.Repo, lock: int, *args: str, stdin: bytes = b"", env: Mapping[str, str] | None = None
) -> None:
    """A git command that writes to the repository, run with the user's lock descriptor passed
    on: if our process is killed, the git child still running keeps the lock until it exits,
    so the next writer never "recovers" (removes the lock files of) a write still under way."""
    command = ["git", *(arg for option in _SAFE_GIT_CONFIG for arg in ("-c", option)), *args]
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    result = subprocess.run(
        command,
        cwd=repo.working_tree_dir,
        input=stdin,
        capture_output=True,
        env={**inherited, **(env or {})},
        pass_fds=(lock,),
        check=False,
    )
    if result.returncode != 0:
        raise git.GitCommandError(command, result.returncode, result.stderr)


class _Unreadable(Exception):
    """HEAD, its ref or an object it needs cannot be read: the repository needs repairing."""


def _read_git_file(git_dir: Path, relative: str) -> str | None:
    """A small file inside `.git` (HEAD, a ref, a reflog), never through a symlink."""
    *parents, name = relative.split("/")
    try:
        with open_dir(git_dir, parents, ".git") as fd:
            data = read_bytes_at(fd, name, f".git/{relative}")
    except FileNotFoundError:
        return None
    # Torn by a crash, it may hold any bytes: every reader matches what it takes against a
    # strict pattern (hex ids, ref names, labels), so a replaced byte is rejected there.
    return None if data is None else data.decode("utf-8", errors="replace")


def _write_git_file(git_dir: Path, relative: str, content: str | bytes) -> None:
    """Replace a file inside `.git` the way git does: `<name>.lock`, fsynced, renamed."""
    *parents, name = relative.split("/")
    data = content.encode("utf-8") if isinstance(content, str) else content
    with open_dir(git_dir, parents, ".git", create=True) as fd:
        write_bytes_at(fd, name, data, tmp_suffix=".lock")


def _head_ref(git_dir: Path) -> str:
    """The branch HEAD names: always main. Anything else (torn by a crash, a detached HEAD, a
    branch switched by hand) is repaired back to it, as memory is main's history."""
    text = _read_git_file(git_dir, "HEAD") or ""
    if text.strip() != f"ref: {_BRANCH_REF}":
        raise _Unreadable(f".git/HEAD holds {text[:60]!r}, not 'ref: {_BRANCH_REF}'")
    return _BRANCH_REF


def _read_head(git_dir: Path) -> str | None:
    """HEAD's commit from the files alone (no git process); None for an unborn branch."""
    ref = _head_ref(git_dir)
    value = _read_git_file(git_dir, ref)
    if value is not None:
        sha = value.strip()
        if not _FULL_SHA.fullmatch(sha):
            raise _Unreadable(f".git/{ref} holds {value[:60]!r}, not a commit id")
        return sha
    for line in (_read_git_file(git_dir, "packed-refs") or "").splitlines():
        sha, _, name = line.partition(" ")
        if name == ref and _FULL_SHA.fullmatch(sha):
            return sha
    if _reflog(git_dir, ref):
        raise _Unreadable(f".git/{ref} is missing, but its reflog says it existed")
    return None


def _reflog(git_dir: Path, ref: str) -> list[tuple[str, str, str]]:
    """The reflog of `ref`, oldest first, as (old, new, line); a torn last line is skipped."""
    entries = []
    for line in (_read_git_file(git_dir, f"logs/{ref}") or "").splitlines():
        old, new = line[:40], line[41:81]
        if _FULL_SHA.fullmatch(old) and _FULL_SHA.fullmatch(new) and line[40:41] == " ":
            entries.append((old, new, line))
    return entries


def _remove_stale_locks(git_dir: Path, user_id: str) -> bool:
    """Remove the lock files of git processes that were killed. Only called while holding the
    user's write lock: every writer of ours holds it, so no live writer owns them (a person
    running git by hand in the repository at this instant would lose their lock: documented)."""
    found = [p for p in git_dir.iterdir() if p.name.endswith(".lock") and p.name != _LOCK_FILE]
    for tree in ("refs", "logs"):  # ref files, and reflogs (GitPython locks those too)
        for root, _dirs, files in os.walk(git_dir / tree):  # never follows a symlinked dir
            found.extend(Path(root) / name for name in files if name.endswith(".lock"))
    for path in found:
        path.unlink(missing_ok=True)
        log.warning(
            "user '%s': removed the stale git lock file %s (left by a killed process)",
            user_id,
            path.relative_to(git_dir.parent),
        )
    return bool(found)


def _loose_object_ok(path: Path, sha: str) -> bool:
    try:
        if not stat.S_ISREG(path.lstat().st_mode):  # a FIFO there would hang the read
            return False
        data = zlib.decompress(path.read_bytes())
    except (OSError, zlib.error):
        return False
    header, nul, body = data.partition(b"\x00")
    kind, _, size = header.partition(b" ")
    return (
        bool(nul)
        and kind in (b"commit", b"tree", b"blob", b"tag")
        and size == str(len(body)).encode()
        and hashlib.sha1(data, usedforsecurity=False).hexdigest() == sha
    )


def _remove_corrupt_objects(git_dir: Path, user_id: str) -> None:
    """Remove loose objects that are empty or do not hash to their name (a kill or power loss
    before the data reached the disk). git never rewrites an object file that exists, so a
    corrupt one would otherwise stay, and be reused by the next commit with the same content."""
    objects = git_dir / "objects"
    for folder in objects.iterdir():
        if len(folder.name) != 2 or not folder.is_dir() or folder.is_symlink():
            continue
        for path in folder.iterdir():
            sha = folder.name + path.name
            if _FULL_SHA.fullmatch(sha) and not _loose_object_ok(path, sha):
                path.unlink()
                log.warning("user '%s': removed the corrupt git object %s", user_id, sha)


def _load_snapshot(repo: git.Repo, user_id: str, sha: str, cache: "SnapshotCache") -> Snapshot:
    found = cache.get(user_id, sha)
    if found is None:
        commit = repo.commit(sha)
        blocks, refused = _read_tree_blocks(commit)
        for path, why in refused.items():
            log.warning("user '%s': commit %s: %s is %s: not read", user_id, sha[:12], path, why)
        found = Snapshot(blocks=blocks, info=_commit_info(commit), refused=refused)
        cache.put(user_id, sha, found)
    return found


def _readable(
    repo: git.Repo, user_id: str, sha: str, cache: "SnapshotCache", *, history: bool = True
) -> bool:
    """The commit and its block files read; with `history`, every object it reaches exists
    too (asked after corrupt loose objects were removed, so an object that exists reads).
    Without, a commit whose blocks are cached costs nothing: the common case."""
    try:
        if history:
            repo.git.rev_list("--objects", "--quiet", sha)
        _load_snapshot(repo, user_id, sha, cache)
    except _UNREADABLE_OBJECT:
        repo.git.clear_cache()  # a `cat-file` that met a bad object is not reused
        return False
    return True


def _repair(
    repo: git.Repo, lock: int, user_id: str, problem: str, base: str | None, cache: "SnapshotCache"
) -> str:
    """Point HEAD's ref at the newest commit whose history is readable, from the reflog or the
    journal's base, and drop the reflog lines and index entries naming lost objects."""
    git_dir = Path(repo.git_dir)
    log.warning("user '%s': the repository is damaged (%s); repairing it", user_id, problem)
    _remove_corrupt_objects(git_dir, user_id)
    ref = _BRANCH_REF
    try:
        _head_ref(git_dir)
    except _Unreadable:
        _write_git_file(git_dir, "HEAD", f"ref: {ref}\n")
    entries = _reflog(git_dir, ref)
    candidates = [new for _old, new, _line in reversed(entries)] + ([base] if base else [])
    candidates += [old for old, _new, _line in reversed(entries) if old != "0" * 40]
    good = next(
        (sha for sha in dict.fromkeys(candidates) if _readable(repo, user_id, sha, cache)), None
    )
    if good is None:
        raise DamagedRepository(
            f"the memory of user '{user_id}' is damaged ({problem}) and no earlier commit is "
            f"readable; restore users/{user_id} from a backup"
        )
    _write_git_file(git_dir, ref, f"{good}\n")
    for log_ref in dict.fromkeys([ref, "HEAD"]):
        if _read_git_file(git_dir, f"logs/{log_ref}") is not None:
            kept = _reflog_until(_reflog(git_dir, log_ref), good)
            _write_git_file(git_dir, f"logs/{log_ref}", "".join(f"{line}\n" for line in kept))
    # The index may name objects lost with the commits; unreachable now, those commits and
    # trees still name what is missing (fsck reports them), so they go too.
    _run_git(repo, lock, "reset", "--quiet")
    _run_git(repo, lock, "prune", "--expire=now")
    log.warning("user '%s': reset %s to %s, the newest readable commit", user_id, ref, good)
    return good


def _reflog_until(entries: list[tuple[str, str, str]], good: str) -> list[str]:
    """The reflog lines up to the moment the ref was at `good`: the later ones name commits
    that were lost."""
    for index in range(len(entries) - 1, -1, -1):
        old, new, _line = entries[index]
        if new == good:
            return [line for _o, _n, line in entries[: index + 1]]
        if old == good:
            return [line for _o, _n, line in entries[:index]]
    return []


def _read_journal(git_dir: Path) -> tuple[str | None, list[str]] | None:
    """The journal of an interrupted write: (HEAD it started from, labels it was writing)."""
    text = _read_git_file(git_dir, _JOURNAL_FILE)
    if text is None:
        return None
    lines = [line for line in text.split("\n") if line]
    base = None
    if lines and lines[0].startswith(_JOURNAL_BASE):
        base = lines.pop(0).removeprefix(_JOURNAL_BASE)
        base = base if _FULL_SHA.fullmatch(base) else None
    return base, [validate_label(line) for line in lines]


@dataclass
class RepoTransaction:
    """Read-modify-write access to one user's repository while holding its lock."""

    repo: git.Repo
    lock: int
    """The descriptor holding the user's flock, passed on to the git commands that write."""
    user_id: str
    users_dir: Path
    head: str | None
    """Verified readable by recovery. Nothing else writes while we hold the lock, so HEAD is
    read once per transaction."""
    cache: SnapshotCache = field(default_factory=SnapshotCache)

    def snapshot(self, sha: str) -> Snapshot:
        """The commit's block files and author (cached); `sha` must be a full commit id."""
        return _load_snapshot(self.repo, self.user_id, sha, self.cache)

    def read(self, label: str, sha: str | None = None) -> str | None:
        """The block file at `sha` (default HEAD), or None if it does not exist there.

        A symlink, a submodule or bytes that are not UTF-8 committed as the block are refused."""
        path = block_path(label)
        rev = sha or self.head
        if rev is None:
            return None
        if not _FULL_SHA.fullmatch(rev):
            rev = self.repo.commit(rev).hexsha
        snapshot = self.snapshot(rev)
        for refused in (BLOCKS_DIR, path):
            if refused in snapshot.refused:
                raise UnsafeFile(
                    f"users/{self.user_id}/{refused} at {rev[:12]} is "
                    f"{snapshot.refused[refused]}: refused, nothing was read from it"
                )
        return snapshot.blocks.get(label)

    def labels(self) -> list[str]:
        return sorted(self.snapshot(self.head).blocks) if self.head else []

    def head_info(self) -> CommitInfo | None:
        return self.snapshot(self.head).info if self.head else None

    def _blocks_dir(self, *, create: bool = False) -> contextlib.AbstractContextManager[int]:
        return open_dir(self.users_dir, [self.user_id, BLOCKS_DIR], "users", create=create)

    def working_copy(self, label: str) -> str | None:
        """The block file in the working tree, as the person who edited it left it; None if
        absent. A symlink, a FIFO, a device or a directory there, or bytes that are not UTF-8,
        are refused (`UnsafeFile`), never followed, opened or replaced."""
        shown = f"users/{self.user_id}/{block_path(label)}"
        try:
            with self._blocks_dir() as blocks:
                data = read_bytes_at(blocks, f"{label}.toml", shown)
        except FileNotFoundError:
            return None
        return None if data is None else decode_utf8(data, shown)

    def working_files(self) -> list[str]:
        """The names in the working tree's `blocks/` directory."""
        try:
            with self._blocks_dir() as blocks:
                return sorted(os.listdir(blocks))
        except FileNotFoundError:
            return []

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
        base = [f"{_JOURNAL_BASE}{self.head}"] if self.head else []
        _write_git_file(git_dir, _JOURNAL_FILE, "\n".join([*base, *changed]))
        with self._blocks_dir(create=True) as blocks:
            for label, text in changed.items():
                write_bytes_at(blocks, f"{label}.toml", text.encode("utf-8"))
        # `git add` as a subprocess (cwd passed to it): GitPython's IndexFile.add chdirs the
        # whole process, which races with threads committing to other users' repositories.
        _run_git(self.repo, self.lock, "add", "--", *(block_path(label) for label in changed))
        crash_point(MID_COMMIT)
        # `git commit` rather than GitPython's in-process writer: git fsyncs what it writes
        # (`core.fsync`), so a commit that returned survives a power loss.
        actor = _actor(author)
        identity = {
            "GIT_AUTHOR_NAME": actor.name or "",
            "GIT_AUTHOR_EMAIL": actor.email or "",
            "GIT_COMMITTER_NAME": _COMMITTER.name or "",
            "GIT_COMMITTER_EMAIL": _COMMITTER.email or "",
        }
        _run_git(
            self.repo,
            self.lock,
            "commit",
            "--quiet",
            "--no-verify",
            "--allow-empty",
            "--cleanup=verbatim",
            "--file=-",
            stdin=message.encode("utf-8"),
            env=identity,
        )
        new = _read_head(git_dir)
        assert new is not None, "git commit returned without a commit"
        (git_dir / _JOURNAL_FILE).unlink()
        # The index held HEAD plus our files (checked above), so this is the new commit.
        self.head = new
        self.cache.put(
            self.user_id,
            new,
            Snapshot(blocks={**before, **changed}, info=_commit_info(self.repo.commit(new))),
        )
        return new


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

    @contextlib.contextmanager
    def transaction(self, user_id: str, *, create: bool = False) -> Iterator[RepoTransaction]:
        """Hold the user's write lock; recover from a write interrupted by a crash."""
        path = self.repo_path(user_id)
        if not self._is_repository(user_id):
            if not create:
                raise UnknownUser(f"user '{user_id}' has no memory yet")
            self._create(user_id)
        with open_dir(self.users_dir, [user_id, ".git"], "users") as git_fd:
            lock = os.open(
                _LOCK_FILE,
                os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o644,
                dir_fd=git_fd,
            )
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            with git.Repo(path) as repo:
                repo.git.set_persistent_git_options(c=_SAFE_GIT_CONFIG)
                head = self._recover(repo, lock, user_id)
                yield RepoTransaction(
                    repo=repo,
                    lock=lock,
                    user_id=user_id,
                    users_dir=self.users_dir,
                    head=head,
                    cache=self.cache,
                )
        finally:
            os.close(lock)  # releases the flock

    def _recover(self, repo: git.Repo, lock: int, user_id: str) -> str | None:
        """Make the repository usable after a process was killed anywhere in a write; return
        HEAD, verified readable. Runs under the user's lock, so no writer of ours is live:
        git lock files left behind are stale; a journal means our write did not finish."""
        git_dir = Path(repo.git_dir)
        killed = _remove_stale_locks(git_dir, user_id)
        journal = _read_journal(git_dir)
        interrupted = killed or journal is not None
        if interrupted:
            _remove_corrupt_objects(git_dir, user_id)
        base = journal[0] if journal else None
        try:
            head = _read_head(git_dir)
            if head is not None and not _readable(
                repo, user_id, head, self.cache, history=interrupted
            ):
                raise _Unreadable(f"commit {head[:12]} or an object it needs is unreadable")
        except _Unreadable as problem:
            head = _repair(repo, lock, user_id, str(problem), base, self.cache)
            self._roll_back(repo, lock, user_id, head, None)
        else:
            if journal is not None:
                self._roll_back(repo, lock, user_id, head, journal[1])
        return head

    def _roll_back(
        self,
        repo: git.Repo,
        lock: int,
        user_id: str,
        head: str | None,
        labels: list[str] | None,
    ) -> None:
        """Put the block files and index entries a write touched back to HEAD: `labels`, the
        ones an interrupted write names in its journal, or None after a repair, when every block
        file is, and any that differs from the repaired HEAD (written by a lost commit, or an
        edit in progress) is first set aside in `.git/dmem-set-aside/` for a person to look at."""
        blocks = _load_snapshot(repo, user_id, head, self.cache).blocks if head else {}
        set_aside = labels is None
        shown = f"users/{user_id}/{BLOCKS_DIR}"
        git_dir = Path(repo.git_dir)
        with open_dir(self.users_dir, [user_id, BLOCKS_DIR], "users", create=True) as fd:
            if labels is None:
                on_disk = [_block_label(name) for name in os.listdir(fd)]
                labels = sorted({*blocks, *(label for label in on_disk if label)})
            for label in labels:
                name = f"{label}.toml"
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f"{name}.tmp", dir_fd=fd)
                current = read_bytes_at(fd, name, f"{shown}/{name}")
                wanted = blocks[label].encode("utf-8") if label in blocks else None
                if current == wanted:
                    continue
                if current is not None and set_aside:
                    _write_git_file(git_dir, f"{_SET_ASIDE_DIR}/{name}", current)
                    log.warning("user '%s': set %s aside in .git/%s", user_id, name, _SET_ASIDE_DIR)
                if wanted is not None:
                    write_bytes_at(fd, name, wanted)
                else:
                    os.unlink(name, dir_fd=fd)
        if head is not None and labels:
            _run_git(repo, lock, "reset", "--quiet", "--", *(block_path(label) for label in labels))
        (git_dir / _JOURNAL_FILE).unlink(missing_ok=True)
        log.warning("user '%s': put %s back as at HEAD", user_id, ", ".join(labels) or "nothing")

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
