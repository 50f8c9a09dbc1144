"""SQL storage of pending diffs. Status changes are compare-and-set, so two deciders of one
diff cannot both win; the loser is told the winner's outcome.

Diff ids may be chosen by callers, so every read and write names the user as well: a diff of
another user is reported exactly like a missing one."""

import functools
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from pydantic import TypeAdapter
from sqlalchemy import Engine, Integer, Row, bindparam, update
from sqlalchemy import select as select_columns
from sqlmodel import Field, Session, SQLModel, col, select

from durable_memory.memory.core.errors import DiffAlreadyDecided, UnknownDiff
from durable_memory.memory.core.ids import validate_diff_id
from durable_memory.memory.store.sql import keyed, reading, table_of, utc, writing_once
from durable_memory.memory.store.sql.direct import run
from durable_memory.models.diffs import DiffStatus, PendingDiff
from durable_memory.models.operations import EditOperation

_OPERATION = TypeAdapter[EditOperation](EditOperation)


class PendingDiffRow(SQLModel, table=True):
    __tablename__ = "pending_diffs"

    id: str = Field(primary_key=True, max_length=32)
    user_id: str = Field(index=True, max_length=64)
    label: str = Field(index=True, max_length=48)
    operation: str
    base_sha: str | None = Field(default=None, max_length=40)
    reasoning: str
    proposed_by: str
    status: str = Field(index=True, max_length=16)
    summary: str = ""
    created_at: datetime
    decided_at: datetime | None = None
    decided_by: str | None = None
    decision_reason: str | None = None
    edited_operation: str | None = None
    commit_sha: str | None = Field(default=None, max_length=40)
    superseded_by: str | None = Field(default=None, max_length=32)


def _to_model(row: PendingDiffRow | Row[Any]) -> PendingDiff:
    return PendingDiff(
        id=row.id,
        user_id=row.user_id,
        label=row.label,
        operation=_OPERATION.validate_json(row.operation),
        base_sha=row.base_sha,
        reasoning=row.reasoning,
        proposed_by=row.proposed_by,
        status=DiffStatus(row.status),
        summary=row.summary,
        created_at=utc(row.created_at),
        decided_at=utc(row.decided_at) if row.decided_at is not None else None,
        decided_by=row.decided_by,
        decision_reason=row.decision_reason,
        edited_operation=(
            _OPERATION.validate_json(row.edited_operation) if row.edited_operation else None
        ),
        commit_sha=row.commit_sha,
        superseded_by=row.superseded_by,
    )


def _plain_select() -> Any:
    """Diffs as plain rows: every turn lists the user's pending and unfinished ones, and ORM
    objects and sessions cost more than the query."""
    return select_columns(*table_of(PendingDiffRow).columns)


_DIFFS = table_of(PendingDiffRow)
_EXISTING = select_columns(_DIFFS.c.id).where(
    *keyed(_DIFFS, "user_id"), _DIFFS.c.id.in_(bindparam("diff_ids", expanding=True))
)
_UNFINISHED = (
    *keyed(_DIFFS, "user_id"),
    _DIFFS.c.status == DiffStatus.APPROVED.value,
    _DIFFS.c.commit_sha.is_(None),
)
"""The user's approvals recorded but not committed."""
_UNFINISHED_APPROVALS = _plain_select().where(*_UNFINISHED)
"""Statements every turn runs, built once (store/sql `keyed`)."""
UNFINISHED_APPROVAL_EXISTS = select_columns(_DIFFS.c.id).where(*_UNFINISHED).exists()
"""Whether the user has an approval recorded but not committed: asked with a turn's admission
(store/users.py), so a turn reads the approvals to finish only when there are some."""


@functools.cache
def _listing(statuses: int, by_label: bool) -> Any:
    """`DiffStore.list`'s statement of each shape, built once (every turn lists): `statuses`
    how many statuses it keeps (0: any). One status is compared, not listed: a statement
    without an expanding parameter runs on the driver's cursor (store/sql/direct.py)."""
    query = _plain_select().where(*keyed(_DIFFS, "user_id"))
    if statuses == 1:
        query = query.where(*keyed(_DIFFS, "status"))
    elif statuses:
        query = query.where(_DIFFS.c.status.in_(bindparam("statuses", expanding=True)))
    if by_label:
        query = query.where(*keyed(_DIFFS, "label"))
    return query.order_by(_DIFFS.c.created_at.desc()).limit(bindparam("limit", type_=Integer))


class DiffStore:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def create(self, diff: PendingDiff) -> list[str]:
        """Store a new pending diff; older pending diffs of the same block become superseded.

        Returns the ids it superseded.
        """
        with Session(self.engine) as session:
            older = session.exec(
                select(PendingDiffRow.id).where(
                    PendingDiffRow.user_id == diff.user_id,
                    PendingDiffRow.label == diff.label,
                    PendingDiffRow.status == DiffStatus.PENDING.value,
                )
            ).all()
            if older:
                session.execute(
                    update(PendingDiffRow)
                    .where(
                        col(PendingDiffRow.id).in_(older),
                        col(PendingDiffRow.status) == DiffStatus.PENDING.value,
                    )
                    .values(
                        status=DiffStatus.SUPERSEDED.value,
                        superseded_by=diff.id,
                        decided_at=utc(diff.created_at),
                        decision_reason=f"superseded by a newer proposal {diff.id}",
                    )
                )
            session.add(
                PendingDiffRow(
                    id=diff.id,
                    user_id=diff.user_id,
                    label=diff.label,
                    operation=_OPERATION.dump_json(diff.operation).decode(),
                    base_sha=diff.base_sha,
                    reasoning=diff.reasoning,
                    proposed_by=diff.proposed_by,
                    status=diff.status.value,
                    summary=diff.summary,
                    created_at=utc(diff.created_at),
                )
            )
            session.commit()
            return list(older)

    def find(self, diff_id: str, user_id: str) -> PendingDiff | None:
        """The user's diff, or None (also when the id belongs to another user's diff)."""
        # One read: in autocommit on PostgreSQL (no BEGIN and ROLLBACK round trips around it).
        with reading(self.engine) as connection, Session(bind=connection) as session:
            row = session.get(PendingDiffRow, validate_diff_id(diff_id))
            return _to_model(row) if row is not None and row.user_id == user_id else None

    def existing(self, user_id: str, diff_ids: list[str]) -> list[str]:
        """Those of `diff_ids` that name a diff of the user, in the order given."""
        if not diff_ids:
            return []
        key = {"user_id": user_id, "diff_ids": diff_ids}
        with reading(self.engine) as connection:
            found = set(connection.execute(_EXISTING, key).scalars())
        return [d for d in diff_ids if d in found]

    def superseded_by(self, user_id: str, diff_ids: list[str]) -> list[PendingDiff]:
        """The user's diffs that the given (newer) diffs of theirs superseded."""
        if not diff_ids:
            return []
        with reading(self.engine) as connection, Session(bind=connection) as session:
            rows = session.exec(
                select(PendingDiffRow).where(
                    PendingDiffRow.user_id == user_id,
                    col(PendingDiffRow.superseded_by).in_(diff_ids),
                )
            ).all()
            return [_to_model(r) for r in rows]

    def get(self, diff_id: str, user_id: str | None) -> PendingDiff:
        """The diff; a diff of another user is reported exactly like a missing one.

        `user_id=None` looks the id up across users: only for an operator's tool that is given
        a bare diff id (`dmem approve DIFF`); everything acting for a user names the user.
        """
        validate_diff_id(diff_id)
        with reading(self.engine) as connection, Session(bind=connection) as session:
            row = session.get(PendingDiffRow, diff_id)
            if row is None or (user_id is not None and row.user_id != user_id):
                owner = f" for user '{user_id}'" if user_id is not None else ""
                raise UnknownDiff(f"no diff {diff_id}{owner}")
            return _to_model(row)

    def unfinished_approvals(self, user_id: str) -> list[PendingDiff]:
        """The user's diffs approved but not yet committed: a decision interrupted by a crash
        (or by a failure that outlasted its retries) between recording and committing."""
        with reading(self.engine) as connection:
            return [
                _to_model(row)
                for row in run(connection, _UNFINISHED_APPROVALS, {"user_id": user_id})
            ]

    def list(
        self,
        user_id: str,
        statuses: Sequence[DiffStatus] | None = None,
        label: str | None = None,
        limit: int = 100,
    ) -> list[PendingDiff]:
        """Newest first."""
        key: dict[str, Any] = {"user_id": user_id, "limit": limit}
        statuses = list(dict.fromkeys(statuses or ()))
        if len(statuses) == 1:
            key["status"] = statuses[0].value
        elif statuses:
            key["statuses"] = [s.value for s in statuses]
        if label is not None:
            key["label"] = label
        with reading(self.engine) as connection:
            query = _listing(len(statuses), label is not None)
            return [_to_model(row) for row in run(connection, query, key)]

    def transition(
        self,
        diff_id: str,
        user_id: str,
        expected: DiffStatus,
        new: DiffStatus,
        *,
        edited_operation: EditOperation | None = None,
        **values: Any,
    ) -> PendingDiff:
        """Move the user's diff from `expected` to `new` atomically (compare-and-set). Any
        other status raises DiffAlreadyDecided carrying the diff as it really is."""
        if edited_operation is not None:
            values["edited_operation"] = _OPERATION.dump_json(edited_operation).decode()
        if isinstance(values.get("decided_at"), datetime):
            values["decided_at"] = utc(values["decided_at"])
        with writing_once(self.engine) as connection:  # one statement: atomic alone
            result = connection.execute(
                update(PendingDiffRow)
                .where(
                    col(PendingDiffRow.id) == diff_id,
                    col(PendingDiffRow.user_id) == user_id,
                    col(PendingDiffRow.status) == expected.value,
                )
                .values(status=new.value, **values)
            )
            changed = result.rowcount
        diff = self.get(diff_id, user_id)
        if not changed:
            raise DiffAlreadyDecided.about(diff)
        return diff

    def set_commit(self, diff_id: str, user_id: str, sha: str) -> PendingDiff:
        """Record the commit of an approved diff, once: a diff that has one keeps it."""
        with writing_once(self.engine) as connection:
            connection.execute(
                update(PendingDiffRow)
                .where(
                    col(PendingDiffRow.id) == diff_id,
                    col(PendingDiffRow.user_id) == user_id,
                    col(PendingDiffRow.status) == DiffStatus.APPROVED.value,
                    col(PendingDiffRow.commit_sha).is_(None),
                )
                .values(commit_sha=sha)
            )
        return self.get(diff_id, user_id)


def now() -> datetime:
    return datetime.now(UTC)
