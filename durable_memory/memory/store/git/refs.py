"""HEAD and the branch it names, read from the files inside `.git` (no git process), and
written back the way git writes them. These files may be torn by a crash or edited by hand:
whatever does not match a strict pattern is `Unreadable`, for recovery to repair."""

import re
from pathlib import Path

from durable_memory.memory.store.safe_files import open_dir, read_bytes_at, write_bytes_at

BRANCH_REF = "refs/heads/main"
FULL_SHA = re.compile(r"[0-9a-f]{40}")


class Unreadable(Exception):
    """HEAD, its ref or an object it needs cannot be read: the repository needs repairing."""


def read_git_file(git_dir: Path, relative: str) -> str | None:
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


def write_git_file(git_dir: Path, relative: str, content: str | bytes) -> None:
    """Replace a file inside `.git` the way git does: `<name>.lock`, fsynced, renamed."""
    *parents, name = relative.split("/")
    data = content.encode("utf-8") if isinstance(content, str) else content
    with open_dir(git_dir, parents, ".git", create=True) as fd:
        write_bytes_at(fd, name, data, tmp_suffix=".lock")


def head_ref(git_dir: Path) -> str:
    """The branch HEAD names: always main. Anything else (torn by a crash, a detached HEAD, a
    branch switched by hand) is repaired back to it, as memory is main's history."""
    text = read_git_file(git_dir, "HEAD") or ""
    if text.strip() != f"ref: {BRANCH_REF}":
        raise Unreadable(f".git/HEAD holds {text[:60]!r}, not 'ref: {BRANCH_REF}'")
    return BRANCH_REF


def read_head(git_dir: Path) -> str | None:
    """HEAD's commit from the files alone (no git process); None for an unborn branch."""
    ref = head_ref(git_dir)
    value = read_git_file(git_dir, ref)
    if value is not None:
        sha = value.strip()
        if not FULL_SHA.fullmatch(sha):
            raise Unreadable(f".git/{ref} holds {value[:60]!r}, not a commit id")
        return sha
    for line in (read_git_file(git_dir, "packed-refs") or "").splitlines():
        sha, _, name = line.partition(" ")
        if name == ref and FULL_SHA.fullmatch(sha):
            return sha
    if reflog(git_dir, ref):
        raise Unreadable(f".git/{ref} is missing, but its reflog says it existed")
    return None


def reflog(git_dir: Path, ref: str) -> list[tuple[str, str, str]]:
    """The reflog of `ref`, oldest first, as (old, new, line); a torn last line is skipped."""
    entries = []
    for line in (read_git_file(git_dir, f"logs/{ref}") or "").splitlines():
        old, new = line[:40], line[41:81]
        if FULL_SHA.fullmatch(old) and FULL_SHA.fullmatch(new) and line[40:41] == " ":
            entries.append((old, new, line))
    return entries
