"""Redacting a text from every version of one block (`dmem redact`): the one history rewrite
the system ever makes.

Every commit of main is rewritten, oldest first, with git's plumbing: the block's file gets
the text replaced, its message too (a summary may quote it), and everything else is kept byte
for byte: the author and committer lines (names, e-mails, dates, zones), the other files and
the trailers. A commit object is written as git would (`hash-object -t commit`), so a rewrite
run twice on the same history yields the same ids. On top of the new chain comes the
redaction record: a commit with no change of files, whose message names who, why, the block,
a SHA-256 of the text (never the text) and every old -> new commit id.

Nothing is written before every rewritten version has been checked (the caller's `check`: it
must still be a valid block), so a refused redaction leaves the repository byte-identical. The
new chain is then built beside the old one and main moved over it by one compare-and-swap
(`update-ref main <new> <old>`; the remote store pushes with a lease instead): a kill leaves the
old history or the new one, never a mix. Last, `purge` drops every trace of the old objects:
reflogs expired, `gc --prune=now`.
"""

import hashlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import git

from durable_memory.memory.core.errors import DurableMemoryError, OperationNotApplicable
from durable_memory.memory.store.git.commits import git_process
from durable_memory.memory.store.git.layout import BLOCKS_DIR
from durable_memory.memory.store.git.messages import (
    author_actor,
    format_message,
    message_text,
    parse_trailers,
)
from durable_memory.memory.store.git.refs import BRANCH_REF, FULL_SHA
from durable_memory.models.history import Author

REDACTED = "[redacted]"
"""What stands where the text was, in the block, in messages and in every SQL row."""
REDACTION_ID = "Redaction-Id"
HISTORY_REWRITE_HEADER = "Dmem-History-Rewrite"
"""The header (value: the main it replaces) with which a push asks `dmem git-serve` to accept
one non-fast-forward update of main, and to drop the old objects after."""
_MAPPING_LINE = re.compile(r"([0-9a-f]{40}) -> ([0-9a-f]{40})")


@dataclass(frozen=True)
class RewrittenHistory:
    """The outcome of a redaction in one repository."""

    record: str
    """The redaction record commit: main's new tip."""
    old_head: str
    commits: dict[str, str]
    """Old -> new id of every commit of main before the record."""
    versions: int
    """How many versions of the block held the text."""


def text_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _git(repo: git.Repo, lock: int, *args: str, stdin: bytes = b"") -> bytes:
    result = git_process(*args, cwd=repo.git_dir, lock=lock, stdin=stdin)
    if result.returncode != 0:
        raise git.GitCommandError(list(args), result.returncode, result.stderr)
    return result.stdout


def _tree_entries(repo: git.Repo, lock: int, tree: str) -> list[tuple[str, str, str, str]]:
    """(mode, type, sha, name) of each entry of a tree (`ls-tree -z`)."""
    entries = []
    for item in _git(repo, lock, "ls-tree", "-z", tree).split(b"\0"):
        if item:
            meta, _, name = item.decode("utf-8", errors="surrogateescape").partition("\t")
            mode, kind, sha = meta.split(" ")
            entries.append((mode, kind, sha, name))
    return entries


def _make_tree(repo: git.Repo, lock: int, entries: list[tuple[str, str, str, str]]) -> str:
    listing = "".join(f"{mode} {kind} {sha}\t{name}\0" for mode, kind, sha, name in entries)
    data = listing.encode("utf-8", errors="surrogateescape")
    return _git(repo, lock, "mktree", "-z", stdin=data).decode().strip()


def _entry(entries: list[tuple[str, str, str, str]], name: str, kind: str) -> str | None:
    return next((sha for _, k, sha, n in entries if n == name and k == kind), None)


class _Rewriter:
    """The rewrite of one repository's main, in two passes: plan (read only) and write."""

    def __init__(
        self, repo: git.Repo, lock: int, label: str, text: str, commits: list[str]
    ) -> None:
        self.repo, self.lock, self.text, self.commits = repo, lock, text, commits
        self.file = f"{label}.toml"
        self.blobs: dict[str, str] = {}
        """Old blob id -> new text of every version of the block that held the text."""

    def _read(self, sha: str) -> bytes:
        return _git(self.repo, self.lock, "cat-file", "-p", sha)

    def _block_blob(self, tree: str) -> str | None:
        blocks = _entry(_tree_entries(self.repo, self.lock, tree), BLOCKS_DIR, "tree")
        if blocks is None:
            return None
        return _entry(_tree_entries(self.repo, self.lock, blocks), self.file, "blob")

    def plan(self, check: Callable[[str, str], None]) -> None:
        """Find every version holding the text and check its redacted text (`check(commit,
        text)` raises when it is not a valid block)."""
        for sha in self.commits:
            raw = self._read(sha).decode("utf-8", errors="surrogateescape")
            tree = raw.split("\n", 1)[0].removeprefix("tree ")
            blob = self._block_blob(tree)
            if blob is None or blob in self.blobs:
                continue
            content = self._read(blob).decode("utf-8", errors="replace")
            if self.text in content:
                redacted = content.replace(self.text, REDACTED)
                check(sha, redacted)
                self.blobs[blob] = redacted

    def write(self) -> dict[str, str]:
        """Write the new chain; old -> new id of every commit."""
        new_blobs = {
            old: _git(
                self.repo,
                self.lock,
                "hash-object",
                "-w",
                "--no-filters",
                "--stdin",
                stdin=text.encode(),
            )
            .decode()
            .strip()
            for old, text in self.blobs.items()
        }
        trees: dict[str, str] = {}
        mapped: dict[str, str] = {}
        for sha in self.commits:
            header, _, message = self._read(sha).partition(b"\n\n")
            lines = []
            for line in header.decode("utf-8", errors="surrogateescape").split("\n"):
                key, _, value = line.partition(" ")
                if key == "tree":
                    line = f"tree {trees.get(value) or self._tree(value, new_blobs, trees)}"
                elif key == "parent":
                    line = f"parent {mapped[value]}"
                lines.append(line)
            body = message.decode("utf-8", errors="surrogateescape").replace(self.text, REDACTED)
            data = ("\n".join(lines) + "\n\n" + body).encode("utf-8", errors="surrogateescape")
            mapped[sha] = (
                _git(
                    self.repo, self.lock, "hash-object", "-t", "commit", "-w", "--stdin", stdin=data
                )
                .decode()
                .strip()
            )
        return mapped

    def _tree(self, tree: str, new_blobs: Mapping[str, str], trees: dict[str, str]) -> str:
        top = _tree_entries(self.repo, self.lock, tree)
        blocks = _entry(top, BLOCKS_DIR, "tree")
        new = tree
        if blocks is not None:
            inner = _tree_entries(self.repo, self.lock, blocks)
            if any(sha in new_blobs for _, _, sha, name in inner if name == self.file):
                inner = [
                    (m, k, new_blobs.get(s, s) if n == self.file else s, n) for m, k, s, n in inner
                ]
                new_blocks = _make_tree(self.repo, self.lock, inner)
                top = [(m, k, new_blocks if n == BLOCKS_DIR else s, n) for m, k, s, n in top]
                new = _make_tree(self.repo, self.lock, top)
        trees[tree] = new
        return new


def main_commits(repo: git.Repo, lock: int) -> list[str]:
    """Every commit of main, parents before children."""
    out = _git(repo, lock, "rev-list", "--reverse", "--topo-order", BRANCH_REF)
    return out.decode().split()


def plan_rewrite(
    repo: git.Repo,
    lock: int,
    head: str,
    *,
    label: str,
    text: str,
    check: Callable[[str, str], None],
) -> "_Rewriter":
    """Read main's history and check every version of block `label` holding `text` once it
    is replaced (`check(commit, redacted text)` raises for an invalid block); nothing is
    written. OperationNotApplicable when no version holds the text."""
    commits = main_commits(repo, lock)
    if not commits or commits[-1] != head:
        raise DurableMemoryError(f"main moved while it was read ({head[:12]})")
    rewriter = _Rewriter(repo, lock, label, text, commits)
    rewriter.plan(check)
    if not rewriter.blobs:
        raise OperationNotApplicable(
            f"no version of block '{label}' holds the text to redact: nothing was changed"
        )
    return rewriter


def versions_holding(repo: git.Repo, lock: int, *, label: str, text: str) -> int:
    """How many versions of block `label` on main hold `text` (nothing checked or written)."""
    rewriter = _Rewriter(repo, lock, label, text, main_commits(repo, lock))
    rewriter.plan(lambda _sha, _text: None)
    return len(rewriter.blobs)


def rewrite_history(
    repo: git.Repo,
    lock: int,
    head: str,
    *,
    label: str,
    text: str,
    check: Callable[[str, str], None],
    record: Callable[[dict[str, str], int], tuple[str, Author]],
) -> RewrittenHistory:
    """Build main's history with `text` replaced by REDACTED in block `label` and the messages
    (`plan_rewrite` first: a refusal writes nothing), and the record on top (`record(old ->
    new, versions)`: its message and author); main is not moved (see `move_main`)."""
    rewriter = plan_rewrite(repo, lock, head, label=label, text=text, check=check)
    mapped = rewriter.write()
    message, author = record(mapped, len(rewriter.blobs))
    actor = author_actor(author)
    stamp = f"{int(datetime.now(UTC).timestamp())} +0000"
    tree = _git(repo, lock, "rev-parse", f"{mapped[head]}^{{tree}}").decode().strip()
    data = (
        f"tree {tree}\nparent {mapped[head]}\n"
        f"author {actor.name} <{actor.email}> {stamp}\n"
        f"committer durable-memory <durable-memory@localhost> {stamp}\n\n{message}"
    ).encode()
    tip = _git(repo, lock, "hash-object", "-t", "commit", "-w", "--stdin", stdin=data)
    return RewrittenHistory(
        record=tip.decode().strip(), old_head=head, commits=mapped, versions=len(rewriter.blobs)
    )


def record_message(
    redaction_id: str, label: str, text: str, by: str, reason: str, commits: Mapping[str, str]
) -> str:
    """The redaction record's message: who, why, what (by hash), old -> new ids."""
    mapping = "\n".join(f"{old} -> {new}" for old, new in commits.items())
    return format_message(
        f"Redact a text from every version of block '{label}'",
        f"{reason}\n\nRewritten commits (old -> new):\n{mapping}",
        {
            REDACTION_ID: redaction_id,
            "Redacted-Block": label,
            "Redacted-Text-Hash": f"sha256:{text_hash(text)}",
            "Redacted-By": by,
        },
    )


def recorded_mapping(repo: git.Repo, sha: str) -> dict[str, str]:
    """The old -> new ids a redaction record lists."""
    return dict(_MAPPING_LINE.findall(message_text(repo.commit(sha))))


def recorded_trailers(repo: git.Repo, sha: str) -> dict[str, str]:
    return parse_trailers(message_text(repo.commit(sha)))


def move_main(repo: git.Repo, lock: int, new: str, old: str) -> None:
    """Point main at `new` if it still is `old` (compare-and-swap), and the index and files
    with it (`read-tree`: no ORIG_HEAD left naming the old history)."""
    if not (FULL_SHA.fullmatch(new) and FULL_SHA.fullmatch(old)):
        raise ValueError("move_main takes full commit ids")
    _git(repo, lock, "update-ref", "-m", "dmem redact", BRANCH_REF, new, old)
    result = git_process("read-tree", "-u", "--reset", new, cwd=repo.working_tree_dir, lock=lock)
    if result.returncode != 0:
        raise git.GitCommandError(["read-tree"], result.returncode, result.stderr)


def purge(repo: git.Repo, lock: int, extra_refs: tuple[str, ...] = ()) -> None:
    """Drop every object no longer reachable from main: `extra_refs` deleted, reflogs expired,
    `gc --prune=now`; and the last commit message git kept (idempotent)."""
    for ref in extra_refs:
        _git(repo, lock, "update-ref", "-d", ref)
    # `git commit` leaves the last message it wrote here: a summary may quote the text.
    Path(repo.git_dir, "COMMIT_EDITMSG").unlink(missing_ok=True)
    _git(repo, lock, "reflog", "expire", "--expire=now", "--all")
    _git(repo, lock, "gc", "--prune=now", "--quiet")


def prune_repository(path: Path) -> None:
    """`purge` for a bare repository (a remote's), no lock of ours: reflogs expired, then
    `gc --prune=now`."""
    for args in (("reflog", "expire", "--expire=now", "--all"), ("gc", "--prune=now", "--quiet")):
        result = git_process(*args, cwd=path, lock=None, timeout=600)
        if result.returncode != 0:
            raise git.GitCommandError(list(args), result.returncode, result.stderr)
