"""History: every version of a block is a commit; read them, compare them, bring one back,
and take in what a person changed by hand: in the repository's working tree, or (a host whose
repositories are a git remote's disposable clones) in a directory of block files."""

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from durable_memory.memory.core.errors import UnsafeFile
from durable_memory.memory.core.formats import from_toml, to_toml
from durable_memory.memory.service.access import BlockAccess
from durable_memory.memory.store.block_repository import compare_and_set
from durable_memory.memory.store.git import BLOCKS_DIR, block_path, format_message
from durable_memory.memory.store.safe_files import decode_utf8, open_dir, read_bytes_at
from durable_memory.models.blocks import BlockFields
from durable_memory.models.history import Author, CommitInfo


class HandEditedFiles(Protocol):
    """Where a person left edited block files: `blocks/<label>.toml` under some directory."""

    def working_files(self) -> list[str]:
        """The names in its `blocks/` directory."""
        ...

    def working_copy(self, label: str) -> str | None:
        """The block's file as the person left it, None if absent."""
        ...


@dataclass(frozen=True)
class EditedDirectory:
    """A directory laid out as a user's repository (`blocks/<label>.toml`), e.g. a checkout of
    it, read as untrusted input: no symlink followed, no FIFO or device opened, UTF-8 only."""

    path: Path

    def working_files(self) -> list[str]:
        try:
            with open_dir(self.path, [BLOCKS_DIR], str(self.path)) as blocks:
                return sorted(os.listdir(blocks))
        except FileNotFoundError:
            return []

    def working_copy(self, label: str) -> str | None:
        shown = str(self.path / block_path(label))
        try:
            with open_dir(self.path, [BLOCKS_DIR], str(self.path)) as blocks:
                data = read_bytes_at(blocks, f"{label}.toml", shown)
        except FileNotFoundError:
            return None
        return None if data is None else decode_utf8(data, shown)


class History:
    def __init__(self, access: BlockAccess) -> None:
        self._access = access

    def history(self, user_id: str, label: str, limit: int = 20) -> list[CommitInfo]:
        """The commits that changed the block, newest first."""
        return self._access.git.history(user_id, self._access.spec(user_id, label).label, limit)

    def log(self, user_id: str, limit: int = 20) -> list[CommitInfo]:
        """The commits of the user's whole repository, newest first."""
        return self._access.git.history(user_id, None, limit)

    def read_at(self, user_id: str, label: str, sha: str) -> BlockFields:
        return self._access.read_at(user_id, label, sha)

    def diff(self, user_id: str, label: str, a: str, b: str) -> str:
        return self._access.git.diff(user_id, self._access.spec(user_id, label).label, a, b)

    def restore(self, user_id: str, label: str, sha: str, author: Author) -> str:
        """Bring back the block as it was at `sha`, as a new commit; history is never rewritten.
        Never into the new memory of a user forgotten and started afresh while it ran."""
        seen = self._access.users.refuse_if_forgotten(user_id)
        fields = self.read_at(user_id, label, sha)
        return self._access.commit_fields(
            user_id,
            label,
            fields,
            author,
            f"Restore {label} to {sha[:12]}",
            {"Restored-From": sha},
            since=seen,
        )

    @compare_and_set
    def commit_hand_edits(
        self, user_id: str, author: Author, edited: EditedDirectory | None = None
    ) -> str | None:
        """Validate block files changed by hand and commit them together: those in `edited`,
        else those in the repository's working tree (which they then replace, normalised).

        Any invalid file refuses the whole import with the file, the line and the reason; so
        does anything in `blocks/` that is not a block file of the profile (another name, a
        subdirectory: it would not be imported, and the person should know), a symlink, a FIFO
        or a device in place of a block file, or bytes that are not UTF-8 (`UnsafeFile`).
        Returns the new commit sha, or None if nothing was changed by hand.
        """
        where = f"users/{user_id}" if edited is None else str(edited.path)
        with self._access.git.transaction(user_id) as tx:
            files: HandEditedFiles = tx if edited is None else edited
            profile = self._access.profile_in(tx)
            expected = {f"{spec.label}.toml" for spec in profile.blocks}
            unknown = [name for name in files.working_files() if name not in expected]
            if unknown:
                raise UnsafeFile(
                    f"{where}/{BLOCKS_DIR} holds files that are not blocks of profile "
                    f"'{profile.name}': {', '.join(repr(n) for n in unknown)}; move them out "
                    "of blocks/ and import again (nothing was imported)"
                )
            changed: dict[str, str] = {}
            for spec in profile.blocks:
                on_disk = files.working_copy(spec.label)
                if on_disk is not None and on_disk != tx.read(spec.label):
                    fields = from_toml(spec, on_disk, f"{where}/{block_path(spec.label)}")
                    changed[spec.label] = to_toml(spec, fields)
            if not changed:
                return None
            message = format_message(f"Import hand edits: {', '.join(changed)}")
            # The working copies are replaced by their normalised form, which is what we
            # commit; a directory's import leaves hand edits in the repository to their own.
            return tx.commit(changed, message, author, overwrite_hand_edits=edited is None)
