"""Blocks: a user's memory blocks as the user's profile defines them, to read and render."""

from dataclasses import dataclass

from durable_memory.memory.core.errors import (
    DurableMemoryError,
    OperationNotApplicable,
    ProfileError,
)
from durable_memory.memory.core.formats import render_prompt, to_markdown, to_toml
from durable_memory.memory.core.ids import validate_user_id
from durable_memory.memory.core.profiles import ProfileCatalog, profile_record
from durable_memory.memory.service.access import Block, BlockAccess, missing_blocks
from durable_memory.memory.store.block_repository import compare_and_set
from durable_memory.memory.store.git import format_message
from durable_memory.memory.store.users import AdmissionRead, ErasuresRead
from durable_memory.models.blocks import AgentProfile, BlockKind, BlockSpec
from durable_memory.models.history import SYSTEM_AUTHOR, CommitInfo


@dataclass(frozen=True)
class Admission:
    """A user admitted to a turn (`Blocks.admit`)."""

    head: str
    profile: AgentProfile
    erasures_seen: int
    """The newest erasure record's id when the turn was admitted (0: none): the `since` of
    the turn's later erasure checks."""


@dataclass(frozen=True)
class BlocksRead:
    """Every block at HEAD, at a base commit (None: no base, or not in HEAD's history), and
    HEAD's commit (None before the first), read in one state of the repository."""

    head: dict[str, Block]
    at_base: dict[str, Block] | None
    head_info: CommitInfo | None


@dataclass(frozen=True)
class HumanSummary:
    """get_summary() of the seed 000_d8598551964ab573.txt: usage, state, task and how many context
    notes are kept."""

    label: str
    chars: int
    limit: int
    usage: float
    session_state: str
    current_task: str | None
    context_notes: int
    preferences: int
    facts: int


class Blocks:
    def __init__(self, access: BlockAccess) -> None:
        self._access = access

    @property
    def profiles(self) -> ProfileCatalog:
        """The profiles this deployment serves; its default is a new user's."""
        return self._access.profiles

    def profile(self, user_id: str) -> AgentProfile:
        """The user's profile: the one their repository records, else the default."""
        return self._access.profile_of(user_id)

    def spec(self, user_id: str, label: str) -> BlockSpec:
        return self._access.spec(user_id, label)

    def users(self) -> list[str]:
        """Every user who has memory, on whichever host: the shared database's list (see
        store/users.py), not this host's disk."""
        return self._access.users.users()

    def drop_forgotten_clones(self) -> list[str]:
        """Delete this host's cached clones of users a forget closed (distributed mode: the
        forget itself reaches only its own host's clone); the users dropped."""
        return self._access.git.drop_clones(self._access.users.closed_among)

    def register_local_users(self) -> int:
        """Register the users whose repositories are on this host's disk (a deployment from
        before the list; idempotent); returns how many were found."""
        found = self._access.git.users()
        self._access.users.register(found)
        return len(found)

    def ensure_user(self, user_id: str, profile: str | None = None, *, fresh: bool = False) -> str:
        """Create the user's repository with every block of their profile at its default, and
        the record naming the profile (`profile`, else the deployment's default); idempotent.

        A user who has a profile keeps it: naming another is refused (ProfileError), as a
        change is an explicit operation (`DirectEdits.set_profile`). Blocks the profile gained
        since are added in a commit of their own; so is the record, for a repository made
        before profiles were recorded (it keeps the default it was made with).

        A forgotten user is not made again (UserForgotten) unless `fresh`: a caller starting
        them afresh on purpose; nothing is made while their forget is under way.
        """
        return self._ensure(user_id, profile, fresh).head

    def admit(
        self,
        user_id: str,
        profile: str | None = None,
        *,
        fresh: bool = False,
        read: AdmissionRead | None = None,
    ) -> Admission:
        """`ensure_user` for a turn's first step: the profile the user has, read in the same
        transaction (one lock and repair check instead of two), and what the turn's later
        erasure checks pass as `since` (`refuse_if_forgotten`). `read`: the turn's admission
        read (`admission`), on which the erasure check is decided and which says whether the
        user is listed already, instead of reading both again."""
        return self._ensure(user_id, profile, fresh, read)

    def admission(self, user_id: str) -> AdmissionRead:
        """The erasure records, the redaction under way and the listing of the user, in one
        read: what a turn's admission decides on (store/users.py)."""
        return self._access.users.admission(validate_user_id(user_id))

    def _ensure(
        self, user_id: str, profile: str | None, fresh: bool, read: AdmissionRead | None = None
    ) -> Admission:
        validate_user_id(user_id)
        users = self._access.users
        if profile is not None:
            self._access.profiles.get(profile)  # an unknown name is refused before anything
        if fresh:
            users.readmit(user_id)
            read = None  # read before the readmit: the ledger is asked again
        erasures_seen = users.refuse_if_forgotten(user_id, read=read)
        head, chosen = self._ensure_repository(user_id, profile)
        if read is None or not read.listed:
            users.register([user_id])  # after the repository exists
        return Admission(head, chosen, erasures_seen)

    @compare_and_set
    def _ensure_repository(self, user_id: str, profile: str | None) -> tuple[str, AgentProfile]:
        profiles = self._access.profiles
        with self._access.git.transaction(user_id, create=True) as tx:
            recorded = self._access.recorded_profile(tx)
            name = recorded or (profile if tx.head is None and profile else profiles.default_name)
            chosen = self._access.profile_in(tx) if recorded else profiles.get(name)
            if profile is not None and profiles.get(profile) != chosen:
                raise ProfileError(
                    f"user '{user_id}' has profile '{name}', not '{profile}'; a turn cannot "
                    f"change it: change it with `dmem profile set {user_id} {profile}` "
                    "(MemoryClient.set_profile), which checks that their blocks fit"
                )
            missing = missing_blocks(tx, chosen)
            if not missing and recorded is not None and tx.head is not None:
                return tx.head, chosen
            if tx.head is None:
                summary = f"Create memory: {', '.join(missing)}"
            elif missing:
                summary = f"Add new profile blocks: {', '.join(missing)}"
            else:
                summary = f"Record profile {name}"
            message = format_message(summary, trailers={"Profile": name})
            head = tx.commit(
                missing, message, SYSTEM_AUTHOR, allow_empty=True, profile=profile_record(name)
            )
            return head, chosen

    def read_block(self, user_id: str, label: str) -> Block:
        return self._access.read_block(user_id, label)

    def read_block_at(self, user_id: str, label: str, sha: str) -> Block:
        spec = self.spec(user_id, label)
        return Block(label, spec, self._access.read_at(user_id, label, sha), sha)

    def refuse_if_forgotten(
        self,
        user_id: str,
        since: int | None = None,
        *,
        read: AdmissionRead | ErasuresRead | None = None,
    ) -> int:
        """UserBeingForgotten / UserForgotten: for a step about to write for the user. `since`:
        what the turn's first check returned (a forget begun after it refuses the turn even
        once the user was started afresh); returns what to pass as `since`. `read`: decided
        on the records of that admission read (`admission`), or of `erasures_read`'s, made by
        the caller just now."""
        return self._access.users.refuse_if_forgotten(user_id, since, read=read)

    def read_blocks_and_base(self, user_id: str, base: str | None) -> BlocksRead:
        """Every block at HEAD, and at commit `base` if that is in HEAD's history (None if it
        is not, or is None), and HEAD's commit: one transaction, so one state of the
        repository (and one lock and repair check, not one per read)."""
        with self._access.git.transaction(user_id) as tx:
            specs = self._access.profile_in(tx).blocks
            parse = self._access.parse
            head = {s.label: Block(s.label, s, parse(tx, s), tx.head) for s in specs}
            at_base: dict[str, Block] | None = None
            if base == tx.head:  # the usual turn: nothing committed since the base
                at_base = head
            elif base is not None and tx.in_history(base):
                at_base = {s.label: Block(s.label, s, parse(tx, s, base), base) for s in specs}
            return BlocksRead(head, at_base, tx.head_info())

    def read_blocks(self, user_id: str) -> dict[str, Block]:
        """Every block of the user's profile at HEAD, in profile order (a block the repository
        lacks at its default)."""
        return self.read_blocks_and_base(user_id, None).head

    def last_change(self, user_id: str) -> CommitInfo | None:
        """The commit that last changed the user's blocks; None before the first."""
        return self._access.git.head_info(user_id)

    def for_editing(self, user_id: str, label: str) -> tuple[str, str | None]:
        """The block's Markdown form and the commit it was read at: pass that commit as the
        edit's `based_on`, so an edit made on it never undoes a change landed meanwhile."""
        block = self.read_block(user_id, label)
        return to_markdown(block.spec, block.fields), block.sha

    def render(self, user_id: str, label: str, fmt: str) -> str:
        """A block as `toml` (stored form), `markdown` (editing form) or `prompt` (Letta)."""
        block = self.read_block(user_id, label)
        renderers = {"toml": to_toml, "markdown": to_markdown, "prompt": render_prompt}
        if fmt not in renderers:
            raise DurableMemoryError(f"unknown format {fmt!r}; use toml, markdown or prompt")
        return renderers[fmt](block.spec, block.fields)

    def summary(self, user_id: str, label: str = "human") -> HumanSummary:
        block = self.read_block(user_id, label)
        if block.spec.kind is not BlockKind.HUMAN:
            raise OperationNotApplicable(f"block '{label}' is not a human block")
        chars = len(block.value)
        notes = block.fields.get("context_notes") or []
        task = block.fields.get("current_task")
        return HumanSummary(
            label=label,
            chars=chars,
            limit=block.spec.limit,
            usage=chars / block.spec.limit,
            session_state=str(block.fields.get("session_state")),
            current_task=task if isinstance(task, str) else None,
            context_notes=len(notes),
            preferences=len(block.fields.get("preferences") or []),
            facts=len(block.fields.get("facts") or []),
        )
