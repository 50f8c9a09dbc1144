"""The users this deployment serves, as a SQL table: what the rotation sweep lists.

A user's repository may live on any worker's disk, or (distributed) behind a git server, so
no one disk can list every user; the shared database can. A user is registered whenever their
memory is ensured (`Blocks.ensure_user`, which every turn's first step runs), after their
repository exists, so every listed user has one somewhere.

Migration: a deployment from before this table has users on disk only. Each `dmem worker`
registers the users of its own data dir when it starts (`Blocks.register_local_users`), and
any user's next turn registers them too; registering is idempotent, so both are cheap.

Beside it, each user's payload key (`user_data_keys`, below), for `payload_encryption:
per_user` (durable_memory/codec/): one row per user, the key itself wrapped by the master
key, so the table alone decrypts nothing. This module only keeps the bytes; generating,
wrapping and using a key is the codec's.

Forgetting a user deletes their row with their other rows (store/erasure.py's USER_TABLES):
that is the crypto-shredding, as every payload of theirs left in Temporal (a history not yet
deleted, an archive, a backup) was encrypted with the key that row held. While a forget is
under way no key is made for the user (UserBeingForgotten), so a turn that arrives then is
refused before its first payload is encrypted, and nothing recreates the key behind the
forget's back.
"""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import Engine, LargeBinary, bindparam, func, literal_column, update
from sqlalchemy import select as select_columns
from sqlmodel import Column, Field, Session, SQLModel, col, select

from durable_memory.memory.core.ids import validate_user_id
from durable_memory.memory.store.diffs import UNFINISHED_APPROVAL_EXISTS
from durable_memory.memory.store.erasure import (
    ERASURES,
    LEDGER_COLUMNS,
    ErasureLedger,
    LedgerRecord,
    refuse_by_records,
    user_hash,
)
from durable_memory.memory.store.redaction.gate import UNDER_WAY, OpenRedaction
from durable_memory.memory.store.sql import insert_keeping, reading, table_of, writing_once
from durable_memory.memory.store.sql.direct import run

REGISTER_BATCH = 1000


class UserRow(SQLModel, table=True):
    __tablename__ = "users"

    user_id: str = Field(primary_key=True, max_length=64)
    """The primary key is the index: listing reads it in order, registering probes it."""
    registered_at: datetime


_USERS = table_of(UserRow)
_REGISTERED_AMONG = select_columns(_USERS.c.user_id).where(
    _USERS.c.user_id.in_(bindparam("user_ids", expanding=True))
)

_ONE_ROW = select_columns(literal_column("1").label("one")).subquery("one_row")
_ADMISSION = (
    select_columns(
        *LEDGER_COLUMNS,
        UNDER_WAY.c.requested_by.label("redaction_requested_by"),
        UNDER_WAY.c.started_at.label("redaction_started_at"),
        _USERS.c.user_id.label("listed"),
        UNFINISHED_APPROVAL_EXISTS.label("unfinished_approvals"),
    )
    .select_from(_ONE_ROW)
    .outerjoin(ERASURES, ERASURES.c.user_hash == bindparam("user_hash"))
    .outerjoin(UNDER_WAY, UNDER_WAY.c.user_id == bindparam("user_id"))
    .outerjoin(_USERS, _USERS.c.user_id == bindparam("user_id"))
    .order_by(ERASURES.c.id.desc())
)
"""A turn's admission in one statement (`UserDirectory.admission`): the user's erasure
records, newest first (the columns store/erasure.py's per-step check reads), beside the open
redaction record, the user's row in the list and whether they have an approval to finish
(recorded, not committed), each repeated on every row; one row of NULLs where the user has
none of them. Built once, its values bound when it runs (sql.py
`keyed`)."""


@dataclass(frozen=True)
class AdmissionRead:
    """What a turn's admission reads in one statement (`UserDirectory.admission`)."""

    erasures: Sequence[LedgerRecord]
    """The user's erasure records, newest first: `refuse_if_forgotten(..., read=)` decides
    on them."""
    redaction: OpenRedaction | None
    """The redaction of the user under way, if any (store/redaction/gate.py)."""
    listed: bool
    """Whether the user was registered (then a turn need not register them again)."""
    unfinished_approvals: bool = True
    """Whether the user had an approval recorded but not committed (a decision whose commit
    a crash or an outage interrupted, or one committing right now): only then does a turn read
    the approvals to finish them (`Review.finish_approvals`)."""


@dataclass(frozen=True)
class ErasuresRead:
    """The user's erasure records as a step read them with a read of its own, newest first
    (store/erasure.py `erasures_read`): `refuse_if_forgotten(..., read=)` decides on them."""

    erasures: Sequence[LedgerRecord]


class UserDirectory:
    """Every user who has memory, whichever host holds their repository."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def register(self, user_ids: Iterable[str]) -> None:
        """Record the users; those already recorded are left as they are. Safe under
        concurrent registration of the same user (insert ... on conflict do nothing).

        Every turn registers its user, nearly always one recorded long ago: a read finds them
        and nothing is written (a write transaction cost ~4x the read on SQLite, and took a
        write on PostgreSQL each turn). Only those the read did not find are inserted."""
        now = datetime.now(UTC)
        ids = list(dict.fromkeys(user_ids))
        # In batches: a statement's bound parameters are limited (SQLite: 32766).
        for start in range(0, len(ids), REGISTER_BATCH):
            batch = ids[start : start + REGISTER_BATCH]
            with reading(self.engine) as conn:
                found = set(conn.execute(_REGISTERED_AMONG, {"user_ids": batch}).scalars())
            rows = [{"user_id": u, "registered_at": now} for u in batch if u not in found]
            if rows:
                with writing_once(self.engine) as conn:
                    conn.execute(insert_keeping(self.engine, UserRow, "user_id"), rows)

    def refuse_if_forgotten(
        self,
        user_id: str,
        since: int | None = None,
        *,
        read: AdmissionRead | ErasuresRead | None = None,
    ) -> int:
        """UserBeingForgotten while the user's erasure is under way, UserForgotten after it
        until a caller starts them afresh, or for a turn begun before it (`since`); what the
        turn's later checks pass as `since` (store/erasure.py). `read`: decided on the records
        the turn's admission read (`admission`), or a step's own read of them, which is then
        the check."""
        if read is not None:
            return refuse_by_records(user_id, read.erasures, since)
        return ErasureLedger(self.engine).refuse_if_forgotten(user_id, since)

    def admission(self, user_id: str) -> AdmissionRead:
        """The erasure ledger's records of the user, the redaction of them under way and
        whether they are listed, in one statement: a turn asks the first two before it
        compiles anything and again once it stored its context (memory/agent/steps.py),
        where they were two or three statements, each a round trip on PostgreSQL. One
        statement sees one state of the database, as each of those did."""
        params = {"user_hash": user_hash(user_id), "user_id": user_id}
        with reading(self.engine) as connection:  # plain rows, as the per-step check's
            rows = run(connection, _ADMISSION, params).all()
        first = rows[0]  # the outer joins give at least one row
        redaction = (
            None
            if first.redaction_requested_by is None
            else OpenRedaction(first.redaction_requested_by, first.redaction_started_at)
        )
        return AdmissionRead(
            erasures=[row for row in rows if row.id is not None],
            redaction=redaction,
            listed=first.listed is not None,
            unfinished_approvals=bool(first.unfinished_approvals),
        )

    def readmit(self, user_id: str) -> None:
        """A caller starts a forgotten user afresh (nothing of before comes back)."""
        ErasureLedger(self.engine).readmit(validate_user_id(user_id))

    def users(self) -> list[str]:
        """Every registered user open to memory, in id order: one being forgotten (their row
        goes last, so a forget killed half-way leaves it) or forgotten and not started afresh
        is left out, by one query of the erasure ledger for the whole list. So the rotation
        sweep starts nothing for them."""
        with Session(self.engine) as session:
            listed = session.exec(select(UserRow.user_id).order_by(col(UserRow.user_id))).all()
        closed = set(self.closed_among(listed))
        return [user_id for user_id in listed if user_id not in closed]

    def closed_among(self, user_ids: Sequence[str]) -> list[str]:
        """Those of `user_ids` closed to memory (being forgotten, or forgotten and not started
        afresh), from one query of the erasure ledger."""
        closed = ErasureLedger(self.engine).closed_user_hashes()
        return [user_id for user_id in user_ids if closed and user_hash(user_id) in closed]


# -- payload keys (durable_memory/codec/) ---------------------------------------------------


class PayloadKeyRow(SQLModel, table=True):
    __tablename__ = "user_data_keys"

    key_id: str = Field(primary_key=True, max_length=32)
    """Random, 32 hex: what an encrypted payload names, never the user."""
    user_id: str = Field(index=True, unique=True, max_length=64)
    wrapped_key: bytes = Field(sa_column=Column(LargeBinary, nullable=False))
    master_key_id: str = Field(max_length=16)
    """Which master key wrapped it (a fingerprint), so a wrong one is named, not guessed at."""
    created_at: datetime


@dataclass(frozen=True)
class StoredKey:
    key_id: str
    user_id: str
    wrapped_key: bytes
    master_key_id: str


def _stored(row: PayloadKeyRow) -> StoredKey:
    return StoredKey(row.key_id, row.user_id, row.wrapped_key, row.master_key_id)


class PayloadKeyStore:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def for_user(self, user_id: str) -> StoredKey | None:
        with Session(self.engine) as session:
            row = session.exec(
                select(PayloadKeyRow).where(PayloadKeyRow.user_id == validate_user_id(user_id))
            ).first()
            return None if row is None else _stored(row)

    def add(self, candidate: StoredKey) -> StoredKey:
        """Keep `candidate` as its user's key unless the user has one already (two processes
        making the first key at once: one wins, both get the winner). UserBeingForgotten while
        the user's forget is under way, UserForgotten after it until they are started afresh:
        a late step of a turn begun before the forget makes no key for them again."""
        ErasureLedger(self.engine).refuse_if_forgotten(candidate.user_id)
        with self.engine.begin() as conn:
            conn.execute(
                insert_keeping(self.engine, PayloadKeyRow, "user_id"),
                {
                    "key_id": candidate.key_id,
                    "user_id": validate_user_id(candidate.user_id),
                    "wrapped_key": candidate.wrapped_key,
                    "master_key_id": candidate.master_key_id,
                    "created_at": datetime.now(UTC),
                },
            )
        kept = self.for_user(candidate.user_id)
        if kept is None:  # deleted by a forget between the two statements
            ErasureLedger(self.engine).refuse_if_forgotten(candidate.user_id)
            raise LookupError(f"the key of user '{candidate.user_id}' vanished as it was made")
        return kept

    def by_ids(self, key_ids: set[str]) -> dict[str, StoredKey]:
        """The keys of these ids that still exist (a forgotten user's is gone)."""
        if not key_ids:
            return {}
        with Session(self.engine) as session:
            rows = session.exec(
                select(PayloadKeyRow).where(col(PayloadKeyRow.key_id).in_(sorted(key_ids)))
            ).all()
            return {row.key_id: _stored(row) for row in rows}

    def count_by_master_key(self) -> dict[str, int]:
        """How many keys each master key wraps, by its fingerprint."""
        with Session(self.engine) as session:
            rows = session.exec(
                select(PayloadKeyRow.master_key_id, func.count()).group_by(
                    col(PayloadKeyRow.master_key_id)
                )
            ).all()
            return {master_key_id: int(count) for master_key_id, count in rows}

    def wrapped_by(self, master_key_id: str, after_key_id: str, limit: int) -> list[StoredKey]:
        """Up to `limit` keys wrapped by that master key, in key id order after `after_key_id`
        (a cursor: a rewrap passes over a key it cannot open and goes on)."""
        with Session(self.engine) as session:
            rows = session.exec(
                select(PayloadKeyRow)
                .where(
                    PayloadKeyRow.master_key_id == master_key_id,
                    col(PayloadKeyRow.key_id) > after_key_id,
                )
                .order_by(col(PayloadKeyRow.key_id))
                .limit(limit)
            ).all()
            return [_stored(row) for row in rows]

    def rewrap(self, rewrapped: Sequence[tuple[StoredKey, StoredKey]]) -> int:
        """Replace each (old, new) key's wrapping, all in one transaction, each only if the row
        is still as `old` was (a forget deleted it meanwhile, or another rewrap did it: left
        as it is); how many rows changed. Each row keeps its wrapping and the fingerprint of
        the master key that made it together: whenever it stops, every row names its key."""
        changed = 0
        with self.engine.begin() as conn:
            for old, new in rewrapped:
                assert (old.key_id, old.user_id) == (new.key_id, new.user_id)
                result = conn.execute(
                    update(PayloadKeyRow)
                    .where(
                        col(PayloadKeyRow.key_id) == old.key_id,
                        col(PayloadKeyRow.master_key_id) == old.master_key_id,
                    )
                    .values(wrapped_key=new.wrapped_key, master_key_id=new.master_key_id)
                )
                changed += int(result.rowcount)
        return changed
