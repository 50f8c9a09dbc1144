"""Review: the model's edits as pending diffs, and the human decisions on them.

The model never changes memory: `propose` stores a PendingDiff that a person approves
(committed with author = the approver, naming both proposer and approver) or rejects; one
left undecided expires. A person may have decided ahead of time: an edit that a live standing
approval covers (service/policies.py) is approved as it is proposed, in that person's name,
and committed at once (`Approved-By: standing:<id>`).

One module though over 300 lines: a diff's whole life (proposed, approved by a person or
ahead of time, committed exactly once, rejected, expired, conflicted) is one set of
compare-and-set transitions, read together.
"""

import difflib
import uuid
from datetime import UTC, datetime

from durable_memory.memory.core.errors import (
    BlockValidationError,
    DecisionRefused,
    DiffAlreadyDecided,
    DurableMemoryError,
    GitRemoteRefused,
    OperationNotApplicable,
    ReadOnlyBlock,
    UserBeingForgotten,
    UserForgotten,
)
from durable_memory.memory.core.formats import from_markdown, to_markdown, to_toml
from durable_memory.memory.core.ids import validate_user_id
from durable_memory.memory.core.operations import (
    apply_operation,
    conflict_reason,
    describe,
    rewrite_operation,
)
from durable_memory.memory.core.policies import StandingApproval
from durable_memory.memory.service.access import BlockAccess
from durable_memory.memory.service.policies import Policies, validate_person
from durable_memory.memory.store.block_repository import BlockTransaction, compare_and_set
from durable_memory.memory.store.diffs import DiffStore
from durable_memory.memory.store.git import (
    block_path,
    format_message,
)
from durable_memory.models.diffs import DiffStatus, PendingDiff, Proposer
from durable_memory.models.history import SYSTEM_AUTHOR, Author, AuthorKind
from durable_memory.models.operations import (
    ClearTask,
    EditOperation,
)


class Review:
    def __init__(self, access: BlockAccess, diffs: DiffStore, policies: Policies) -> None:
        self._access = access
        self._diffs = diffs
        self._policies = policies

    def propose(
        self,
        user_id: str,
        label: str,
        op: EditOperation,
        reasoning: str,
        proposer: Proposer,
        *,
        diff_id: str | None = None,
        read_at: str | None = None,
    ) -> PendingDiff:
        """The model's edit: checked against HEAD now, stored as pending, memory untouched,
        unless a person approved such edits ahead of time (below).

        With a `diff_id` (derived from the tool call by a Temporal activity), proposing again
        returns the diff already stored under it: a retried activity creates nothing new (it
        finishes a standing approval the first attempt did not).
        With `read_at`, the commit the edit was computed from (a whole-block rewrite made from
        what the model read), it is refused if the block has moved on since.

        An edit a live standing approval covers is approved in its name and committed here:
        the diff returned is approved with its commit (or conflicted), not pending.
        """
        if diff_id is not None:
            again = self.proposed_again(diff_id, user_id)
            if again is not None:
                return again
        spec = self._access.spec(user_id, label)
        if spec.read_only:
            raise ReadOnlyBlock(f"block '{label}' is read-only; it cannot be edited by the agent")
        if isinstance(op, ClearTask) and op.archive:
            self._access.require_archive()
        block = self._access.read_block(user_id, label)
        if read_at is not None and block.sha != read_at:
            raise OperationNotApplicable(
                f"block '{label}' changed since it was read; read it again and redo the edit"
            )
        apply_operation(spec, block.fields, op)
        diff = PendingDiff(
            id=diff_id or uuid.uuid4().hex,
            user_id=user_id,
            label=label,
            operation=op,
            base_sha=block.sha,
            reasoning=reasoning,
            proposed_by=str(proposer),
            status=DiffStatus.PENDING,
            created_at=datetime.now(UTC),
            summary=describe(op, label),
        )
        # Read before anything is stored: a policies record that is not trusted refuses the
        # proposal with its one clear error, leaving every store as it was.
        standing = self._policies.approving(user_id, label, op)
        self._diffs.create(diff)
        return diff if standing is None else self._approve_standing(diff, standing)

    def proposed_again(self, diff_id: str, user_id: str) -> PendingDiff | None:
        """The user's diff already proposed under `diff_id` (a tool call run again), with what
        the first proposal began finished (below); None if there is none."""
        existing = self._diffs.find(diff_id, user_id)
        return None if existing is None else self._settle_again(existing)

    def _settle_again(self, diff: PendingDiff) -> PendingDiff:
        """A proposal made again (a retried step): finish what the first attempt began, an
        approval's commit, or a standing approval (read again now, so a revocation counts)."""
        if diff.status is DiffStatus.APPROVED and diff.commit_sha is None:
            return self.commit_approved(diff.id, diff.user_id)
        if diff.status is not DiffStatus.PENDING:
            return diff
        standing = self._policies.approving(diff.user_id, diff.label, diff.operation)
        return diff if standing is None else self._approve_standing(diff, standing)

    def _approve_standing(self, diff: PendingDiff, standing: StandingApproval) -> PendingDiff:
        """Record the pending diff approved by `standing`, then commit it. A commit that must
        wait (the git remote is down) raises its retryable error: the step is retried, and
        the retry commits the approval recorded here."""
        try:
            approved = self._diffs.transition(
                diff.id,
                diff.user_id,
                DiffStatus.PENDING,
                DiffStatus.APPROVED,
                decided_by=standing.name,
                decided_at=datetime.now(UTC),
                decision_reason=f"within standing approval {standing.id} set by "
                f"{standing.set_by}: {standing.scope}",
            )
        except DiffAlreadyDecided as decided:  # a person decided it first (a retry's window)
            return decided.diff if decided.diff is not None else diff
        return self.commit_approved(approved.id, approved.user_id)

    def get(self, diff_id: str, user_id: str | None) -> PendingDiff:
        """The diff, whatever its status; with `user_id`, only if it is that user's."""
        return self._diffs.get(diff_id, user_id)

    def pending(self, user_id: str) -> list[PendingDiff]:
        validate_user_id(user_id)
        return self._diffs.list(user_id, [DiffStatus.PENDING])

    def proposals(
        self, user_id: str, label: str, statuses: list[DiffStatus], limit: int
    ) -> list[PendingDiff]:
        """The agent's own proposals (made in a turn) for block `label` with these statuses,
        newest first, at most `limit`."""
        validate_user_id(user_id)
        found = self._diffs.list(user_id, statuses, label=label, limit=limit)
        return [d for d in found if d.proposer.turn_id is not None]

    def existing(self, user_id: str, diff_ids: list[str]) -> list[str]:
        """Those of `diff_ids` that name a diff of the user, in the order given."""
        return self._diffs.existing(user_id, diff_ids)

    def superseded_by(self, user_id: str, diff_ids: list[str]) -> list[PendingDiff]:
        """The user's diffs that these newer proposals superseded."""
        return self._diffs.superseded_by(user_id, diff_ids)

    def _edited_operation(self, diff: PendingDiff, edited_markdown: str) -> EditOperation:
        spec = self._access.spec(diff.user_id, diff.label)
        return rewrite_operation(spec, from_markdown(spec, edited_markdown))

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
        validate_person(approver)
        diff = self._pending(diff_id, user_id)
        edited = None
        if edited_markdown is not None:
            edited = self._edited_operation(diff, edited_markdown)
        self._refuse_unappliable(diff, edited)
        approved = self._diffs.transition(
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
        diff = self._diffs.get(diff_id, user_id)
        if diff.status is not DiffStatus.PENDING:
            raise DiffAlreadyDecided.about(diff)
        return diff

    def _refuse_unappliable(self, diff: PendingDiff, edited: EditOperation | None) -> None:
        """Refuse, before anything is recorded, an approval that could not be committed now."""
        spec = self._access.spec(diff.user_id, diff.label)
        with self._access.git.transaction(diff.user_id) as tx:
            on_disk = tx.working_copy(spec.label)
            if on_disk is not None and on_disk != tx.read(spec.label):
                raise DecisionRefused(
                    f"diff {diff.id} was not approved: {block_path(spec.label)} of user "
                    f"'{diff.user_id}' has changes made by hand that are not committed; import "
                    "them (`dmem import`) or discard them, then decide again"
                )
            if edited is not None:
                try:
                    apply_operation(spec, self._access.parse(tx, spec), edited)
                except (OperationNotApplicable, BlockValidationError) as error:
                    raise DecisionRefused(
                        f"diff {diff.id} was not approved: the reviewer's edit cannot be "
                        f"applied: {error}"
                    ) from None

    def reject(
        self, diff_id: str, approver: str, reason: str, *, user_id: str | None = None
    ) -> PendingDiff:
        validate_person(approver)
        if not reason.strip():
            raise DurableMemoryError("a rejection needs a reason")
        diff = self._pending(diff_id, user_id)
        return self._diffs.transition(
            diff.id,
            diff.user_id,
            DiffStatus.PENDING,
            DiffStatus.REJECTED,
            decided_by=approver,
            decided_at=datetime.now(UTC),
            decision_reason=reason.strip(),
        )

    def expire(self, diff_id: str, user_id: str) -> PendingDiff:
        return self._diffs.transition(
            diff_id,
            user_id,
            DiffStatus.PENDING,
            DiffStatus.EXPIRED,
            decided_by=SYSTEM_AUTHOR.name,
            decided_at=datetime.now(UTC),
            decision_reason="not decided before the approval time-to-live ran out",
        )

    def finish_approvals(self, user_id: str) -> list[PendingDiff]:
        """Commit (or mark conflicted) every approval of the user that was recorded but not
        committed, e.g. because the process died in between. Cheap when there is none."""
        return [
            self.commit_approved(d.id, user_id) for d in self._diffs.unfinished_approvals(user_id)
        ]

    def commit_approved(self, diff_id: str, user_id: str) -> PendingDiff:
        """Commit an approved diff. Idempotent: a retry after a crash finds the commit carrying
        its Diff-Id trailer and returns it; a diff that no longer applies becomes conflicted.

        Nothing is committed or archived for a user closed to memory (UserBeingForgotten,
        UserForgotten), nor for one whose forget began while the commit ran (a task archive
        embeds for seconds), even once they were started afresh: the diff is of the memory
        that forget erased. The last check is made under the user's repository lock, which
        the forget's deletion of the repository takes too."""
        seen = self._access.users.refuse_if_forgotten(user_id)
        diff = self._diffs.get(diff_id, user_id)
        if diff.status is not DiffStatus.APPROVED:
            raise DurableMemoryError(f"diff {diff_id} is {diff.status.value}, not approved")
        if diff.commit_sha:
            return diff
        try:
            return self._commit(diff, seen)
        except (UserBeingForgotten, UserForgotten):
            raise  # nothing about the diff: the forget deletes it, or already has
        except DurableMemoryError as error:
            if error.retryable or isinstance(error, GitRemoteRefused):
                # Nothing about the diff: the remote is down, or refuses this host (its token,
                # its hook). The approval stays recorded; a later attempt commits it.
                raise
            # The user's forget, begun meanwhile, may be why (their repository gone, or a new
            # one without the diff's base): then that is the answer, not a conflict (the
            # forget deletes the diff).
            self._access.users.refuse_if_forgotten(user_id, seen)
            # Final, but it cannot be applied (the edit no longer fits the block, the block
            # was edited by hand since the approval was checked, it left the profile...):
            # nothing was committed, so the diff says so instead of staying approved.
            return self._conflicted(diff, str(error))

    @compare_and_set
    def _commit(self, diff: PendingDiff, seen: int) -> PendingDiff:
        """`seen`: what the erasure check before the diff was read returned."""
        user_id = diff.user_id
        spec = self._access.spec(diff.user_id, diff.label)
        op = diff.effective_operation
        git = self._access.git
        if isinstance(op, ClearTask) and op.archive:
            # Archived before the commit (archiving is idempotent by its key); but a retry
            # after the commit must not archive again: the task is cleared by then.
            with git.transaction(user_id) as tx:
                done = tx.find_trailer("Diff-Id", diff.id, since=diff.decided_at)
            if done is not None:
                return self._diffs.set_commit(diff.id, user_id, done)
            self._access.archive_task(user_id, spec, since=seen)
        with git.transaction(user_id) as tx:
            self._access.users.refuse_if_forgotten(user_id, seen)
            existing = tx.find_trailer("Diff-Id", diff.id, since=diff.decided_at)
            if existing is not None:
                return self._diffs.set_commit(diff.id, user_id, existing)
            head = self._access.parse(tx, spec)
            if diff.base_sha is not None and diff.base_sha != tx.head:
                base = self._access.parse(tx, spec, diff.base_sha)
                reason = conflict_reason(spec, base, head, op)
                if reason is not None:
                    return self._conflicted(diff, reason)
            new = apply_operation(spec, head, op)
            standing = self._standing_of(tx, diff)
            trailers = {
                "Diff-Id": diff.id,
                "Proposed-By": diff.proposed_by,
                "Approved-By": diff.decided_by or "",
                "Standing-Approval-Set-By": standing.set_by if standing else "",
                "Edited-By-Approver": "yes" if diff.edited_operation else "",
                "Reason": diff.reasoning,
            }
            message = format_message(diff.summary or describe(op, diff.label), "", trailers)
            # A standing approval's commit is authored by the person who set it.
            person = standing.set_by if standing else diff.decided_by or "unknown"
            approver = Author(name=person, kind=AuthorKind.APPROVER)
            sha = tx.commit({diff.label: to_toml(spec, new)}, message, approver, allow_empty=True)
        return self._diffs.set_commit(diff.id, user_id, sha)

    def _standing_of(self, tx: BlockTransaction, diff: PendingDiff) -> StandingApproval | None:
        """The standing approval that approved the diff (revoked since or not), None if a
        person approved it."""
        policy_id = diff.standing_approval
        return None if policy_id is None else self._policies.find(tx, policy_id)

    def _conflicted(self, diff: PendingDiff, reason: str) -> PendingDiff:
        return self._diffs.transition(
            diff.id,
            diff.user_id,
            DiffStatus.APPROVED,
            DiffStatus.CONFLICTED,
            decision_reason=f"not applied, memory unchanged: {reason}",
        )

    def preview(self, diff_id: str, user_id: str | None = None) -> str:
        """The diff as a unified diff of the block's Markdown form, against the current HEAD."""
        diff = self._diffs.get(diff_id, user_id)
        block = self._access.read_block(diff.user_id, diff.label)
        try:
            new = apply_operation(block.spec, block.fields, diff.effective_operation)
        except (OperationNotApplicable, BlockValidationError) as error:
            return f"(diff {diff_id} no longer applies to the current block: {error})\n"
        before = to_markdown(block.spec, block.fields).splitlines(keepends=True)
        after = to_markdown(block.spec, new).splitlines(keepends=True)
        name = f"{diff.label}.md"
        return "".join(difflib.unified_diff(before, after, f"a/{name}", f"b/{name}"))
