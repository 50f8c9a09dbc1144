"""The open redaction record: while a redaction of a user is under way (`dmem redact`), the
user's new turns, decisions and rotations wait, and the redaction waits for the writers that
began before it, so that none of them stores the text again after the rewrite
(docs/governance.md "Redact a version").

The record holds ids only: the user, the redaction's id (a one-way hash, store of the text
nowhere) and who asked. It is deleted when the redaction closes it; a forget deletes it with
the user's other rows (store/erasure.py's USER_TABLES).

A turn is admitted (`admit_turn_as_read`, by memory/agent/steps.py `prepare_context`, on the
record read with the erasure ledger in one statement: store/users.py `admission`) before its
prepare step compiles anything and again after it stored the context: one refused after
storing forgets that context, so a turn waiting at the gate has no stored context, and one
with a stored context was admitted before the record opened. The redaction reads which turns
those are (`turn_progress`) only after opening it.
"""

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import NamedTuple

from sqlalchemy import Engine, delete, func
from sqlmodel import Field, Session, SQLModel, col, select

from durable_memory.memory.core.errors import UserBeingRedacted
from durable_memory.memory.core.ids import validate_user_id
from durable_memory.memory.store.diffs import PendingDiffRow
from durable_memory.memory.store.recall import RecallMessageRow
from durable_memory.memory.store.sql import by_key, reading, table_of, utc
from durable_memory.memory.store.turns import TurnContextRow, TurnStepRow
from durable_memory.models.diffs import DiffStatus, Proposer
from durable_memory.models.llm import ModelReply


class RedactionUnderWayRow(SQLModel, table=True):
    __tablename__ = "redactions_under_way"

    user_id: str = Field(primary_key=True, max_length=64)
    redaction_id: str = Field(max_length=64)
    requested_by: str = Field(max_length=200)
    started_at: datetime


UNDER_WAY = table_of(RedactionUnderWayRow)
_OPEN_OF = by_key(UNDER_WAY, ("requested_by", "started_at"), ("user_id",))


class OpenRedaction(NamedTuple):
    """The record of a redaction under way, as a turn's admission reads it."""

    requested_by: str
    started_at: datetime


def refuse_open(user_id: str, found: OpenRedaction | None) -> None:
    """UserBeingRedacted (retried) if `found`, the user's record as read, is one."""
    if found is not None:
        raise UserBeingRedacted(
            f"user '{user_id}' is being redacted (requested by {found.requested_by} at "
            f"{utc(found.started_at).isoformat(timespec='seconds')}): their turns, "
            "decisions and rotations wait until it completes"
        )


@dataclass(frozen=True)
class TurnProgress:
    """What the database knows of a turn that stored its context: its newest stored model
    reply (None before the first) and step, and the highest recall position it wrote."""

    turn_id: str
    newest_step: int
    newest_reply: ModelReply | None
    last_seq: int


class RedactionGate:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def open(self, user_id: str, redaction_id: str, requested_by: str) -> None:
        """Open the user's record (idempotent: an open one stays as it is)."""
        validate_user_id(user_id)
        with Session(self.engine) as session:
            if session.get(RedactionUnderWayRow, user_id) is None:
                session.add(
                    RedactionUnderWayRow(
                        user_id=user_id,
                        redaction_id=redaction_id,
                        requested_by=requested_by[:200],
                        started_at=datetime.now(UTC),
                    )
                )
                session.commit()

    def close(self, user_id: str) -> None:
        """Delete the user's record (idempotent)."""
        with Session(self.engine) as session:
            session.execute(
                delete(RedactionUnderWayRow).where(col(RedactionUnderWayRow.user_id) == user_id)
            )
            session.commit()

    def refuse_if_open(self, user_id: str) -> None:
        """UserBeingRedacted (retried) while a redaction of the user is under way."""
        refuse_open(user_id, self._open_of(user_id))

    def _open_of(self, user_id: str) -> OpenRedaction | None:
        with reading(self.engine) as connection:  # a plain row
            row = connection.execute(_OPEN_OF, {"user_id": user_id}).first()
        return None if row is None else OpenRedaction(row.requested_by, row.started_at)

    def admit_turn_as_read(self, user_id: str, turn_id: str, found: OpenRedaction | None) -> None:
        """`refuse_if_open` on the user's record as the turn read it (None: no redaction under
        way), with the erasure ledger in one statement (store/users.py
        `UserDirectory.admission`: a turn's admission asks both, twice), forgetting first the
        context the turn stored, if any: a turn refused here holds nothing the redaction must
        wait for (see the module)."""
        try:
            refuse_open(user_id, found)
        except UserBeingRedacted:
            with Session(self.engine) as session:
                session.execute(
                    delete(TurnContextRow).where(
                        col(TurnContextRow.user_id) == user_id,
                        col(TurnContextRow.turn_id) == turn_id,
                    )
                )
                session.commit()
            raise

    def turn_progress(self, user_id: str) -> list[TurnProgress]:
        """Every turn of the user with a stored context, and how far the database saw it go."""
        with Session(self.engine) as session:
            turns = session.exec(
                select(TurnContextRow.turn_id).where(TurnContextRow.user_id == user_id)
            ).all()
            newest_steps = dict(
                session.exec(
                    select(TurnStepRow.turn_id, func.max(TurnStepRow.step))
                    .where(TurnStepRow.user_id == user_id)
                    .group_by(col(TurnStepRow.turn_id))
                ).all()
            )
            last_seqs = dict(
                session.exec(
                    select(RecallMessageRow.turn_id, func.max(RecallMessageRow.seq))
                    .where(RecallMessageRow.user_id == user_id)
                    .group_by(col(RecallMessageRow.turn_id))
                ).all()
            )
            progress = []
            for turn_id in turns:
                step = newest_steps.get(turn_id, 0)
                row = session.get(TurnStepRow, (user_id, turn_id, step)) if step else None
                progress.append(
                    TurnProgress(
                        turn_id=turn_id,
                        newest_step=step,
                        newest_reply=ModelReply.model_validate_json(row.reply) if row else None,
                        last_seq=last_seqs.get(turn_id, -1),
                    )
                )
            return progress

    def deciding_turns(self, user_id: str) -> set[str]:
        """The turns whose diffs of the user a decision may still commit: pending, or
        approved without their commit yet."""
        with Session(self.engine) as session:
            rows = session.exec(
                select(PendingDiffRow.proposed_by, PendingDiffRow.status).where(
                    PendingDiffRow.user_id == user_id,
                    col(PendingDiffRow.status).in_(
                        [DiffStatus.PENDING.value, DiffStatus.APPROVED.value]
                    ),
                    col(PendingDiffRow.commit_sha).is_(None),
                )
            ).all()
        return {turn_id for proposed_by, _ in rows if (turn_id := Proposer(proposed_by).turn_id)}
