"""The SQL specifics the stores share, each written once: how a SQLite connection is set up
(WAL, lock waits), an immediate transaction, engine creation for SQLite and PostgreSQL, and
the full-text indexes (SQLite FTS5 tagged with the owner of each row, PostgreSQL GIN).
Beside it, `direct.py`: a turn's statements run on the driver's cursor.

Owner-tagged indexes: recall and the embedded archive each keep one FTS5 index for every
user. Each row holds its owner as one token, the user id's bytes in hex (one alphanumeric
token, unique per user id, case included), so a search matches `owner AND terms` and walks
that user's rows only, instead of ranking every user's matches and filtering after.
"""

import contextlib
import functools
import sqlite3
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Connection,
    Engine,
    Insert,
    Select,
    Table,
    bindparam,
    event,
    func,
    make_url,
)
from sqlalchemy import select as select_columns
from sqlalchemy.dialects.postgresql import Insert as PostgresInsert
from sqlalchemy.dialects.postgresql import insert as postgresql_insert
from sqlalchemy.dialects.sqlite import Insert as SqliteInsert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import ArgumentError, DisconnectionError
from sqlmodel import create_engine

LOCK_WAIT_S = 30
"""How long a SQLite writer waits for another's lock before "database is locked"."""
SQLITE_CACHE_KIB = 512
"""The page cache of one SQLite connection (see _SQLITE_PRAGMAS)."""
_SQLITE_PRAGMAS = (
    # WAL lets several processes (workers, CLI) read while one writes; busy_timeout makes a
    # writer wait for the lock instead of failing with "database is locked".
    "PRAGMA journal_mode=WAL",
    f"PRAGMA busy_timeout={LOCK_WAIT_S * 1000}",
    "PRAGMA synchronous=NORMAL",
    # Deleted and overwritten content is zeroed, not left in free space: forgetting a user
    # (store/erasure.py) must leave no byte of theirs in the file.
    "PRAGMA secure_delete=ON",
    # Each connection's page cache, in KiB (SQLite's default is 2,000): a worker holds one
    # connection per activity thread to each file, and their caches fill with the pages of
    # every user they touch; past this, reads come from the OS's file cache, not the heap.
    f"PRAGMA cache_size=-{SQLITE_CACHE_KIB}",
)


def apply_pragmas(db: sqlite3.Connection) -> None:
    for pragma in _SQLITE_PRAGMAS:
        db.execute(pragma)


def connect_sqlite(path: Path) -> sqlite3.Connection:
    """A connection to a SQLite file set up as every store's is, in autocommit mode: the
    caller opens its transactions itself (see `immediate`)."""
    db = sqlite3.connect(path, timeout=LOCK_WAIT_S, isolation_level=None)
    apply_pragmas(db)
    return db


def _pragmas_on_connect(dbapi_connection: Any, _record: Any) -> None:
    apply_pragmas(dbapi_connection)


def is_postgres_url(url: str) -> bool:
    """Whether `url` is a SQLAlchemy URL naming a PostgreSQL database (any driver)."""
    try:
        return make_url(url).get_backend_name() == "postgresql"
    except ArgumentError:  # not a URL at all
        return False


PING_AFTER_IDLE_S = 1.0
"""A pooled PostgreSQL connection unused for longer than this is checked (a ping) before it is
handed out again; see `ping_when_idle`."""


_PING_AFTER_IDLE: "weakref.WeakKeyDictionary[Engine, float]" = weakref.WeakKeyDictionary()
"""Each engine's `ping_when_idle` bound, which a connection held across statements
(`one_connection`) applies itself: the pool's checkout is where it is otherwise applied."""


def ping_when_idle(engine: Engine, idle_s: float) -> None:
    """Check a pooled connection before use only when it sat idle for over `idle_s` seconds.

    SQLAlchemy's `pool_pre_ping` pings at every checkout: a round trip (~70 us here) before
    each of the ~30 statements a turn makes. Pinging only connections that sat idle finds what
    a restarted or failed-over database, a proxy's idle cut or a network drop left dead after
    a quiet spell; a dead one is replaced before any statement sees it. A connection used
    within the last `idle_s` is trusted: if the database restarted in that second, the one
    statement that meets the closed connection fails (a transient error, which the activity's
    retry repeats) and the pool drops every connection made before it, so the next checkout
    connects afresh. `tests/test_postgres_restart.py` proves both halves."""

    _PING_AFTER_IDLE[engine] = idle_s

    @event.listens_for(engine, "checkin")
    def _checked_in(_dbapi_connection: Any, record: Any) -> None:
        record.info["idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _checked_out(dbapi_connection: Any, record: Any, _proxy: Any) -> None:
        since = record.info.get("idle_since")  # none: a connection made for this checkout
        if since is not None and time.monotonic() - since > idle_s:
            # DisconnectionError: the documented way to have the pool replace it (and retry
            # the checkout).
            _ping(engine, dbapi_connection)


def _ping(engine: Engine, dbapi_connection: Any) -> None:
    """DisconnectionError if the driver connection is dead."""
    try:
        engine.dialect.do_ping(dbapi_connection)
    except Exception as dead:
        raise DisconnectionError(f"a pooled connection is dead: {dead}") from dead


def _for_lone_statements(engine: Engine, connection: Connection) -> Connection:
    """`connection` for lone statements: in autocommit on PostgreSQL (see `reading`)."""
    if engine.dialect.name == "postgresql":
        return connection.execution_options(isolation_level="AUTOCOMMIT")
    return connection


POOL_SIZE = 16
"""Connections an engine keeps open between uses (SQLAlchemy's default 5): one per activity
thread of a worker (16), each of which holds one for its activity's statements
(`one_connection`). With 5, every activity past the fifth running at once opened a connection
of its own (on PostgreSQL a new backend, a process) and closed it when the activity ended."""
POOL_OVERFLOW = 29
"""Connections it may open beyond those (SQLAlchemy's default 10), 45 in all: a thread that
holds one may take a second for a transaction, so 16 threads need up to 32 at once. With
fewer, threads that each held one could all wait for a second until the pool's timeout (30
s), then fail. SQLite's engines are sized alike: with SQLAlchemy's 5 + 10 there, twenty
approvals of one user at once waited out that timeout a wave at a time, each decision's first
attempt failing with "QueuePool limit ... reached"."""


class _Held(threading.local):
    """This thread's held connections (`one_connection`), by engine."""

    def __init__(self) -> None:
        self.by_engine: dict[int, _HeldConnection] = {}


_held = _Held()


class _HeldConnection:
    """One pooled connection, checked out at its first statement and kept until the
    `one_connection` block ends (on PostgreSQL in autocommit, as `reading` sets it); given
    back at once after a statement that failed (it may be left in any state, or dead), so
    the next takes a fresh one, and on SQLite after any block that left the driver inside a
    transaction (a read never does: only a write, which `reading` is not for), so no lock is
    held past its block."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.connection: Connection | None = None
        self.used_at = 0.0
        self.depth = 0
        """`reading` blocks open on it: one nested in another shares its connection, and
        only the outermost gives it back (an inner failure the outer catches leaves the
        outer's connection in place, as when each block had its own)."""

    @contextlib.contextmanager
    def use(self) -> Iterator[Connection]:
        if not self.depth:
            self._drop_if_dead()
        if self.connection is None:
            self.connection = _for_lone_statements(self.engine, self.engine.connect())
        self.depth += 1
        try:
            yield self.connection
        except BaseException:
            self.depth -= 1
            if not self.depth:
                self.release()
            raise
        self.depth -= 1
        self.used_at = time.monotonic()
        driver = self.connection.connection.driver_connection
        if not self.depth and isinstance(driver, sqlite3.Connection) and driver.in_transaction:
            self.release()

    def _drop_if_dead(self) -> None:
        """Held unused for longer than the engine's idle bound (a long model call, say), it is
        pinged, as the pool pings an idle connection at checkout (`ping_when_idle`): a
        database restarted or a proxy's idle cut meanwhile costs no statement, since a dead
        one is invalidated and the next statement checks out a fresh one."""
        idle_s = _PING_AFTER_IDLE.get(self.engine)
        connection = self.connection
        if connection is None or idle_s is None or time.monotonic() - self.used_at <= idle_s:
            return
        try:
            _ping(self.engine, connection.connection.dbapi_connection)
        except DisconnectionError:
            connection.invalidate()
            self.release()

    def release(self) -> None:
        connection, self.connection = self.connection, None
        if connection is not None:
            connection.close()


@contextlib.contextmanager
def one_connection(engine: Engine) -> Iterator[None]:
    """Within this block, on this thread, the lone statements of `reading` (and, on
    PostgreSQL, `writing_once`) run on one pooled connection: for one activity's statements (a
    turn's step runs 10-20), each of which otherwise checked a connection out of the pool and
    back in, and on PostgreSQL set and reset its isolation level: ~170 us a statement there,
    against ~90 us for the round trip itself; ~70 us of a ~125 us read on SQLite. Nothing else
    changes: each statement is still alone (in autocommit on PostgreSQL; on SQLite a read
    opens no transaction, and its writes are transactions), and a transaction
    (`engine.begin()`, SQLite's `writing_once`) takes a connection of its own. Nests: an inner
    block uses the outer one's connection."""
    if id(engine) in _held.by_engine:
        yield
        return
    held = _held.by_engine[id(engine)] = _HeldConnection(engine)
    try:
        yield
    finally:
        del _held.by_engine[id(engine)]
        held.release()


@contextlib.contextmanager
def reading(engine: Engine) -> Iterator[Connection]:
    """A connection for one read statement. On PostgreSQL it runs in autocommit: a single
    statement sees one snapshot either way, and a transaction around it cost two more round
    trips (BEGIN, then ROLLBACK at the end: ~130 us of a ~280 us read, some 18 reads a turn).
    Within `one_connection`, on the connection held there. Not for several statements that
    must agree with each other: those take a transaction; nor for a write on SQLite."""
    held = _held.by_engine.get(id(engine))
    if held is not None:
        with held.use() as connection:
            yield connection
        return
    with engine.connect() as connection:
        yield _for_lone_statements(engine, connection)


@contextlib.contextmanager
def writing_once(engine: Engine) -> Iterator[Connection]:
    """A connection for one write statement, committed when the block ends. On PostgreSQL in
    autocommit: one statement is atomic alone, and BEGIN and COMMIT around it cost two more
    round trips. On SQLite a transaction (SQLAlchemy would roll back a bare connection's
    statement when it closes). A second statement in the block, where one is allowed, shares
    the first's transaction on SQLite only: it must not need to."""
    if engine.dialect.name == "postgresql":
        with reading(engine) as connection:  # one statement in autocommit, read or write
            yield connection
    else:
        with engine.begin() as connection:
            yield connection


def insert_keeping(engine: Engine, table: Table | type[Any], *keys: str) -> Insert:
    """An INSERT into `table` that keeps a row already stored under the unique `keys`: ON
    CONFLICT DO NOTHING (SQLite and PostgreSQL share the syntax; the result's rowcount says
    whether it inserted: kept with `preserve_rowcount`, without which SQLAlchemy reports -1
    for an INSERT on psycopg, so every insert looked like one that kept a stored row). Triggers
    fire only for the rows inserted. Built once per dialect, table and keys (see `by_key`):
    pass the rows to `execute`, not to `.values()`."""
    return _insert_keeping(engine.dialect.name, table_of(table), keys)


def conflict_insert(dialect: str, table: Table) -> PostgresInsert | SqliteInsert:
    """An INSERT into `table` in the dialect's own form, which takes ON CONFLICT clauses (SQLite
    and PostgreSQL share their syntax)."""
    return postgresql_insert(table) if dialect == "postgresql" else sqlite_insert(table)


@functools.cache
def _insert_keeping(dialect: str, table: Table, keys: tuple[str, ...]) -> Insert:
    insert = conflict_insert(dialect, table)
    keeping = insert.on_conflict_do_nothing(index_elements=list(keys))
    return keeping.execution_options(preserve_rowcount=True)


def table_of(table: Table | type[Any]) -> Table:
    """A table, or the table of a SQLModel row type."""
    found: Table = table if isinstance(table, Table) else table.__table__
    return found


def keyed(table: Table | type[Any], *keys: str) -> list[ColumnElement[bool]]:
    """`column = :column` for each of `keys`: a WHERE whose values are bound when the
    statement runs, so the statement itself is built once (module constants, `by_key`).
    A statement built anew per call costs SQLAlchemy ~50 us to build and key for its compiled
    cache, about twice what running it on SQLite costs; a turn runs some 20-30 of them."""
    columns = table_of(table).c
    return [columns[k] == bindparam(k) for k in keys]


@functools.cache
def by_key(table: Table, columns: tuple[str, ...], keys: tuple[str, ...]) -> Select[Any]:
    """SELECT `columns` FROM `table` WHERE each of `keys` = its bound value (`keyed`), built
    once per shape: run it with the key's values as parameters."""
    return select_columns(*(table.c[c] for c in columns)).where(*keyed(table, *keys))


def create_sql_engine(url: str, *, ping_after_idle_s: float = PING_AFTER_IDLE_S) -> Engine:
    """An engine for a SQLAlchemy URL: a SQLite file (its connections set up as in
    `connect_sqlite`) or PostgreSQL (`postgresql://` means the psycopg 3 driver)."""
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url.removeprefix("postgresql://")
    sqlite = url.startswith("sqlite")
    engine = create_engine(  # one pool size for both (POOL_OVERFLOW says why)
        url,
        pool_size=POOL_SIZE,
        max_overflow=POOL_OVERFLOW,
        connect_args={"check_same_thread": False, "timeout": LOCK_WAIT_S} if sqlite else {},
    )
    if sqlite:
        event.listen(engine, "connect", _pragmas_on_connect)
    else:
        ping_when_idle(engine, ping_after_idle_s)
    return engine


@contextlib.contextmanager
def immediate(db: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """A transaction that takes the write lock at once (one writer at a time, others wait up
    to LOCK_WAIT_S), committed at the end of the block and rolled back on any exception."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield db
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise


@contextlib.contextmanager
def raw_sqlite(engine: Engine) -> Iterator[sqlite3.Connection]:
    """The driver's own connection of a SQLite engine, for what SQLAlchemy cannot say (FTS5)."""
    raw = engine.raw_connection()
    try:
        db = raw.driver_connection
        if not isinstance(db, sqlite3.Connection):
            raise TypeError(f"a sqlite engine gave a {type(db).__name__} connection")
        yield db
    finally:
        raw.close()


def utc(value: datetime) -> datetime:
    """`value` in UTC, a naive one taken as UTC: SQLite keeps no zone, so what it gives back
    is the UTC time that was written."""
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


@dataclass(frozen=True)
class OwnedIndex:
    """A SQLite FTS5 index `name` of the text `column` of `table`, one row per row of the
    table (`rowid` its integer key), each tagged with its owner (the table's `user_id`)."""

    name: str
    table: str
    rowid: str
    column: str
    tokenize: str

    def ddl(self) -> list[str]:
        """The index (external content: a view adding the owner), and the triggers that keep
        it in step with the table; each CREATE ... IF NOT EXISTS."""
        name, table, rowid, column = self.name, self.table, self.rowid, self.column
        return [
            f"""CREATE VIEW IF NOT EXISTS {name}_source AS
                SELECT {rowid}, hex(user_id) AS owner, {column} FROM {table}""",
            f"""CREATE VIRTUAL TABLE IF NOT EXISTS {name} USING fts5(
                owner, {column}, content='{name}_source', content_rowid='{rowid}',
                tokenize='{self.tokenize}'
            )""",
            f"""CREATE TRIGGER IF NOT EXISTS {name}_insert AFTER INSERT ON {table} BEGIN
                INSERT INTO {name} (rowid, owner, {column})
                VALUES (new.{rowid}, hex(new.user_id), new.{column});
            END""",
            f"""CREATE TRIGGER IF NOT EXISTS {name}_delete AFTER DELETE ON {table} BEGIN
                INSERT INTO {name} ({name}, rowid, owner, {column})
                VALUES ('delete', old.{rowid}, hex(old.user_id), old.{column});
            END""",
        ]

    @property
    def rank(self) -> str:
        """BM25 of a match, lower is better; the owner column weighs nothing."""
        return f"bm25({self.name}, 0.0, 1.0)"

    def match(self, user_id: str, terms: Sequence[str], operator: str) -> str:
        """An FTS5 query: the user's rows whose text holds the terms joined by `operator`."""
        phrases = f" {operator} ".join('"' + t.replace('"', '""') + '"' for t in terms)
        return f'owner : "{user_id.encode().hex()}" AND {self.column} : ({phrases})'

    def create(self, db: sqlite3.Connection, tables: Sequence[str] = ()) -> None:
        """Run `tables` (CREATE ... IF NOT EXISTS statements: the indexed table among them,
        unless it exists already) and create the index, in one immediate transaction. An
        index from before the owner column is dropped with its triggers first and rebuilt
        from its content after; the indexed rows are not touched."""
        with immediate(db):  # one process at a time brings the index up
            found = db.execute(
                "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?", (self.name,)
            ).fetchone()
            outdated = found is not None and "owner" not in found[0]
            if outdated:
                db.execute(f"DROP TRIGGER IF EXISTS {self.name}_insert")
                db.execute(f"DROP TRIGGER IF EXISTS {self.name}_delete")
                db.execute(f"DROP TABLE {self.name}")
            for ddl in [*tables, *self.ddl()]:
                db.execute(ddl)
            if outdated:
                db.execute(f"INSERT INTO {self.name} ({self.name}) VALUES ('rebuild')")


POSTGRES_TEXT_CONFIG = "simple"
"""PostgreSQL's text search configuration: the words as written, no stemming, any language.
The index and the queries must name the same one, or the index is never used."""


def postgres_text_vector(column: Any) -> ColumnElement[Any]:
    return func.to_tsvector(POSTGRES_TEXT_CONFIG, column)


def postgres_text_query(words: ColumnElement[str]) -> ColumnElement[Any]:
    """Every word of `words`, one string (the terms joined by spaces: taken as plain words,
    operators included); a bound parameter, so the statement is built once."""
    return func.plainto_tsquery(POSTGRES_TEXT_CONFIG, words)


def postgres_text_index(name: str, table: str, column: str) -> str:
    """The GIN index that serves `postgres_text_vector(column)`."""
    return (
        f"CREATE INDEX IF NOT EXISTS {name} ON {table} "
        f"USING gin (to_tsvector('{POSTGRES_TEXT_CONFIG}', {column}))"
    )
