"""store/sql/direct.py runs a turn's statements on the driver's cursor instead of through
SQLAlchemy's `Connection.execute`. It must be indistinguishable from `execute` to every
caller: the same rows (values, Python types, time zones, names), the same row counts, the
same error classes with the database left as it was, the same listeners called, and the
statements it does not handle run by SQLAlchemy unchanged. Each on SQLite and PostgreSQL, over
every table and column type the stores have."""

from contextlib import nullcontext
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, Table, bindparam, event, insert, select, text
from sqlalchemy.exc import IntegrityError, MultipleResultsFound, NoResultFound
from sqlmodel import SQLModel

import durable_memory.bootstrap  # noqa: F401  every store's table is in the metadata
from durable_memory.memory.store.sql import (
    direct,
    insert_keeping,
    one_connection,
    reading,
    table_of,
    writing_once,
)
from durable_memory.memory.store.sql.direct import run
from tests.support.memory import round_trips, statements_sent

TABLES = [t for t in SQLModel.metadata.sorted_tables if "user_id" in t.c]
"""Every table keyed by a user: all the column types the stores use (integers, text, UTC
times, booleans, floats, bytes), nullable or not."""


def _value(table: Table, column: str, n: int) -> Any:
    kind = type(table.c[column].type).__name__
    if column == "user_id":  # distinct (some tables keep one row a user); "user-1-%": odd n
        return f"user-{n % 2}-{n}"
    if kind == "Integer":
        return 1000 * n + len(column)
    if kind == "UTCDateTime":
        return datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC) + timedelta(hours=n)
    if kind == "Boolean":
        return n % 2 == 0
    if kind == "Float":
        return 0.25 * n
    if kind == "LargeBinary":
        return bytes([n, 0, 255])
    text = f"{n} {column} ' %s :x ünïcode"  # quoting and paramstyle markers are data
    return text[: getattr(table.c[column].type, "length", None) or len(text)]


def _rows(table: Table, numbers: range) -> list[dict[str, Any]]:
    """Rows with every column given (nullable ones alternately None)."""
    rows = []
    for n in numbers:
        row = {}
        for column in table.c:
            null = column.nullable and not column.primary_key and n % 3 == 0
            row[column.name] = None if null else _value(table, column.name, n)
        rows.append(row)
    return rows


def _of_user(table: Table) -> Any:
    """The rows of user-0 or of user-1 (`user_id`: "user-0-%" or "user-1-%")."""
    order = list(table.primary_key.columns)
    return select(*table.c).where(table.c.user_id.like(bindparam("user_id"))).order_by(*order)


@pytest.fixture
def filled(engine: Engine) -> Engine:
    with engine.begin() as connection:
        for table in TABLES:
            connection.execute(insert(table), _rows(table, range(1, 7)))
    return engine


def _as_sqlalchemy(engine: Engine, statement: Any, params: Any) -> list[tuple[Any, ...]]:
    with reading(engine) as connection:
        return [tuple(row) for row in connection.execute(statement, params)]


def _typed(rows: list[Any]) -> list[tuple[tuple[Any, str, str | None], ...]]:
    """Each value with its type and time zone: equal values of other types must not pass."""
    return [
        tuple((v, type(v).__name__, str(getattr(v, "tzinfo", None))) for v in row) for row in rows
    ]


@pytest.mark.parametrize("table", TABLES, ids=lambda t: t.name)
def test_a_read_gives_the_rows_execute_gives(filled: Engine, table: Table) -> None:
    statement = _of_user(table)
    for held in (False, True):
        with one_connection(filled) if held else nullcontext(), reading(filled) as connection:
            got = run(connection, statement, {"user_id": "user-1-%"}).all()
            expected = connection.execute(statement, {"user_id": "user-1-%"})
            names, want = list(expected.keys()), list(expected.all())
        assert len(got) == 3
        assert _typed(got) == _typed(want)
        assert [list(row._fields) for row in got] == [names] * 3
        assert all(row.user_id.startswith("user-1-") for row in got)  # by name, as SQLAlchemy's


@pytest.mark.parametrize("table", TABLES, ids=lambda t: t.name)
def test_a_write_stores_what_execute_stores(engine: Engine, table: Table) -> None:
    """The same rows written each way read back the same: each column type's bind processing
    is SQLAlchemy's (a UTC time on SQLite, bytes, booleans, floats)."""
    rows = _rows(table, range(10, 14))
    everything = select(*table.c).order_by(*table.primary_key.columns)
    with writing_once(engine) as connection:
        assert run(connection, insert(table), rows[0]).rowcount == 1  # one row
    with writing_once(engine) as connection:
        assert run(connection, insert(table), rows[1:2]).rowcount == 1  # a list of one
    with writing_once(engine) as connection:
        assert run(connection, insert(table), rows[2:]).rowcount == 2  # executemany
    ours = _as_sqlalchemy(engine, everything, {})
    with engine.begin() as connection:
        connection.execute(table.delete())
        connection.execute(insert(table), rows)
    theirs = _as_sqlalchemy(engine, everything, {})
    assert len(ours) == 4
    assert _typed(ours) == _typed(theirs)


def test_an_insert_that_keeps_a_stored_row_counts_as_execute_does(engine: Engine) -> None:
    table = table_of(SQLModel.metadata.tables["user_turn_steps"])
    keeping = insert_keeping(engine, table, "user_id", "turn_id", "step")
    rows = _rows(table, range(1, 3))
    counts = []
    for attempt in (rows, rows, [*rows, *_rows(table, range(3, 4))]):
        with writing_once(engine) as connection:
            counts.append(run(connection, keeping, attempt).rowcount)
    assert counts == [2, 0, 1]
    with writing_once(engine) as connection:
        odd = table.delete().where(table.c.user_id.like(bindparam("u")))
        gone = run(connection, odd, {"u": "user-1-%"})
    assert gone.rowcount == 2  # rows 1 and 3


def test_one_and_scalar_say_what_sqlalchemy_says(filled: Engine) -> None:
    table = SQLModel.metadata.tables["recall_messages"]
    users = select(table.c.user_id).where(table.c.user_id.like(bindparam("u"))).order_by("id")
    with reading(filled) as connection:
        none = run(connection, users, {"u": "nobody"})
        many = run(connection, users, {"u": "user-1-%"})
        counted = run(connection, text("SELECT count(*) FROM recall_messages"), {})
    assert none.first() is None
    assert none.scalar() is None
    assert none.all() == []
    with pytest.raises(NoResultFound):
        none.one()
    with pytest.raises(MultipleResultsFound):
        many.one()
    assert many.scalars() == ["user-1-1", "user-1-3", "user-1-5"]
    assert many.scalar() == "user-1-1"
    assert counted.scalar_one() == 6


def test_a_failed_write_raises_sqlalchemys_error_and_changes_nothing(filled: Engine) -> None:
    """A duplicate key: IntegrityError as from `execute`, and the executemany's first row, new,
    not written either (SQLite: the caller's transaction rolled back; PostgreSQL: the rows
    are sent as one pipeline, one implicit transaction); the connection held for the step is
    given back, so its next statement works."""
    table = SQLModel.metadata.tables["user_turn_contexts"]
    before = _as_sqlalchemy(filled, select(*table.c), {})
    clash = _rows(table, range(50, 51)) + _rows(table, range(1, 2))  # a new row, then a stored key
    with one_connection(filled):
        with pytest.raises(IntegrityError), writing_once(filled) as connection:
            run(connection, insert(table), clash)
        with reading(filled) as connection:
            assert len(run(connection, select(*table.c), {}).all()) == len(before)
    assert _as_sqlalchemy(filled, select(*table.c), {}) == before


def test_statements_it_does_not_handle_are_run_by_sqlalchemy(
    filled: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An expanding IN, a RETURNING, and any statement once the kept shapes are full: the
    same answers, from SQLAlchemy (its `execute` is seen running them)."""
    table = SQLModel.metadata.tables["recall_messages"]
    among = select(table.c.id).where(table.c.user_id.in_(bindparam("users", expanding=True)))
    returning = (
        table.update()
        .where(table.c.user_id == bindparam("u"))
        .values(content="edited")
        .returning(table.c.id)
    )
    fresh = select(table.c.id).where(table.c.user_id == bindparam("u")).order_by(table.c.id)
    monkeypatch.setattr(direct, "_MAX_PLANS", len(direct._plans))  # full: nothing more kept
    by_sqlalchemy: list[Any] = []

    def seen(_conn: Any, _cursor: Any, _sql: str, _params: Any, context: Any, _many: Any) -> None:
        by_sqlalchemy.append(context is not None)

    event.listen(filled, "before_cursor_execute", seen)
    try:
        with writing_once(filled) as connection:
            ids = run(connection, among, {"users": ["user-0-2", "user-1-3"]}).scalars()
            edited = run(connection, returning, {"u": "user-0-2"}).scalars()
            listed = run(connection, fresh, {"u": "user-1-3"}).scalars()
    finally:
        event.remove(filled, "before_cursor_execute", seen)
    assert sorted(ids) == [2002, 3002]  # the rows of n = 2 and 3 (ids 1000 n + len("id"))
    assert len(edited) == 1
    assert len(listed) == 1
    assert by_sqlalchemy == [True, True, True]


def test_listeners_see_each_statement_once(filled: Engine) -> None:
    table = SQLModel.metadata.tables["users"]
    statement = _of_user(table)
    with statements_sent(filled) as sent, reading(filled) as connection:
        run(connection, statement, {"user_id": "user-0-%"})
        run(connection, statement, {"user_id": "user-1-%"})
    assert len(sent) == 2
    assert all(s.startswith("SELECT users.user_id") for s in sent)


@pytest.mark.parametrize("pipelines", [True, False], ids=["pipeline", "no-pipeline"])
def test_writes_run_together_are_all_kept_or_none(
    filled: Engine, pipelines: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`run_together`: a stored key met by the batch's last write fails it with SQLAlchemy's
    IntegrityError, and nothing of the batch is kept, not its new rows before (a keeping
    insert, an executemany), nor the delete; on PostgreSQL the batch was one round trip, or,
    with a libpq that has no pipeline mode, one transaction. The connection held for the step
    is given back: its next statement works."""
    monkeypatch.setattr(direct, "_pipelines", lambda: pipelines)
    contexts = SQLModel.metadata.tables["user_turn_contexts"]
    recall = SQLModel.metadata.tables["recall_messages"]
    before = {t.name: _as_sqlalchemy(filled, select(*t.c), {}) for t in (contexts, recall)}
    stored = _rows(contexts, range(1, 2))  # a key the fixture stored
    batch = [
        direct.Write(
            insert_keeping(filled, contexts, "user_id", "turn_id"), _rows(contexts, range(60, 61))
        ),
        direct.Write(insert(recall), _rows(recall, range(61, 63))),
        direct.Write(
            contexts.delete().where(contexts.c.user_id == bindparam("u")), {"u": "user-0-2"}
        ),
        direct.Write(insert(contexts), stored),
    ]
    with one_connection(filled), round_trips(filled) as trips:
        with pytest.raises(IntegrityError), writing_once(filled) as connection:
            direct.run_together(connection, batch)
        with reading(filled) as connection:
            assert len(run(connection, select(*contexts.c), {}).all()) == len(before[contexts.name])
    assert {t.name: _as_sqlalchemy(filled, select(*t.c), {}) for t in (contexts, recall)} == before
    together = filled.dialect.name == "postgresql" and pipelines
    assert [len(trip) for trip in trips] == ([4, 1] if together else [1, 1, 1, 1, 1])


def test_writes_run_together_answer_as_run_one_by_one(filled: Engine) -> None:
    """In order, each seeing the ones before (a row inserted, then read back), each answering
    as `run` does (rows, row counts; an insert that kept a stored row counts 0), a write of no
    rows runs nothing and answers no rows, in its place; on PostgreSQL, one round trip."""
    table = SQLModel.metadata.tables["user_turn_steps"]
    keeping = insert_keeping(filled, table, "user_id", "turn_id", "step")
    new, stored = _rows(table, range(80, 81)), _rows(table, range(1, 2))
    read = select(table.c.user_id, table.c.step).where(table.c.user_id == bindparam("u"))
    batch = [
        direct.Write(keeping, new),
        direct.Write(keeping, stored),
        direct.Write(keeping, []),
        direct.Write(read, {"u": new[0]["user_id"]}),
    ]
    with round_trips(filled) as trips, writing_once(filled) as connection:
        outcomes = direct.run_together(connection, batch)
    assert [o.rowcount for o in outcomes[:3]] == [1, 0, 0]
    assert outcomes[2].all() == []
    assert [tuple(r) for r in outcomes[3]] == [(new[0]["user_id"], new[0]["step"])]
    assert outcomes[3].first().step == new[0]["step"]
    postgres = filled.dialect.name == "postgresql"
    assert [len(trip) for trip in trips] == ([3] if postgres else [1, 1, 1])


@pytest.mark.parametrize("pipelines", [True, False], ids=["pipeline", "no-pipeline"])
def test_a_batch_cut_short_on_this_side_keeps_nothing(
    filled: Engine, pipelines: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure before the database saw the whole batch (here a listener raising at its
    second statement; as well a value the driver refuses, or a cancellation) keeps none of
    the statements already sent: the batch's own COMMIT was never sent."""
    monkeypatch.setattr(direct, "_pipelines", lambda: pipelines)
    contexts = SQLModel.metadata.tables["user_turn_contexts"]
    before = _as_sqlalchemy(filled, select(*contexts.c), {})
    batch = [direct.Write(insert(contexts), _rows(contexts, range(70 + n, 71 + n))) for n in (0, 1)]
    seen: list[str] = []

    def second_fails(*_: Any) -> None:
        seen.append("x")
        if len(seen) == 2:
            raise RuntimeError("cut short")

    event.listen(filled, "before_cursor_execute", second_fails)
    try:
        with one_connection(filled):
            with pytest.raises(Exception, match="cut short"), writing_once(filled) as connection:
                direct.run_together(connection, batch)
            with reading(filled) as connection:  # the held connection works after it
                assert len(run(connection, select(*contexts.c), {}).all()) == len(before)
    finally:
        event.remove(filled, "before_cursor_execute", second_fails)
    assert _as_sqlalchemy(filled, select(*contexts.c), {}) == before
