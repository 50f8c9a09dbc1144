"""Crash recovery: make a user's repository usable after a process was killed anywhere in a
write (SIGKILL, OOM, power loss). Runs at the start of every transaction, under the user's
lock, so no writer of ours is live: git lock files left behind are stale, a journal means our
write did not finish, and a HEAD that does not read is pointed back at the newest commit whose
history reads. Everything it changes is logged."""

import contextlib
import hashlib
import logging
import os
import stat
import zlib
from pathlib import Path

from durable_memory.memory.core.errors import DamagedRepository
from durable_memory.memory.store.git.commits import RepoOpener, run_git
from durable_memory.memory.store.git.journal import clear_journal, read_journal
from durable_memory.memory.store.git.layout import (
    BLOCKS_DIR,
    RECORD_FILES,
    block_label,
    block_path,
    open_blocks_dir,
    open_user_dir,
)
from durable_memory.memory.store.git.locking import LOCK_FILE
from durable_memory.memory.store.git.refs import (
    BRANCH_REF,
    FULL_SHA,
    Unreadable,
    head_ref,
    read_git_file,
    read_head,
    reflog,
    write_git_file,
)
from durable_memory.memory.store.git.snapshots import (
    UNREADABLE_OBJECT,
    SnapshotCache,
    load_snapshot,
)
from durable_memory.memory.store.safe_files import read_bytes_at, write_bytes_at

log = logging.getLogger(__name__)

_SET_ASIDE_DIR = "dmem-set-aside"
"""Where a repair keeps working copies it had to put back (`.git/dmem-set-aside/`)."""


def recover(
    repo: RepoOpener, lock: int, users_dir: Path, user_id: str, cache: SnapshotCache
) -> str | None:
    """Make the repository usable after a process was killed anywhere in a write; return
    HEAD, verified readable. Runs under the user's lock, so no writer of ours is live:
    git lock files left behind are stale; a journal means our write did not finish. Opens
    the repository only to read a commit not cached, or to repair: the usual transaction
    finds nothing to do and HEAD's snapshot cached."""
    git_dir = repo.git_dir
    killed = _remove_stale_locks(git_dir, user_id)
    journal = read_journal(git_dir)
    interrupted = killed or journal is not None
    if interrupted:
        _remove_corrupt_objects(git_dir, user_id)
    base = journal.base if journal else None
    try:
        head = read_head(git_dir)
        if head is not None and not _readable(repo, user_id, head, cache, history=interrupted):
            raise Unreadable(f"commit {head[:12]} or an object it needs is unreadable")
    except Unreadable as problem:
        head = _repair(repo, lock, user_id, str(problem), base, cache)
        _roll_back(repo, lock, users_dir, user_id, head, None, cache)
    else:
        if journal is not None:
            labels = journal.labels
            _roll_back(repo, lock, users_dir, user_id, head, labels, cache, journal.records)
    return head


def _remove_stale_locks(git_dir: Path, user_id: str) -> bool:
    """Remove the lock files of git processes that were killed. Only called while holding the
    user's write lock: every writer of ours holds it, so no live writer owns them (a person
    running git by hand in the repository at this instant would lose their lock: documented)."""
    found = _lock_files(git_dir)
    for path in found:
        path.unlink(missing_ok=True)
        log.warning(
            "user '%s': removed the stale git lock file %s (left by a killed process)",
            user_id,
            path.relative_to(git_dir.parent),
        )
    return bool(found)


def _lock_files(git_dir: Path) -> list[Path]:
    """The `*.lock` files directly in .git (ours aside), then anywhere under refs/ and logs/
    (ref files, and reflogs: GitPython locks those too). Walked by os.walk's rules with
    scandir's entries, at about half os.walk's cost (every transaction asks, two a turn): a
    symlinked directory is never entered, and one that is missing or cannot be listed is
    passed over. .git itself must list, as before."""
    with os.scandir(git_dir) as entries:
        found = [Path(e.path) for e in entries if e.name.endswith(".lock") and e.name != LOCK_FILE]
    for tree in ("refs", "logs"):
        pending = [os.path.join(git_dir, tree)]
        while pending:
            try:
                with os.scandir(pending.pop()) as entries:
                    listed = list(entries)
            except OSError:
                continue
            for entry in listed:
                try:
                    is_dir = entry.is_dir()
                except OSError:
                    is_dir = False
                if is_dir:
                    if not entry.is_symlink():
                        pending.append(entry.path)
                elif entry.name.endswith(".lock"):
                    found.append(Path(entry.path))
    return found


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
            if FULL_SHA.fullmatch(sha) and not _loose_object_ok(path, sha):
                path.unlink()
                log.warning("user '%s': removed the corrupt git object %s", user_id, sha)


def _readable(
    repo: RepoOpener, user_id: str, sha: str, cache: SnapshotCache, *, history: bool = True
) -> bool:
    """The commit and its block files read; with `history`, every object it reaches exists
    too (asked after corrupt loose objects were removed, so an object that exists reads).
    Without, a commit whose blocks are cached costs nothing: the common case."""
    try:
        if history:
            repo().git.rev_list("--objects", "--quiet", sha)
        load_snapshot(repo, user_id, sha, cache)
    except UNREADABLE_OBJECT:
        repo().git.clear_cache()  # a `cat-file` that met a bad object is not reused
        return False
    return True


def _repair(
    repo: RepoOpener, lock: int, user_id: str, problem: str, base: str | None, cache: SnapshotCache
) -> str:
    """Point HEAD's ref at the newest commit whose history is readable, from the reflog or the
    journal's base, and drop the reflog lines and index entries naming lost objects."""
    git_dir = repo.git_dir
    log.warning("user '%s': the repository is damaged (%s); repairing it", user_id, problem)
    _remove_corrupt_objects(git_dir, user_id)
    ref = BRANCH_REF
    try:
        head_ref(git_dir)
    except Unreadable:
        write_git_file(git_dir, "HEAD", f"ref: {ref}\n")
    entries = reflog(git_dir, ref)
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
    write_git_file(git_dir, ref, f"{good}\n")
    for log_ref in dict.fromkeys([ref, "HEAD"]):
        if read_git_file(git_dir, f"logs/{log_ref}") is not None:
            kept = _reflog_until(reflog(git_dir, log_ref), good)
            write_git_file(git_dir, f"logs/{log_ref}", "".join(f"{line}\n" for line in kept))
    # The index may name objects lost with the commits; unreachable now, those commits and
    # trees still name what is missing (fsck reports them), so they go too.
    run_git(repo(), lock, "reset", "--quiet")
    run_git(repo(), lock, "prune", "--expire=now")
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


def _roll_back(
    repo: RepoOpener,
    lock: int,
    users_dir: Path,
    user_id: str,
    head: str | None,
    labels: list[str] | None,
    cache: SnapshotCache,
    records: list[str] | None = None,
) -> None:
    """Put the block files and index entries a write touched back to HEAD: `labels`, the
    ones an interrupted write names in its journal (and its `records`), or
    None after a repair, when every block file and every record are, and any that
    differs from the repaired HEAD (written by a lost commit, or an edit in progress) is first
    set aside in `.git/dmem-set-aside/` for a person to look at."""
    snapshot = load_snapshot(repo, user_id, head, cache) if head else None
    blocks = snapshot.blocks if snapshot else {}
    set_aside = labels is None
    git_dir = repo.git_dir
    with open_blocks_dir(users_dir, user_id, create=True) as fd:
        if labels is None:
            on_disk = [block_label(name) for name in os.listdir(fd)]
            labels = sorted({*blocks, *(label for label in on_disk if label)})
        for label in labels:
            _put_back(fd, f"{label}.toml", blocks.get(label), set_aside, git_dir, user_id)
    paths = [block_path(label) for label in labels]
    if records is None:
        records = list(RECORD_FILES)
    if records:
        with open_user_dir(users_dir, user_id) as top:
            for name in records:
                wanted = snapshot.records.get(name) if snapshot else None
                _put_back(top, name, wanted, set_aside, git_dir, user_id)
        paths.extend(records)
    if paths and head is not None:
        run_git(repo(), lock, "reset", "--quiet", "--", *paths)
    elif paths:  # a first commit interrupted after staging: no HEAD to reset the index to
        run_git(repo(), lock, "rm", "--cached", "--quiet", "--ignore-unmatch", "--", *paths)
    clear_journal(git_dir)
    log.warning("user '%s': put %s back as at HEAD", user_id, ", ".join(labels) or "nothing")


def _put_back(
    fd: int, name: str, text: str | None, set_aside: bool, git_dir: Path, user_id: str
) -> None:
    """Make the working file `name` in directory `fd` hold `text` (absent if None); with
    `set_aside`, a different file found there is first kept in `.git/dmem-set-aside/`."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(f"{name}.tmp", dir_fd=fd)
    shown = f"users/{user_id}/{name if name in RECORD_FILES else f'{BLOCKS_DIR}/{name}'}"
    current = read_bytes_at(fd, name, shown)
    wanted = text.encode("utf-8") if text is not None else None
    if current == wanted:
        return
    if current is not None and set_aside:
        write_git_file(git_dir, f"{_SET_ASIDE_DIR}/{name}", current)
        log.warning("user '%s': set %s aside in .git/%s", user_id, name, _SET_ASIDE_DIR)
    if wanted is not None:
        write_bytes_at(fd, name, wanted)
    else:
        os.unlink(name, dir_fd=fd)
