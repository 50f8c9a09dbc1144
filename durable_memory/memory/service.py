"""MemoryService: the memory core's public face. Profiles + git store + pending diffs + recall.

Who may change memory, and how:
- a user editing their own memory (`edit_block`, `restore`): committed directly, author = user;
- a backend service calling a domain operation (`apply_direct`, `set_task`, ...): committed
  directly, author = the service;
- the model (`propose`): never changes memory; it creates a PendingDiff that a human approves
  (`approve`, committed with author = the approver) or rejects.
"""

import difflib
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol

from durable_memory.memory.core.blocks import default_fields, render_value, validate_fields
from durable_memory.memory.core.errors import (
    BlockValidationError,
    DecisionRefused,
    DiffAlreadyDecided,
    DurableMemoryError,
    OperationNotApplicable,
    ReadOnlyBlock,
    UnknownBlock,
    UnsafeFile,
)
from durable_memory.memory.core.formats import (
    from_markdown,
    from_toml,
    render_prompt,
    to_markdown,
    to_toml,
)
from durable_memory.memory.core.ids import validate_label, validate_user_id
from durable_memory.memory.core.operations import (
    apply_operation,
    conflict_reason,
    describe,
    format_task_archive,
)
from durable_memory.memory.store.diffs import DiffStore
from durable_memory.memory.store.git import (
    BLOCKS_DIR,
    GitBlockStore,
    RepoTransaction,
    block_path,
    format_message,
    validate_author_name,
)
from durable_memory.memory.store.recall import RecallStore
from durable_memory.models.blocks import AgentProfile, BlockFields, BlockKind, BlockSpec
from durable_memory.models.diffs import DiffStatus, PendingDiff
from durable_memory.models.history import Author, AuthorKind, CommitInfo
from durable_memory.models.operations import (
    AddContext,
    ClearTask,
    EditOperation,
    LearnFact,
    LearnPreference,
    ReplaceFields,
    RethinkText,
    SetTask,
)

SYSTEM = Author(name="durable-memory", kind=AuthorKind.SYSTEM)


class TaskArchive(Protocol):
    """Where clear_task(archive=True) puts the finished task (archival memory)."""

    def archive_task(self, user_id: str, text: str, *, dedupe_key: str) -> list[str]:
        """Store the task text; the same `dedupe_key` again stores nothing (a retry)."""
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


class MemoryService:
    def __init__(
        self,
        profile: AgentProfile,
        git: GitBlockStore,
        diffs: DiffStore,
        recall: RecallStore,
        archive: TaskArchive | None = None,
    ) -> None:
        self.profile = profile
        self.git = git
        self.diffs = diffs
        self.recall = recall
        self.archive = archive

    # -- blocks ---------------------------------------------------------------------------

    def spec(self, label: str) -> BlockSpec:
        spec = self.profile.block(validate_label(label))
        if spec is None:
            raise UnknownBlock(
                f"no block '{label}' in profile '{self.profile.name}'; its blocks are "
                f"{', '.join(b.label for b in self.profile.blocks)}"
            )
        return spec

    def ensure_user(self, user_id: str) -> str:
        """Create the user's repository with every profile block at its default; idempotent.

        Blocks the profile gained since are added in a commit of their own.
        """
        validate_user_id(user_id)
        with self.git.transaction(user_id, create=True) as tx:
            missing = {
                spec.label: to_toml(spec, default_fields(spec))
                for spec in self.profile.blocks
                if tx.read(spec.label) is None
            }
            if not missing and tx.head is not None:
                return tx.head
            summary = "Create memory" if tx.head is None else "Add new profile blocks"
            message = format_message(
                f"{summary}: {', '.join(missing)}", trailers={"Profile": self.profile.name}
            )
            return tx.commit(missing, message, SYSTEM, allow_empty=True)

    def _parse(self, tx: RepoTransaction, spec: BlockSpec, sha: str | None = None) -> BlockFields:
        text = tx.read(spec.label, sha)
        if text is None:
            return default_fields(spec)
        where = f"users/{tx.user_id}/{block_path(spec.label)}"
        return from_toml(
            spec, text, f"{where} at {(sha or tx.head or '')[:12]}", enforce_limit=False
        )

    def read_block(self, user_id: str, label: str) -> Block:
        spec = self.spec(label)
        with self.git.transaction(user_id) as tx:
            return Block(label, spec, self._parse(tx, spec), tx.head)

    def read_block_at(self, user_id: str, label: str, sha: str) -> Block:
        return Block(label, self.spec(label), self.read_at(user_id, label, sha), sha)

    def read_blocks(self, user_id: str) -> dict[str, Block]:
        """Every block of the profile, in profile order."""
        with self.git.transaction(user_id) as tx:
            return {
                spec.label: Block(spec.label, spec, self._parse(tx, spec), tx.head)
                for spec in self.profile.blocks
            }

    def render(self, user_id: str, label: str, fmt: str) -> str:
        """A block as `toml` (stored form), `markdown` (editing form) or `prompt` (Letta)."""
        block = self.read_block(user_id, label)
        renderers = {"toml": to_toml, "markdown": to_markdown, "prompt": render_prompt}
        if fmt not in renderers:
            raise DurableMemoryError(f"unknown format {fmt!r}; use toml, markdown or prompt")
        return renderers[fmt](block.spec, block.fields)

    def _commit_fields(
        self,
        user_id: str,
        label: str,
        fields: Mapping[str, object] | EditOperation,
        author: Author,
        summary: str,
        trailers: Mapping[str, str] | None = None,
    ) -> str:
        spec = self.spec(label)
        validate_author_name(author.name)
        with self.git.transaction(user_id) as tx:
            if isinstance(fields, Mapping):
                new = validate_fields(spec, fields)
            else:
                new = apply_operation(spec, self._parse(tx, spec), fields)
            return tx.commit(
                {label: to_toml(spec, new)}, format_message(summary, "", trailers), author
            )

    def edit_block(
        self, user_id: str, label: str, fields: Mapping[str, object], author: Author
    ) -> str:
        """A person's own edit of the whole block: validated, then committed directly."""
        return self._commit_fields(user_id, label, fields, author, f"Edit {label}")

    def edit_markdown(self, user_id: str, label: str, markdown: str, author: Author) -> str:
        """The `dmem edit` path: the Markdown form, parsed and validated, committed directly."""
        return self.edit_block(user_id, label, from_markdown(self.spec(label), markdown), author)

    def apply_direct(
        self, user_id: str, label: str, op: EditOperation, author: Author, reason: str = ""
    ) -> str:
        """A backend service's domain operation: applied to HEAD and committed at once."""
        spec = self.spec(label)
        if isinstance(op, ClearTask) and op.archive:
            self._archive_task(user_id, spec)
        trailers = {"Reason": reason} if reason else None
        return self._commit_fields(user_id, label, op, author, describe(op, label), trailers)

    # The high-level operations of the seed 000_d8598551964ab573.txt, called by a backend service
    # (committed directly).

    def set_task(
        self,
        user_id: str,
        task: str,
        author: Author,
        context: str | None = None,
        label: str = "human",
    ) -> str:
        return self.apply_direct(user_id, label, SetTask(task=task, context=context), author)

    def clear_task(
        self, user_id: str, author: Author, archive: bool = False, label: str = "human"
    ) -> str:
        return self.apply_direct(user_id, label, ClearTask(archive=archive), author)

    def learn_preference(
        self, user_id: str, preference: str, author: Author, label: str = "human"
    ) -> str:
        return self.apply_direct(user_id, label, LearnPreference(preference=preference), author)

    def learn_fact(self, user_id: str, fact: str, author: Author, label: str = "human") -> str:
        return self.apply_direct(user_id, label, LearnFact(fact=fact), author)

    def add_context(self, user_id: str, note: str, author: Author, label: str = "human") -> str:
        return self.apply_direct(user_id, label, AddContext(note=note), author)

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

    def _archive_task(self, user_id: str, spec: BlockSpec) -> None:
        if self.archive is None:
            raise DurableMemoryError(
                "clear_task(archive=True) needs archival memory, and none is configured"
            )
        block = self.read_block(user_id, spec.label)
        if not block.fields.get("current_task"):
            raise OperationNotApplicable(f"block '{spec.label}' has no current task to archive")
        text = format_task_archive(block.fields, datetime.now(UTC))
        key = f"{spec.label}@{block.sha}\n{block.fields.get('current_task')}"
        self.archive.archive_task(user_id, text, dedupe_key=key)

    # -- pending diffs --------------------------------------------------------------------

    def propose(
        self,
        user_id: str,
        label: str,
        op: EditOperation,
        reasoning: str,
        proposed_by: str,
        *,
        diff_id: str | None = None,
    ) -> PendingDiff:
        """The model's edit: checked against HEAD now, stored as pending, memory untouched.

        With a `diff_id` (derived from the tool call by a Temporal activity), proposing again
        returns the diff already stored under it: a retried activity creates nothing new.
        """
        if diff_id is not None:
            existing = self.diffs.find(diff_id, user_id)
            if existing is not None:
                return existing
        spec = self.spec(label)
        if spec.read_only:
            raise ReadOnlyBlock(f"block '{label}' is read-only; it cannot be edited by the agent")
        if isinstance(op, ClearTask) and op.archive and self.archive is None:
            raise DurableMemoryError(
                "clear_task(archive=True) needs archival memory, and none is configured"
            )
        block = self.read_block(user_id, label)
        apply_operation(spec, block.fields, op)
        diff = PendingDiff(
            id=diff_id or uuid.uuid4().hex,
            user_id=user_id,
            label=label,
            operation=op,
            base_sha=block.sha,
            reasoning=reasoning,
            proposed_by=proposed_by,
            status=DiffStatus.PENDING,
            created_at=datetime.now(UTC),
            summary=describe(op, label),
        )
        self.diffs.create(diff)
        return diff

    def pending(self, user_id: str) -> list[PendingDiff]:
        validate_user_id(user_id)
        return self.diffs.list(user_id, [DiffStatus.PENDING])

    def _edited_operation(self, diff: PendingDiff, edited_markdown: str) -> EditOperation:
        spec = self.spec(diff.label)
        fields = from_markdown(spec, edited_markdown)
        if spec.kind is BlockKind.TEXT:
            return RethinkText(new_value=str(fields["value"]))
        return ReplaceFields(fields=fields)

    def approve(
        self,
        diff_id: str,
        approver: str,
        *,
        user_id: str | None = None,
        edited_markdown: str | None = None,
        note: str | None = None,
    ) -> PendingDiff:
        """Record the approval, then commit it. A reviewer's edit (the whole block as Markdown)
        replaces the proposal; the commit names both the proposer and the approver.

        Exactly one decision on a diff wins (compare-and-set); a loser gets DiffAlreadyDecided
        carrying the winner's outcome. An approval that cannot be applied leaves the diff
        pending with DecisionRefused (a reviewer's edit that is invalid or over the limit, a
        block file changed by hand), or, if it stops applying after it was recorded, marks it
        conflicted with the reason: it is never left approved without a commit, except for
        the instant between recording and committing, which `commit_approved` finishes.
        """
        validate_author_name(approver)
        diff = self._pending(diff_id, user_id)
        edited = None
        if edited_markdown is not None:
            edited = self._edited_operation(diff, edited_markdown)
        self._refuse_unappliable(diff, edited)
        approved = self.diffs.transition(
            diff.id,
            diff.user_id,
            DiffStatus.PENDING,
            DiffStatus.APPROVED,
            edited_operation=edited,
            decided_by=approver,
            decided_at=datetime.now(UTC),
            decision_reason=note,
        )
        return self.commit_approved(approved.id, approved.user_id)

    def _pending(self, diff_id: str, user_id: str | None) -> PendingDiff:
        """The diff, if it still awaits a decision; else DiffAlreadyDecided with its outcome."""
        diff = self.diffs.get(diff_id, user_id)
        if diff.status is not DiffStatus.PENDING:
            raise DiffAlreadyDecided.about(diff)
        return diff

    def _refuse_unappliable(self, diff: PendingDiff, edited: EditOperation | None) -> None:
        """Refuse, before anything is recorded, an approval that could not be committed now."""
        spec = self.spec(diff.label)
        with self.git.transaction(diff.user_id) as tx:
            on_disk = tx.working_copy(spec.label)
            if on_disk is not None and on_disk != tx.read(spec.label):
                raise DecisionRefused(
                    f"diff {diff.id} was not approved: {block_path(spec.label)} of user "
                    f"'{diff.user_id}' has changes made by hand that are not committed; import "
                    "them (`dmem import`) or discard them, then decide again"
                )
            if edited is not None:
                try:
                    apply_operation(spec, self._parse(tx, spec), edited)
                except (OperationNotApplicable, BlockValidationError) as error:
                    raise DecisionRefused(
                        f"diff {diff.id} was not approved: the reviewer's edit cannot be "
                        f"applied: {error}"
                    ) from None

    def reject(
        self, diff_id: str, approver: str, reason: str, *, user_id: str | None = None
    ) -> PendingDiff:
        validate_author_name(approver)
        if not reason.strip():
            raise DurableMemoryError("a rejection needs a reason")
        diff = self._pending(diff_id, user_id)
        return self.diffs.transition(
            diff.id,
            diff.user_id,
            DiffStatus.PENDING,
            DiffStatus.REJECTED,
            decided_by=approver,
            decided_at=datetime.now(UTC),
            decision_reason=reason.strip(),
        )

    def expire(self, diff_id: str, user_id: str) -> PendingDiff:
        return self.diffs.transition(
            diff_id,
            user_id,
            DiffStatus.PENDING,
            DiffStatus.EXPIRED,
            decided_by="durable-memory",
            decided_at=datetime.now(UTC),
            decision_reason="not decided before the approval time-to-live ran out",
        )

    def finish_approvals(self, user_id: str) -> list[PendingDiff]:
        """Commit (or mark conflicted) every approval of the user that was recorded but not
        committed, e.g. because the process died in between. Cheap when there is none."""
        return [
            self.commit_approved(d.id, user_id) for d in self.diffs.unfinished_approvals(user_id)
        ]

    def commit_approved(self, diff_id: str, user_id: str) -> PendingDiff:
        """Commit an approved diff. Idempotent: a retry after a crash finds the commit carrying
        its Diff-Id trailer and returns it; a diff that no longer applies becomes conflicted."""
        diff = self.diffs.get(diff_id, user_id)
        if diff.status is not DiffStatus.APPROVED:
            raise DurableMemoryError(f"diff {diff_id} is {diff.status.value}, not approved")
        if diff.commit_sha:
            return diff
        try:
            return self._commit(diff)
        except DurableMemoryError as error:
            if error.retryable:
                raise
            # Final, but it cannot be applied (the edit no longer fits the block, the block
            # was edited by hand since the approval was checked, it left the profile...):
            # nothing was committed, so the diff says so instead of staying approved.
            return self._conflicted(diff, str(error))

    def _commit(self, diff: PendingDiff) -> PendingDiff:
        user_id = diff.user_id
        spec = self.spec(diff.label)
        op = diff.effective_operation
        if isinstance(op, ClearTask) and op.archive:
            # Archived before the commit (archiving is idempotent by its key); but a retry
            # after the commit must not archive again: the task is cleared by then.
            with self.git.transaction(user_id) as tx:
                done = tx.find_trailer("Diff-Id", diff.id, since=diff.decided_at)
            if done is not None:
                return self.diffs.set_commit(diff.id, user_id, done)
            self._archive_task(user_id, spec)
        with self.git.transaction(user_id) as tx:
            existing = tx.find_trailer("Diff-Id", diff.id, since=diff.decided_at)
            if existing is not None:
                return self.diffs.set_commit(diff.id, user_id, existing)
            head = self._parse(tx, spec)
            if diff.base_sha is not None and diff.base_sha != tx.head:
                reason = conflict_reason(spec, self._parse(tx, spec, diff.base_sha), head, op)
                if reason is not None:
                    return self._conflicted(diff, reason)
            new = apply_operation(spec, head, op)
            trailers = {
                "Diff-Id": diff.id,
                "Proposed-By": diff.proposed_by,
                "Approved-By": diff.decided_by or "",
                "Edited-By-Approver": "yes" if diff.edited_operation else "",
                "Reason": diff.reasoning,
            }
            message = format_message(diff.summary or describe(op, diff.label), "", trailers)
            approver = Author(name=diff.decided_by or "unknown", kind=AuthorKind.APPROVER)
            sha = tx.commit({diff.label: to_toml(spec, new)}, message, approver, allow_empty=True)
        return self.diffs.set_commit(diff.id, user_id, sha)

    def _conflicted(self, diff: PendingDiff, reason: str) -> PendingDiff:
        return self.diffs.transition(
            diff.id,
            diff.user_id,
            DiffStatus.APPROVED,
            DiffStatus.CONFLICTED,
            decision_reason=f"not applied, memory unchanged: {reason}",
        )

    def preview(self, diff_id: str, user_id: str | None = None) -> str:
        """The diff as a unified diff of the block's Markdown form, against the current HEAD."""
        diff = self.diffs.get(diff_id, user_id)
        block = self.read_block(diff.user_id, diff.label)
        try:
            new = apply_operation(block.spec, block.fields, diff.effective_operation)
        except (OperationNotApplicable, BlockValidationError) as error:
            return f"(diff {diff_id} no longer applies to the current block: {error})\n"
        before = to_markdown(block.spec, block.fields).splitlines(keepends=True)
        after = to_markdown(block.spec, new).splitlines(keepends=True)
        name = f"{diff.label}.md"
        return "".join(difflib.unified_diff(before, after, f"a/{name}", f"b/{name}"))

    # -- history --------------------------------------------------------------------------

    def history(self, user_id: str, label: str, limit: int = 20) -> list[CommitInfo]:
        return self.git.history(user_id, self.spec(label).label, limit)

    def read_at(self, user_id: str, label: str, sha: str) -> BlockFields:
        spec = self.spec(label)
        text = self.git.read_at(user_id, label, sha)
        where = f"users/{user_id}/{block_path(label)} at {sha[:12]}"
        return from_toml(spec, text, where, enforce_limit=False)

    def diff(self, user_id: str, label: str, a: str, b: str) -> str:
        return self.git.diff(user_id, self.spec(label).label, a, b)

    def restore(self, user_id: str, label: str, sha: str, author: Author) -> str:
        """Bring back the block as it was at `sha`, as a new commit; history is never rewritten."""
        fields = self.read_at(user_id, label, sha)
        return self._commit_fields(
            user_id,
            label,
            fields,
            author,
            f"Restore {label} to {sha[:12]}",
            {"Restored-From": sha},
        )

    def commit_hand_edits(self, user_id: str, author: Author) -> str | None:
        """Validate block files changed by hand in the working tree and commit them together.

        Any invalid file refuses the whole import with the file, the line and the reason; so
        does anything in `blocks/` that is not a block file of the profile (another name, a
        subdirectory: it would not be imported, and the person should know), a symlink, a FIFO
        or a device in place of a block file, or bytes that are not UTF-8 (`UnsafeFile`).
        Returns the new commit sha, or None if nothing was changed by hand.
        """
        with self.git.transaction(user_id) as tx:
            expected = {f"{spec.label}.toml" for spec in self.profile.blocks}
            unknown = [name for name in tx.working_files() if name not in expected]
            if unknown:
                raise UnsafeFile(
                    f"users/{user_id}/{BLOCKS_DIR} holds files that are not blocks of profile "
                    f"'{self.profile.name}': {', '.join(repr(n) for n in unknown)}; move them out "
                    "of blocks/ and import again (nothing was imported)"
                )
            changed: dict[str, str] = {}
            for spec in self.profile.blocks:
                on_disk = tx.working_copy(spec.label)
                if on_disk is not None and on_disk != tx.read(spec.label):
                    fields = from_toml(spec, on_disk, f"users/{user_id}/{block_path(spec.label)}")
                    changed[spec.label] = to_toml(spec, fields)
            if not changed:
                return None
            message = format_message(f"Import hand edits: {', '.join(changed)}")
            # The working copies are replaced by their normalised form, which is what we commit.
            return tx.commit(changed, message, author, overwrite_hand_edits=True)
