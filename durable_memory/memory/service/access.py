"""What the faces share: a user's blocks, as the user's profile defines them, in the user's
git repository, read and committed.

Every face (blocks, edits, review, history) holds the one `BlockAccess` of its stack, so a
block is parsed, validated and committed the same way whichever face changes it. The profile
is the user's own: the one their repository records (`profile.toml`), else the deployment's
default (a repository made before profiles were recorded per user).
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol

from durable_memory.memory.core.blocks import default_fields, render_value, validate_fields
from durable_memory.memory.core.errors import (
    BlockChanged,
    DurableMemoryError,
    OperationNotApplicable,
    ProfileError,
    UnknownBlock,
    UnknownUser,
)
from durable_memory.memory.core.formats import from_toml, to_toml
from durable_memory.memory.core.ids import validate_label
from durable_memory.memory.core.operations import apply_operation, format_task_archive
from durable_memory.memory.core.profiles import ProfileCatalog, read_profile_record
from durable_memory.memory.store.block_repository import (
    BlockRepository,
    BlockTransaction,
    compare_and_set,
)
from durable_memory.memory.store.git import (
    PROFILE_FILE,
    block_path,
    format_message,
    validate_author_name,
)
from durable_memory.memory.store.users import UserDirectory
from durable_memory.models.blocks import AgentProfile, BlockFields, BlockSpec
from durable_memory.models.history import Author
from durable_memory.models.operations import EditOperation


class TaskArchive(Protocol):
    """Where clear_task(archive=True) puts the finished task (archival memory)."""

    def archive_task(
        self,
        user_id: str,
        text: str,
        *,
        dedupe_key: str,
        before_write: Callable[[], object] | None = None,
    ) -> list[str]:
        """Store the task text; the same `dedupe_key` again stores nothing (a retry).
        `before_write` runs between the text's embedding (seconds) and its write, and what it
        raises leaves the archive as it was."""
        ...


@dataclass(frozen=True)
class Block:
    label: str
    spec: BlockSpec
    fields: BlockFields
    sha: str | None

    @property
    def value(self) -> str:
        return render_value(self.spec, self.fields)


def _record_path(tx: BlockTransaction) -> str:
    return f"users/{tx.user_id}/{PROFILE_FILE} at {(tx.head or '')[:12]}"


def block_spec(profile: AgentProfile, label: str) -> BlockSpec:
    """The block `label` of `profile`; UnknownBlock, naming the profile's blocks, otherwise."""
    spec = profile.block(validate_label(label))
    if spec is None:
        raise UnknownBlock(
            f"no block '{label}' in profile '{profile.name}'; its blocks are "
            f"{', '.join(b.label for b in profile.blocks)}"
        )
    return spec


def require_unchanged_since(tx: BlockTransaction, label: str, based_on: str) -> None:
    """BlockChanged unless the block at HEAD is as it was at commit `based_on` (UnknownCommit
    if that names no commit of the user's)."""
    if tx.read(label, based_on) != tx.read(label):
        raise BlockChanged(
            f"block '{label}' changed since {based_on[:12]}, the version this edit started "
            "from (an approval or another edit landed meanwhile); nothing was committed: "
            "open the block again and redo the edit on its current text"
        )


def missing_blocks(tx: BlockTransaction, profile: AgentProfile) -> dict[str, str]:
    """The profile's blocks the repository lacks, with their default values (label -> TOML)."""
    return {
        spec.label: to_toml(spec, default_fields(spec))
        for spec in profile.blocks
        if tx.read(spec.label) is None
    }


class BlockAccess:
    def __init__(
        self,
        profiles: ProfileCatalog,
        git: BlockRepository,
        users: UserDirectory,
        archive: TaskArchive | None = None,
    ) -> None:
        self.profiles = profiles
        self.git = git
        self.users = users
        self.archive = archive

    def recorded_profile(self, tx: BlockTransaction) -> str | None:
        """The profile name the user's repository records at HEAD, None if it records none."""
        text = tx.read_profile()
        return None if text is None else read_profile_record(text, _record_path(tx))

    def profile_in(self, tx: BlockTransaction) -> AgentProfile:
        """The user's profile: the one recorded, else the deployment's default."""
        name = self.recorded_profile(tx)
        if name is None:
            return self.profiles.default
        try:
            return self.profiles.get(name)
        except ProfileError as error:  # recorded by another deployment, or by hand
            raise ProfileError(
                f"{_record_path(tx)}: {error} (change the user's profile with `dmem profile set`)"
            ) from None

    def profile_of(self, user_id: str) -> AgentProfile:
        with self.git.transaction(user_id) as tx:
            return self.profile_in(tx)

    def spec(self, user_id: str, label: str) -> BlockSpec:
        return block_spec(self.profile_of(user_id), label)

    def parse(self, tx: BlockTransaction, spec: BlockSpec, sha: str | None = None) -> BlockFields:
        text = tx.read(spec.label, sha)
        if text is None:
            return default_fields(spec)
        where = f"users/{tx.user_id}/{block_path(spec.label)}"
        return from_toml(
            spec, text, f"{where} at {(sha or tx.head or '')[:12]}", enforce_limit=False
        )

    def read_block(self, user_id: str, label: str) -> Block:
        validate_label(label)
        with self.git.transaction(user_id) as tx:
            spec = block_spec(self.profile_in(tx), label)
            return Block(label, spec, self.parse(tx, spec), tx.head)

    def read_at(self, user_id: str, label: str, sha: str) -> BlockFields:
        spec = self.spec(user_id, label)
        text = self.git.read_at(user_id, label, sha)
        where = f"users/{user_id}/{block_path(label)} at {sha[:12]}"
        return from_toml(spec, text, where, enforce_limit=False)

    @compare_and_set
    def commit_fields(
        self,
        user_id: str,
        label: str,
        fields: Mapping[str, object] | EditOperation,
        author: Author,
        summary: str,
        trailers: Mapping[str, str] | None = None,
        based_on: str | None = None,
        since: int | None = None,
    ) -> str:
        """Commit the block with `fields` (validated) or with `op` applied to its HEAD. With
        `based_on` (the commit whose version of the block the writer started from), refused
        with BlockChanged if the block has changed since: a whole-block write never undoes a
        change its writer did not see.

        Refused for a user closed to memory (UserBeingForgotten, UserForgotten), checked under
        the repository's lock, which a forget's deletion of it takes too; given `since` (what
        the erasure check before the writer read the user's memory returned), also for a user
        forgotten since and started afresh: what was read is of the memory that forget erased."""
        validate_label(label)
        validate_author_name(author.name)
        try:
            with self.git.transaction(user_id) as tx:
                self.users.refuse_if_forgotten(user_id, since)
                spec = block_spec(self.profile_in(tx), label)
                if based_on is not None:
                    require_unchanged_since(tx, label, based_on)
                if isinstance(fields, Mapping):
                    new = validate_fields(spec, fields)
                else:
                    new = apply_operation(spec, self.parse(tx, spec), fields)
                return tx.commit(
                    {label: to_toml(spec, new)}, format_message(summary, "", trailers), author
                )
        except UnknownUser:  # no repository: if a forget deleted it, that is the answer
            self.users.refuse_if_forgotten(user_id, since)
            raise

    def require_archive(self) -> TaskArchive:
        if self.archive is None:
            raise DurableMemoryError(
                "clear_task(archive=True) needs archival memory, and none is configured"
            )
        return self.archive

    def archive_task(self, user_id: str, spec: BlockSpec, since: int) -> None:
        """The block's current task into archival memory, keyed by the block's commit.

        `since`: what the caller's erasure check returned, made before it read anything (it
        refused a user closed to memory then). Checked again between the text's embedding
        (seconds) and its write: a forget begun since leaves nothing archived, even once the
        user was started afresh, since the text is of the memory it erased."""
        archive = self.require_archive()
        block = self.read_block(user_id, spec.label)
        if not block.fields.get("current_task"):
            raise OperationNotApplicable(f"block '{spec.label}' has no current task to archive")
        text = format_task_archive(block.fields, datetime.now(UTC))
        key = f"{spec.label}@{block.sha}\n{block.fields.get('current_task')}"
        archive.archive_task(
            user_id,
            text,
            dedupe_key=key,
            before_write=lambda: self.users.refuse_if_forgotten(user_id, since),
        )
