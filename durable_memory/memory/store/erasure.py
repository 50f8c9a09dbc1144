"""Forgetting a user in SQL: the erasure ledger (one record per request: a hash of the user id,
who asked, why, when it began and when it completed) and the deletion of every row of theirs.

The ledger is both the record an operator shows a privacy officer and the marker that keeps a
turn out while a forget is under way: `Blocks.ensure_user` (every turn's first step) refuses a
user whose erasure has begun and not completed. The record names the user only by
`user_hash`, a SHA-256 of the id: it proves which id was erased to whoever already knows it,
and lists no one.

Deleted rows must not linger in the file: on SQLite every connection runs with
`secure_delete` (store/sql: freed cells and pages are zeroed), the full-text index is
merged (FTS5 keeps deleted tokens in old segments until then) and the WAL is checkpointed and
truncated (it holds the old pages). PostgreSQL keeps dead tuples until VACUUM (docs/governance.md).
"""

import hashlib
import sqlite3
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import NamedTuple, Protocol, TypeVar

from sqlalchemy import Engine
from sqlalchemy import select as select_columns
from sqlmodel import Field, Session, SQLModel, col, select
from sqlmodel.sql.expression import SelectOfScalar

from durable_memory.memory.core.errors import (
    DurableMemoryError,
    StoreBusy,
    UserBeingForgotten,
    UserForgotten,
)
from durable_memory.memory.core.ids import validate_user_id
from durable_memory.memory.store.recall import RECALL_FTS
from durable_memory.memory.store.sql import immediate, keyed, raw_sqlite, reading, table_of, utc
from durable_memory.memory.store.sql.direct import Write, run
from durable_memory.models.turn import ErasureRecord

USER_TABLES = (
    "pending_diffs",
    "recall_messages",
    "conversation_summaries",
    "user_turn_contexts",
    "user_turn_steps",
    "rotation_state",
    "user_data_keys",
    "prompt_bases",
    "redactions_under_way",
    "users",
)
"""Every table keyed by a user (`user_id`), the list of who has memory (`users`) last: a
forget killed half-way is still listed (the rotation sweep leaves them out: store/users.py).
`user_data_keys` holds the user's payload key (store/users.py): deleting it is the
crypto-shredding of whatever of theirs Temporal still keeps encrypted."""


def user_hash(user_id: str) -> str:
    return hashlib.sha256(validate_user_id(user_id).encode()).hexdigest()


class ErasureRow(SQLModel, table=True):
    __tablename__ = "erasures"

    id: int | None = Field(default=None, primary_key=True)
    user_hash: str = Field(index=True, max_length=64)
    requested_by: str = Field(max_length=200)
    reason: str = Field(max_length=2000)
    started_at: datetime
    completed_at: datetime | None = None
    readmitted_at: datetime | None = None


ERASURES = table_of(ErasureRow)
LEDGER_COLUMNS = (
    ERASURES.c.id,
    ERASURES.c.requested_by,
    ERASURES.c.started_at,
    ERASURES.c.completed_at,
    ERASURES.c.readmitted_at,
)
"""What the per-step check decides on (`refuse_by_records`): a `LedgerRecord`."""
_ERASURES_OF = (
    select_columns(*LEDGER_COLUMNS)
    .where(*keyed(ERASURES, "user_hash"))
    .order_by(ERASURES.c.id.desc())
)
"""A user's erasures, newest first: every step of every turn asks (built once, sql.py).
Newest by id, the order the database gave the records, never by `started_at`: that is a
clock of whichever host began the forget, and hosts' clocks differ."""


def erasures_read(user_id: str) -> Write:
    """`ErasureLedger.refuse_if_forgotten`'s read of the user's records, not run: for a step
    that sends it with a read of its own in one round trip (`run_together`), then decides on
    the rows (`refuse_by_records`, through `UserDirectory.refuse_if_forgotten`'s `read`)."""
    return Write(_ERASURES_OF, {"user_hash": user_hash(user_id)})


def _record(row: ErasureRow) -> ErasureRecord:
    return ErasureRecord(
        user_hash=row.user_hash,
        requested_by=row.requested_by,
        reason=row.reason,
        started_at=utc(row.started_at),
        completed_at=utc(row.completed_at) if row.completed_at is not None else None,
        readmitted_at=utc(row.readmitted_at) if row.readmitted_at is not None else None,
    )


class _ErasureState(Protocol):
    """What deciding whether a record keeps a user out reads: an `ErasureRow`, or a plain row
    of those columns (the per-step check reads no ORM objects)."""

    @property
    def requested_by(self) -> str: ...
    @property
    def started_at(self) -> datetime: ...
    @property
    def completed_at(self) -> datetime | None: ...
    @property
    def readmitted_at(self) -> datetime | None: ...


_State = TypeVar("_State", bound=_ErasureState)


def _being_forgotten(user_id: str, row: _ErasureState) -> UserBeingForgotten:
    return UserBeingForgotten(
        f"user '{user_id}' is being forgotten (requested by {row.requested_by} at "
        f"{utc(row.started_at).isoformat(timespec='seconds')}): no turn or change is "
        "accepted until it completes"
    )


def _closing(newest_first: Sequence[_State]) -> _State | None:
    """The record that keeps a user out, of their records newest first: an open one (their
    forget is under way), else the newest if no caller started them afresh since."""
    if open_row := next((row for row in newest_first if row.completed_at is None), None):
        return open_row
    latest = newest_first[0] if newest_first else None
    return latest if latest is not None and latest.readmitted_at is None else None


class ErasureLedger:
    """The erasure records; an open one (begun, not completed) keeps the user's turns out."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def _open(self, session: Session, user_id: str) -> ErasureRow | None:
        return session.exec(
            select(ErasureRow).where(
                ErasureRow.user_hash == user_hash(user_id), col(ErasureRow.completed_at).is_(None)
            )
        ).first()

    def begin(self, user_id: str, requested_by: str, reason: str) -> ErasureRecord:
        """Open the user's erasure record; idempotent: an open one is returned as it is."""
        if not requested_by.strip() or not reason.strip():
            raise DurableMemoryError("forgetting a user needs who asks (--as) and why (--reason)")
        with Session(self.engine) as session:
            row = self._open(session, user_id)
            if row is None:
                row = ErasureRow(
                    user_hash=user_hash(user_id),
                    requested_by=requested_by[:200],
                    reason=reason[:2000],
                    started_at=datetime.now(UTC),
                )
                session.add(row)
                session.commit()
                session.refresh(row)
            return _record(row)

    def complete(self, user_id: str) -> ErasureRecord:
        """Close the open record (idempotent): the newest record of the user."""
        with Session(self.engine) as session:
            row = self._open(session, user_id)
            if row is not None:
                row.completed_at = datetime.now(UTC)
                session.add(row)
                session.commit()
                session.refresh(row)
                return _record(row)
        records = self.records(user_id)
        if not records:
            raise DurableMemoryError(f"no erasure of user '{user_id}' was begun")
        return records[0]

    def refuse_if_open(self, user_id: str) -> None:
        """UserBeingForgotten while the user's erasure is under way."""
        with Session(self.engine) as session:
            row = self._open(session, user_id)
        if row is not None:
            raise _being_forgotten(user_id, row)

    def refuse_if_forgotten(self, user_id: str, since: int | None = None) -> int:
        """UserBeingForgotten while the user's erasure is under way; UserForgotten once it
        completed, until a caller starts the user afresh (`readmit`). So a step of a turn
        begun before the forget, or a request retried after it, writes nothing again. One
        query: every step of a turn asks.

        Returns what the turn's later steps pass as `since`: the newest record's id (0: none).
        Given `since` (what the turn's first check returned), a record begun after it refuses
        even once the user was started afresh (UserForgotten, `started_afresh`): the turn
        began in the memory that forget erased, and the user's new memory is not its."""
        read = erasures_read(user_id)
        with reading(self.engine) as connection:  # plain rows: ORM objects cost 2-3x more
            rows = run(connection, read.statement, read.params).all()
        return refuse_by_records(user_id, rows, since)

    def closed_user_hashes(self) -> set[str]:
        """The `user_hash` of every user closed to memory (being forgotten, or forgotten and
        not started afresh), as `refuse_if_forgotten` decides it, from one query over the
        whole ledger: for a listing of many users (the rotation sweep's)."""
        by_user: dict[str, list[ErasureRow]] = {}
        with Session(self.engine) as session:
            ordered = select(ErasureRow).order_by(col(ErasureRow.id).desc())
            for row in session.exec(ordered):
                by_user.setdefault(row.user_hash, []).append(row)
        return {hashed for hashed, rows in by_user.items() if _closing(rows) is not None}

    def readmit(self, user_id: str) -> None:
        """A caller starts the forgotten user afresh (idempotent; UserBeingForgotten while a
        forget is under way)."""
        self.refuse_if_open(user_id)
        with Session(self.engine) as session:
            row = session.exec(self._newest_first(user_id)).first()
            if row is not None and row.readmitted_at is None:
                row.readmitted_at = datetime.now(UTC)
                session.add(row)
                session.commit()

    @staticmethod
    def _newest_first(user_id: str) -> SelectOfScalar[ErasureRow]:
        return (
            select(ErasureRow)
            .where(ErasureRow.user_hash == user_hash(user_id))
            .order_by(col(ErasureRow.id).desc())
        )

    def records(self, user_id: str) -> list[ErasureRecord]:
        """The user's erasure records, newest first."""
        with Session(self.engine) as session:
            return [_record(row) for row in session.exec(self._newest_first(user_id)).all()]


class LedgerRecord(_ErasureState, Protocol):
    """A row of `LEDGER_COLUMNS`: what the per-step check decides on."""

    @property
    def id(self) -> int: ...


def refuse_by_records(user_id: str, rows: Sequence[LedgerRecord], since: int | None) -> int:
    """`ErasureLedger.refuse_if_forgotten`'s decision on the user's records as read, newest
    first (its own read, or a turn's admission read: store/users.py `UserDirectory.admission`)."""
    newest = max((row.id for row in rows), default=0)
    closing = _closing(rows)
    if closing is None and since is not None and newest > since:
        forget = next(row for row in rows if row.id == newest)
        raise UserForgotten(
            f"user '{user_id}' was forgotten after this turn began (on "
            f"{utc(forget.started_at).date().isoformat()}) and started afresh since: "
            "nothing of the turn is written into their new memory",
            started_afresh=True,
        )
    if closing is None:
        return newest
    if closing.completed_at is None:
        raise _being_forgotten(user_id, closing)
    raise UserForgotten(
        f"user '{user_id}' was forgotten on "
        f"{utc(closing.completed_at).date().isoformat()}: nothing is kept or written for "
        "them; to start them again with an empty memory, ask for it "
        "(send_message(..., fresh_user=True), dmem chat --fresh-user)"
    )


def erase_user_rows(
    engine: Engine, user_id: str, *, keep_listed: bool = False, only_while_closed: bool = False
) -> int:
    """Delete every row of the user from every table (idempotent); how many were deleted. On
    SQLite, the freed bytes are zeroed and the WAL emptied (see the module). `keep_listed`:
    all but their row in `users`, for a step that finds the user's forget under way (the
    forget deletes that row last itself). `only_while_closed`: nothing is deleted if the
    user is open to memory (started afresh since a step saw their forget: what they have is
    their new memory), decided in the deleting transaction, so a fresh start waits for it
    or comes first."""
    validate_user_id(user_id)
    tables = tuple(t for t in USER_TABLES if not keep_listed or t != "users")
    if engine.dialect.name == "sqlite":
        return _erase_sqlite(engine, user_id, tables, only_while_closed)
    deleted = 0
    with engine.begin() as conn:
        if only_while_closed:  # FOR SHARE: a fresh start (an update of the record) waits
            ledger = _ERASURES_OF.with_for_update(read=True)
            if _closing(conn.execute(ledger, {"user_hash": user_hash(user_id)}).all()) is None:
                return 0
        for name in tables:
            table = SQLModel.metadata.tables[name]
            deleted += int(conn.execute(table.delete().where(table.c.user_id == user_id)).rowcount)
    return deleted


class _LedgerRow(NamedTuple):
    requested_by: str
    started_at: datetime
    completed_at: datetime | None
    readmitted_at: datetime | None

    @classmethod
    def of_sqlite(
        cls, requested_by: str, started: str, completed: str | None, readmitted: str | None
    ) -> "_LedgerRow":
        """A row as sqlite3 returns it: the times are the text SQLAlchemy stored."""
        return cls(
            requested_by, datetime.fromisoformat(started), _time(completed), _time(readmitted)
        )


def _time(text: str | None) -> datetime | None:
    return None if text is None else datetime.fromisoformat(text)


def _erase_sqlite(
    engine: Engine, user_id: str, tables: Sequence[str], only_while_closed: bool
) -> int:
    with raw_sqlite(engine) as db:  # its connections run with secure_delete (sql.py)
        with immediate(db):  # the write lock: a fresh start (a write) waits for it
            if only_while_closed:
                found = db.execute(
                    "SELECT requested_by, started_at, completed_at, readmitted_at FROM erasures "
                    "WHERE user_hash = ? ORDER BY id DESC",
                    (user_hash(user_id),),
                ).fetchall()
                if _closing([_LedgerRow.of_sqlite(*row) for row in found]) is None:
                    return 0
            deleted = 0
            for name in tables:
                deleted += db.execute(f"DELETE FROM {name} WHERE user_id = ?", (user_id,)).rowcount
            # One merged segment: FTS5 drops a deleted row's tokens only when merging.
            db.execute(f"INSERT INTO {RECALL_FTS.name} ({RECALL_FTS.name}) VALUES ('optimize')")
        truncate_wal(db)
    return deleted


def truncate_wal(db: sqlite3.Connection) -> None:
    """Copy the WAL into the database file and empty it: its old page images hold what was
    deleted. StoreBusy (retried) when a reader keeps it from completing."""
    busy, _, _ = db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
    if busy:
        raise StoreBusy("a reader kept the SQLite WAL from being emptied; the step is retried")
