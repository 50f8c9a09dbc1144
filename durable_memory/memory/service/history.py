"""History: every version of a block is a commit; read them, compare them, bring one back,
and take in what a person changed by hand in the repository's working tree."""

from durable_memory.memory.core.errors import UnsafeFile
from durable_memory.memory.core.formats import from_toml, to_toml
from durable_memory.memory.service.access import BlockAccess
from durable_memory.memory.store.block_repository import compare_and_set
from durable_memory.memory.store.git import BLOCKS_DIR, block_path, format_message
from durable_memory.models.blocks import BlockFields
from durable_memory.models.history import Author, CommitInfo


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
        """Bring back the block as it was at `sha`, as a new commit; history is never rewritten."""
        fields = self.read_at(user_id, label, sha)
        return self._access.commit_fields(
            user_id,
            label,
            fields,
            author,
            f"Restore {label} to {sha[:12]}",
            {"Restored-From": sha},
        )

    @compare_and_set
    def commit_hand_edits(self, user_id: str, author: Author) -> str | None:
        """Validate block files changed by hand in the working tree and commit them together.

        Any invalid file refuses the whole import with the file, the line and the reason; so
        does anything in `blocks/` that is not a block file of the profile (another name, a
        subdirectory: it would not be imported, and the person should know), a symlink, a FIFO
        or a device in place of a block file, or bytes that are not UTF-8 (`UnsafeFile`).
        Returns the new commit sha, or None if nothing was changed by hand.
        """
        with self._access.git.transaction(user_id) as tx:
            profile = self._access.profile_in(tx)
            expected = {f"{spec.label}.toml" for spec in profile.blocks}
            unknown = [name for name in tx.working_files() if name not in expected]
            if unknown:
                raise UnsafeFile(
                    f"users/{user_id}/{BLOCKS_DIR} holds files that are not blocks of profile "
                    f"'{profile.name}': {', '.join(repr(n) for n in unknown)}; move them out "
                    "of blocks/ and import again (nothing was imported)"
                )
            changed: dict[str, str] = {}
            for spec in profile.blocks:
                on_disk = tx.working_copy(spec.label)
                if on_disk is not None and on_disk != tx.read(spec.label):
                    fields = from_toml(spec, on_disk, f"users/{user_id}/{block_path(spec.label)}")
                    changed[spec.label] = to_toml(spec, fields)
            if not changed:
                return None
            message = format_message(f"Import hand edits: {', '.join(changed)}")
            # The working copies are replaced by their normalised form, which is what we commit.
            return tx.commit(changed, message, author, overwrite_hand_edits=True)
