"""A lone statement of a turn's path run on the driver's cursor, SQLAlchemy's execution step
skipped: `run(connection, statement, params)` where a store said
`connection.execute(statement, params)`.

Why: SQLAlchemy's `Connection.execute` costs ~75 us a statement on SQLite, where the statement
itself takes ~8 us, and ~110 us on PostgreSQL, beside a ~130 us round trip (measured on the
statement every step of a turn runs, the erasure check). A tool-using turn runs ~23 statements
on the path to its reply: ~2.5 ms of Python for nothing the turn needs.

What stays SQLAlchemy's: the statement is written in SQLAlchemy Core and compiled by it (once
per statement, dialect and parameter shape: the stores build their statements once, as module
constants or cached by shape, see `sql.keyed`); the bind and result processors of its column
types are applied as SQLAlchemy applies them (a SQLite datetime is written and read back in
SQLAlchemy's form); the engine's `before_execute` and `before_cursor_execute` listeners see
the statement (tests count statements with them); and a failure goes through SQLAlchemy's own
handling, so callers see the same error classes and a dead connection is invalidated with the
pool's older ones, as `Connection.execute` does (`tests/test_postgres_restart.py`).

What it leaves to `Connection.execute`: expanding (`IN`) parameters, columns filled by
Python-side defaults, RETURNING, and any statement once `_MAX_PLANS` shapes are kept. Rows
come back as named tuples, fetched at once: a turn's statements read a bounded handful.

The transaction is the connection's, as before: in autocommit on PostgreSQL and for a read on
SQLite (`sql.reading`), the caller's (`sql.writing_once`, `engine.begin()`) for a write on
SQLite, committed by SQLAlchemy when its block ends."""

import contextlib
import functools
import threading
from collections import namedtuple
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from sqlalchemy import Connection, Dialect
from sqlalchemy.exc import MultipleResultsFound, NoResultFound, SQLAlchemyError
from sqlalchemy.sql import ClauseElement
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.dml import Insert, UpdateBase
from sqlalchemy.sql.elements import TextClause
from sqlalchemy.sql.selectable import Select

Params = Mapping[str, Any] | Sequence[Mapping[str, Any]] | None

_MAX_PLANS = 512
"""Statement shapes kept compiled; past this a statement is run by SQLAlchemy. The stores
build a few dozen; a caller building statements anew per call does not fill memory."""


@dataclass
class _Plan:
    """One statement compiled for one dialect and parameter shape."""

    compiled: SQLCompiler
    sql: str
    positions: tuple[str, ...] | None
    """The parameters' names in the order a positional driver (SQLite's qmark) takes them;
    None for a driver that takes them by name (psycopg's pyformat)."""
    binds: tuple[tuple[str, Callable[[Any], Any]], ...]
    """The parameters whose column type converts the value for the driver."""
    reading: "_Reading | None" = field(default=None)
    """How its rows are read: made at its first run, from the cursor's column types."""


@dataclass(frozen=True)
class _Reading:
    row: Callable[[Sequence[Any]], tuple[Any, ...]]
    processors: tuple[tuple[int, Callable[[Any], Any]], ...]


class Outcome:
    """What a statement gave: its rows (named tuples; none for a write) and row count, read
    as from SQLAlchemy's Result."""

    __slots__ = ("_rows", "rowcount")

    def __init__(self, rows: list[Any], rowcount: int) -> None:
        self._rows = rows
        self.rowcount = rowcount

    def __iter__(self) -> Iterator[Any]:
        return iter(self._rows)

    def all(self) -> list[Any]:
        return self._rows

    def first(self) -> Any:
        return self._rows[0] if self._rows else None

    def one(self) -> Any:
        if not self._rows:
            raise NoResultFound("No row was found when one was required")
        if len(self._rows) > 1:
            raise MultipleResultsFound("Multiple rows were found when exactly one was required")
        return self._rows[0]

    def scalar(self) -> Any:
        return self._rows[0][0] if self._rows else None

    def scalar_one(self) -> Any:
        return self.one()[0]

    def scalars(self) -> list[Any]:
        return [row[0] for row in self._rows]


_plans: dict[tuple[int, str, tuple[str, ...], bool], tuple[ClauseElement, _Plan | None]] = {}
_plans_lock = threading.Lock()


def run(connection: Connection, statement: ClauseElement, params: Params = None) -> Outcome:
    """`connection.execute(statement, params)`, on the driver's cursor (see the module doc);
    `params` a list of rows runs the statement once per row (executemany; a list of one, as
    SQLAlchemy does, once)."""
    rows_in = _rows(params)
    many = len(rows_in) > 1
    if not rows_in:
        return Outcome([], 0)
    plan = _plan(connection.dialect, statement, tuple(rows_in[0]), many)
    if plan is None:
        result = connection.execute(statement, params)  # type: ignore[call-overload]
        return Outcome(result.all() if result.returns_rows else [], result.rowcount)
    args = _arguments_told(connection, statement, plan, rows_in)
    driver = connection.connection.dbapi_connection
    assert driver is not None
    cursor = None
    try:
        cursor = driver.cursor()
        _send(connection, cursor, plan, args if many else args[0], many)
        rows = _read(plan, connection.dialect, cursor) if cursor.description else []
        outcome = Outcome(rows, cursor.rowcount)
        cursor.close()
    except BaseException as error:
        # SQLAlchemy's own handling, as for a statement it ran: the error wrapped in its class
        # (OperationalError, IntegrityError...), a dead connection invalidated with every
        # older one of the pool, the cursor closed. It raises.
        connection._handle_dbapi_exception(error, plan.sql, args, cursor, None)
    return outcome


@functools.cache
def _pipelines() -> bool:
    """Whether psycopg's libpq has pipeline mode (14 and later; the binary wheel's has): without
    it `run_together` sends its statements one by one, in one transaction all the same. Asked
    only of a PostgreSQL connection: an embedded worker never imports psycopg (~9 MiB)."""
    import psycopg

    return psycopg.Pipeline.is_supported()


class Write(NamedTuple):
    """A statement and its parameters, to be run with others (`run_together`)."""

    statement: ClauseElement
    params: Params


def run_together(connection: Connection, writes: Sequence[Write]) -> list[Outcome]:
    """`run` each of `writes`, in order, all or none. On PostgreSQL in one round trip:
    psycopg's pipeline sends them together, between a BEGIN and a COMMIT of their own where
    the connection is in autocommit (the mode of `reading` and `writing_once` there), so a
    failure anywhere, also on this side before the COMMIT is sent, keeps none of them. Where
    it cannot pipeline (a libpq without pipeline mode, a statement `run` leaves to SQLAlchemy),
    one by one between the same BEGIN and COMMIT. In a transaction of the caller's (and on
    SQLite, whose `writing_once` is one) one by one in it, which a failure rolls back. A
    failure reaches the caller as from `run` (SQLAlchemy's error class). The answers are read
    once the batch is committed: an error in reading them comes after the commit."""
    if not all(_rows(w.params) for w in writes):  # an empty list of rows runs nothing
        kept = iter(run_together(connection, [w for w in writes if _rows(w.params)]))
        return [next(kept) if _rows(w.params) else Outcome([], 0) for w in writes]
    if connection.dialect.driver != "psycopg" or len(writes) == 1:  # a lone one is atomic
        return [run(connection, w.statement, w.params) for w in writes]
    driver = connection.connection.dbapi_connection
    assert driver is not None
    dialect = connection.dialect
    batch = [(w, _rows(w.params)) for w in writes]
    plans = [_plan(dialect, w.statement, tuple(rows[0]), len(rows) > 1) for w, rows in batch]
    own = bool(driver.autocommit)  # else the caller's transaction holds the batch
    sent: list[tuple[_Plan, Any, Any]] = []
    try:
        if not _pipelines() or None in plans:
            return _in_order(connection, driver, writes, own)
        with driver.pipeline():
            if own:
                driver.execute("BEGIN")
            for (write, rows_in), plan in zip(batch, plans, strict=True):
                assert plan is not None
                many = len(rows_in) > 1
                args = _arguments_told(connection, write.statement, plan, rows_in)
                cursor = driver.cursor()
                given: Any = args if many else args[0]
                sent.append((plan, given, cursor))
                _send(connection, cursor, plan, given, many)
            if own:
                driver.execute("COMMIT")
        outcomes = []
        for plan, _given, cursor in sent:
            rows = _read(plan, dialect, cursor) if cursor.description else []
            outcomes.append(Outcome(rows, cursor.rowcount))
            cursor.close()
    except BaseException as error:
        if own:
            _roll_back(driver)
        for _plan_sent, _given, other in sent[:-1]:
            other.close()
        if isinstance(error, SQLAlchemyError):
            raise  # from `run` (no pipeline): SQLAlchemy's handling was done there
        # As `run`: SQLAlchemy's class for the error, a dead connection invalidated. The
        # statement named is the last one sent (the driver does not say which one failed).
        last = sent[-1] if sent else None
        connection._handle_dbapi_exception(
            error, last[0].sql if last else "", last[1] if last else None, last and last[2], None
        )
    return outcomes


def _in_order(
    connection: Connection, driver: Any, writes: Sequence[Write], own: bool
) -> list[Outcome]:
    """`run_together` without a pipeline: between a BEGIN and a COMMIT of its own (`own`), or
    in the caller's transaction. A failure rolls back (`run_together`'s handler)."""
    if own:
        driver.execute("BEGIN")
    outcomes = [run(connection, w.statement, w.params) for w in writes]
    if own:
        driver.execute("COMMIT")
    return outcomes


def _roll_back(driver: Any) -> None:
    """End the batch's own transaction if a failure left it open; the failure is the answer,
    so a connection too broken to roll back (then dropped by the pool) says nothing more."""
    from psycopg import Error
    from psycopg.pq import TransactionStatus

    with contextlib.suppress(Error):
        if driver.info.transaction_status != TransactionStatus.IDLE:
            driver.execute("ROLLBACK")


def _rows(params: Params) -> Sequence[Mapping[str, Any]]:
    return params if isinstance(params, Sequence) else [params or {}]


def _arguments_told(
    connection: Connection,
    statement: ClauseElement,
    plan: _Plan,
    rows_in: Sequence[Mapping[str, Any]],
) -> list[Any]:
    """The driver's arguments for each row, once the `before_execute` listeners have seen the
    statement object, as for `execute`."""
    dispatch = connection.dispatch
    if dispatch.before_execute:
        dispatch.before_execute(connection, statement, list(rows_in), {}, {})
    return [_arguments(plan, row) for row in rows_in]


def _send(connection: Connection, cursor: Any, plan: _Plan, given: Any, many: bool) -> None:
    """Send the statement on `cursor`, once the `before_cursor_execute` listeners saw it."""
    dispatch = connection.dispatch
    if dispatch.before_cursor_execute:
        dispatch.before_cursor_execute(connection, cursor, plan.sql, given, None, many)
    if many:
        cursor.executemany(plan.sql, given)
    else:
        cursor.execute(plan.sql, given)


def _plan(
    dialect: Dialect, statement: ClauseElement, keys: tuple[str, ...], many: bool
) -> _Plan | None:
    key = (id(statement), dialect.name, keys, many)
    found = _plans.get(key)
    if found is not None:
        return found[1]
    with _plans_lock:
        if len(_plans) >= _MAX_PLANS:
            return None
    plan = _compile(dialect, statement, keys, many)
    with _plans_lock:
        # The statement is kept with its plan: its id is not reused while the plan is here.
        _plans.setdefault(key, (statement, plan))
    return plan


def _compile(
    dialect: Dialect, statement: ClauseElement, keys: tuple[str, ...], many: bool
) -> _Plan | None:
    if not isinstance(statement, Select | UpdateBase | TextClause):
        return None
    if isinstance(statement, Insert):
        # Not SQLAlchemy's implicit RETURNING of the new row's key (PostgreSQL, a single row):
        # nothing reads `inserted_primary_key` from here, and one `RETURNING` asked by the
        # statement itself still shows in `returning` below.
        statement = statement.inline()  # generative: a copy
    compiled = statement.compile(
        dialect=dialect,
        column_keys=list(keys) if isinstance(statement, UpdateBase) else None,
        for_executemany=many,
    )
    assert isinstance(compiled, SQLCompiler)
    if (
        any(bind.expanding or bind.literal_execute for bind in compiled.binds.values())
        or compiled.escaped_bind_names
        or compiled.insert_prefetch
        or compiled.update_prefetch
        or compiled.returning
    ):
        return None  # SQLAlchemy fills in, or reads back, more than the statement's text
    binds = []
    for bind in compiled.binds.values():
        processor = bind.type.dialect_impl(dialect).bind_processor(dialect)
        if processor is not None:
            binds.append((compiled.bind_names[bind], processor))
    positions = tuple(compiled.positiontup or ()) if dialect.positional else None
    return _Plan(compiled, compiled.string, positions, tuple(binds))


def _arguments(plan: _Plan, row: Mapping[str, Any]) -> Any:
    values = plan.compiled.construct_params(row)
    for name, processor in plan.binds:
        values[name] = processor(values[name])
    if plan.positions is None:
        return values
    return tuple(values[name] for name in plan.positions)


def _read(plan: _Plan, dialect: Dialect, cursor: Any) -> list[Any]:
    reading = plan.reading
    if reading is None:
        reading = plan.reading = _reading(plan, dialect, cursor.description)
    fetched = cursor.fetchall()
    make = reading.row
    if not reading.processors:
        return [make(values) for values in fetched]
    rows = []
    for values in fetched:
        converted = list(values)
        for index, processor in reading.processors:
            converted[index] = processor(converted[index])
        rows.append(make(converted))
    return rows


def _reading(plan: _Plan, dialect: Dialect, description: Sequence[Any]) -> _Reading:
    """The row type and the column types' result processors, as SQLAlchemy's result would
    apply them (a text statement's columns have no type: read as the driver gives them)."""
    columns = plan.compiled._result_columns
    typed = len(columns) == len(description)
    names = [column[0] for column in columns] if typed else [d[0] for d in description]
    processors = []
    if typed:
        for index, (column, described) in enumerate(zip(columns, description, strict=True)):
            processor = column[3].dialect_impl(dialect).result_processor(dialect, described[1])
            if processor is not None:
                processors.append((index, processor))
    row_type = namedtuple("Row", names, rename=True)  # type: ignore[misc]
    return _Reading(row_type._make, tuple(processors))
