"""One user's repository while its lock is held: reads from HEAD or any commit (never from the
working tree, so a half-written or hand-edited file cannot leak into memory), the history walk
by trailer, and commits that refuse to carry along changes made by hand."""

import contextlib
import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import git

from durable_memory.memory.core.errors import HandEditPending, UnknownCommit, UnsafeFile
from durable_memory.memory.store.git.commits import RepoOpener, write_commit
from durable_memory.memory.store.git.layout import (
    BLOCKS_DIR,
    POLICIES_FILE,
    PROFILE_FILE,
    RECORD_FILES,
    block_path,
    open_blocks_dir,
    open_user_dir,
)
from durable_memory.memory.store.git.messages import commit_info, message_text, parse_trailers
from durable_memory.memory.store.git.refs import FULL_SHA
from durable_memory.memory.store.git.snapshots import Snapshot, SnapshotCache, load_snapshot
from durable_memory.memory.store.safe_files import decode_utf8, read_bytes_at
from durable_memory.models.history import Author, CommitInfo

CLOCK_SKEW = timedelta(hours=1)
"""How far apart two machines' clocks may be when one bounds a history walk by the other's
timestamp (see `find_trailer`)."""


def _blob_sha(text: str) -> bytes:
    """The id git gives a file with this content (what the index stores for it)."""
    data = text.encode("utf-8")
    return hashlib.sha1(b"blob %d\x00" % len(data) + data, usedforsecurity=False).digest()


_RECORD_COMMANDS = {PROFILE_FILE: "dmem profile set", POLICIES_FILE: "dmem policy set|revoke"}
"""The command that changes each record (named when a hand edit is in the way)."""


@dataclass
class RepoTransaction:
    """Read-modify-write access to one user's repository while holding its lock."""

    open_repo: RepoOpener
    """The repository, opened at its first use (`repo`): a read of cached snapshots needs
    none."""
    lock: int
    """The descriptor holding the user's flock, passed on to the git commands that write."""
    user_id: str
    users_dir: Path
    head: str | None
    """Verified readable by recovery. Nothing else writes while we hold the lock, so HEAD is
    read once per transaction."""
    cache: SnapshotCache = field(default_factory=SnapshotCache)

    @property
    def repo(self) -> git.Repo:
        return self.open_repo()

    def snapshot(self, sha: str) -> Snapshot:
        """The commit's block files and author (cached); `sha` must be a full commit id."""
        return load_snapshot(self.open_repo, self.user_id, sha, self.cache)

    def read(self, label: str, sha: str | None = None) -> str | None:
        """The block file at `sha` (default HEAD), or None if it does not exist there.

        A symlink, a submodule or bytes that are not UTF-8 committed as the block are refused;
        a `sha` that names no commit here is UnknownCommit."""
        path = block_path(label)
        rev = sha or self.head
        if rev is None:
            return None
        if sha is not None:
            rev = self.commit_id(sha)
        elif not FULL_SHA.fullmatch(rev):
            rev = self.repo.commit(rev).hexsha
        snapshot = self.snapshot(rev)
        for refused in (BLOCKS_DIR, path):
            if refused in snapshot.refused:
                raise UnsafeFile(
                    f"users/{self.user_id}/{refused} at {rev[:12]} is "
                    f"{snapshot.refused[refused]}: refused, nothing was read from it"
                )
        return snapshot.blocks.get(label)

    def commit_id(self, sha: str) -> str:
        """The full id of the commit `sha` (full or abbreviated) names in this repository."""
        unknown = UnknownCommit(f"no commit {sha[:45]} in the memory of user '{self.user_id}'")
        try:
            commit = self.repo.commit(sha)
            # A full id is taken on trust until it is used: ask what it names, if anything.
            if self.repo.odb.info(commit.binsha).type != b"commit":
                raise unknown
        except (git.BadName, ValueError):
            raise unknown from None
        return str(commit.hexsha)

    def read_record(self, name: str) -> str | None:
        """HEAD's record `name` (one of `RECORD_FILES`), None if it has none. A symlink, a
        submodule or bytes that are not UTF-8 committed there are refused."""
        if self.head is None:
            return None
        snapshot = self.snapshot(self.head)
        if name in snapshot.refused:
            raise UnsafeFile(
                f"users/{self.user_id}/{name} at {self.head[:12]} is "
                f"{snapshot.refused[name]}: refused, nothing was read from it"
            )
        return snapshot.records.get(name)

    def read_profile(self) -> str | None:
        """HEAD's profile record (`profile.toml`), None if it has none."""
        return self.read_record(PROFILE_FILE)

    def read_policies(self) -> str | None:
        """HEAD's standing approvals (`policies.toml`), None if it has none."""
        return self.read_record(POLICIES_FILE)

    def _record_working_copy(self, name: str) -> str | None:
        shown = f"users/{self.user_id}/{name}"
        with open_user_dir(self.users_dir, self.user_id) as top:
            data = read_bytes_at(top, name, shown)
        return None if data is None else decode_utf8(data, shown)

    def labels(self) -> list[str]:
        return sorted(self.snapshot(self.head).blocks) if self.head else []

    def head_info(self) -> CommitInfo | None:
        return self.snapshot(self.head).info if self.head else None

    def _blocks_dir(self) -> contextlib.AbstractContextManager[int]:
        return open_blocks_dir(self.users_dir, self.user_id)

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

    def in_history(self, sha: str) -> bool:
        if self.head is None or not FULL_SHA.fullmatch(sha):
            return False
        if sha == self.head:
            return True
        try:
            return self.repo.is_ancestor(self.repo.commit(sha), self.repo.commit(self.head))
        except (git.GitCommandError, ValueError):  # not a commit, or no object at all
            return False

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
            if parse_trailers(message_text(self.repo.commit(sha))).get(key) == value:
                return sha
        return None

    def _staged_by_hand(
        self, head: Mapping[str, str], records: Mapping[str, str | None]
    ) -> list[str]:
        """Block files (and records) whose staged content is not HEAD's (`head`, `records`):
        someone ran `git add` by hand. Committing now would carry that unvalidated content
        into memory with ours."""
        expected = {f"{BLOCKS_DIR}/{label}.toml": _blob_sha(text) for label, text in head.items()}
        expected.update(
            {name: _blob_sha(text) for name, text in records.items() if text is not None}
        )
        staged = {
            str(path): entry.binsha
            for (path, _stage), entry in self.repo.index.entries.items()
            if (str(path).startswith(f"{BLOCKS_DIR}/") and str(path).endswith(".toml"))
            or str(path) in RECORD_FILES
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
        profile: str | None = None,
        policies: str | None = None,
    ) -> str:
        """Write `files` (label -> TOML text), and `profile` as the profile record and
        `policies` as the standing approvals if given, and commit them. Returns the new commit
        sha.

        A change that alters nothing returns HEAD without a commit unless `allow_empty`.
        """
        changed = {label: text for label, text in files.items() if self.read(label) != text}
        head_records = {name: self.read_record(name) for name in RECORD_FILES}
        wanted = {PROFILE_FILE: profile, POLICIES_FILE: policies}
        new_records = {
            name: text
            for name, text in wanted.items()
            if text is not None and text != head_records[name]
        }
        if not changed and not new_records and not allow_empty and self.head is not None:
            return self.head
        for name in new_records:
            if self._record_working_copy(name) not in (None, head_records[name]):
                raise HandEditPending(
                    f"{name} of user '{self.user_id}' has changes made by hand that are not "
                    f"committed; discard them with `git checkout`, and change it with "
                    f"`{_RECORD_COMMANDS[name]}`, then try again"
                )
        for label in () if overwrite_hand_edits else changed:
            on_disk = self.working_copy(label)
            if on_disk is not None and on_disk != self.read(label):
                raise HandEditPending(
                    f"{block_path(label)} of user '{self.user_id}' has changes made by hand that "
                    "are not committed; commit them with `dmem import` (validated) or discard "
                    "them with `git checkout`, then try again"
                )
        before = self.snapshot(self.head).blocks if self.head else {}
        staged = self._staged_by_hand(before, head_records)
        if staged:
            raise HandEditPending(
                f"{', '.join(staged)} of user '{self.user_id}' has changes staged by hand "
                "(git add) that are not committed; commit them with `dmem import` (validated) "
                "or unstage them with `git reset`, then try again"
            )
        new = write_commit(
            self.repo,
            self.lock,
            self.users_dir,
            self.user_id,
            self.head,
            changed,
            message,
            author,
            records=new_records,
        )
        # The index held HEAD plus our files (checked above), so this is the new commit.
        self.head = new
        snapshot = Snapshot(
            blocks={**before, **changed},
            info=commit_info(self.repo.commit(new)),
            records={
                name: text
                for name, text in {**head_records, **new_records}.items()
                if text is not None
            },
        )
        self.cache.put(self.user_id, new, snapshot)
        return new
