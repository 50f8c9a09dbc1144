"""Policies: a user's standing approvals, set and revoked by a person, each change a commit
of the user's `policies.toml` (author = that person), read from HEAD like the profile record.

`Review.propose` asks `approving` whether a live standing approval covers an edit; the record
is read again for every proposal, so a revocation takes effect for the next one.
"""

import uuid
from datetime import UTC, datetime

from durable_memory.memory.core.ids import validate_user_id
from durable_memory.memory.core.policies import (
    MAX_STANDING,
    PolicyError,
    PolicyState,
    StandingApproval,
    approving,
    check_operations,
    format_policies,
    parse_policies,
    require_pre_approvable,
)
from durable_memory.memory.service.access import BlockAccess, block_spec
from durable_memory.memory.store.block_repository import BlockTransaction, compare_and_set
from durable_memory.memory.store.git import POLICIES_FILE, format_message, validate_author_name
from durable_memory.models.diffs import STANDING_PREFIX
from durable_memory.models.history import Author, AuthorKind
from durable_memory.models.operations import EditOperation


def validate_person(name: str) -> str:
    """A person's name for a decision: never one that reads as a standing approval's."""
    if validate_author_name(name).startswith(STANDING_PREFIX):
        raise PolicyError(
            f"invalid name {name!r:.60}: '{STANDING_PREFIX}...' names a standing approval, "
            "not a person"
        )
    return name


class Policies:
    def __init__(self, access: BlockAccess) -> None:
        self._access = access

    def read_in(self, tx: BlockTransaction) -> list[StandingApproval]:
        """The standing approvals HEAD records; PolicyError if the record is not trusted."""
        text = tx.read_policies()
        if text is None:
            return []
        profile = self._access.profile_in(tx)
        where = f"users/{tx.user_id}/{POLICIES_FILE} at {(tx.head or '')[:12]}"
        approvals = parse_policies(text, where, lambda label: block_spec(profile, label))
        for approval in approvals:  # they become commit identities
            for name in (approval.set_by, approval.revoked_by):
                if name is not None:
                    validate_author_name(name)
        return approvals

    def approvals(self, user_id: str) -> list[StandingApproval]:
        """Every standing approval of the user, oldest first, revoked and expired included."""
        with self._access.git.transaction(validate_user_id(user_id)) as tx:
            return self.read_in(tx)

    def approving(
        self, user_id: str, label: str, operation: EditOperation
    ) -> StandingApproval | None:
        """The live standing approval covering the user's edit, None if none does; read from
        HEAD each time, so a revocation counts for the next proposal."""
        with self._access.git.transaction(user_id) as tx:
            return approving(self.read_in(tx), label, operation, datetime.now(UTC))

    def find(self, tx: BlockTransaction, policy_id: str) -> StandingApproval:
        for approval in self.read_in(tx):
            if approval.id == policy_id:
                return approval
        raise PolicyError(f"user '{tx.user_id}' has no standing approval {policy_id!r}")

    @compare_and_set
    def set(
        self,
        user_id: str,
        label: str,
        operations: list[str],
        set_by: str,
        expires_at: datetime,
        reason: str = "",
    ) -> StandingApproval:
        """Record and commit a new standing approval (author = `set_by`)."""
        validate_person(set_by)
        ops = tuple(dict.fromkeys(operations))
        check_operations(ops)
        now = datetime.now(UTC)
        if expires_at.tzinfo is None or not now < expires_at <= now + MAX_STANDING:
            raise PolicyError(
                f"a standing approval needs an expiry in the future and at most "
                f"{MAX_STANDING.days} days away (with a time zone), not {expires_at.isoformat()}"
            )
        with self._access.git.transaction(validate_user_id(user_id)) as tx:
            require_pre_approvable(block_spec(self._access.profile_in(tx), label))
            approvals = self.read_in(tx)
            approval = StandingApproval(
                id=uuid.uuid4().hex[:12],
                label=label,
                operations=ops,
                set_by=set_by,
                set_at=now,
                expires_at=expires_at,
                reason=reason.strip(),
            )
            self._commit(tx, [*approvals, approval], approval, "Set", set_by)
            return approval

    @compare_and_set
    def revoke(self, user_id: str, policy_id: str, revoked_by: str) -> StandingApproval:
        """Mark a standing approval revoked and commit it (author = `revoked_by`)."""
        validate_person(revoked_by)
        with self._access.git.transaction(validate_user_id(user_id)) as tx:
            approvals = self.read_in(tx)
            old = self.find(tx, policy_id)
            if old.state(datetime.now(UTC)) is PolicyState.REVOKED:
                raise PolicyError(
                    f"standing approval {policy_id} was already revoked by {old.revoked_by}"
                )
            new = old.model_copy(update={"revoked_by": revoked_by, "revoked_at": datetime.now(UTC)})
            self._commit(
                tx, [new if a.id == old.id else a for a in approvals], new, "Revoke", revoked_by
            )
            return new

    def _commit(
        self,
        tx: BlockTransaction,
        approvals: list[StandingApproval],
        changed: StandingApproval,
        action: str,
        person: str,
    ) -> str:
        summary = f"{action} standing approval {changed.id}: {changed.scope}"
        trailers = {"Policy-Id": changed.id, "Policy-Action": action.lower()}
        author = Author(name=person, kind=AuthorKind.APPROVER)
        return tx.commit(
            {},
            format_message(summary, changed.reason, trailers),
            author,
            policies=format_policies(approvals),
        )
