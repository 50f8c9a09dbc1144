"""`one_connection` (memory/store/sql): within one activity the lone statements of
`reading` (and on PostgreSQL `writing_once`) share one pooled connection instead of checking
one out of the pool (and on PostgreSQL setting and resetting its isolation level) per
statement. What must not change with it, shown on a real PostgreSQL and on SQLite: every
statement is still committed on its own; a transaction still gets a connection of its own; a
failed statement's connection is given back, so the next statement runs on a fresh one;
nothing stays checked out (or locked) after the block. And the turn's activities run inside
it: a plain turn's first activity, which makes some 15 statements, checks out one connection
for them."""

import concurrent.futures
import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, event, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.pool import QueuePool
from temporalio.testing import ActivityEnvironment

from durable_memory.activities.turn import TurnActivities
from durable_memory.bootstrap import open_stack
from durable_memory.config import Settings
from durable_memory.memory.agent.llm import AnthropicModel
from durable_memory.memory.store.db import make_engine
from durable_memory.memory.store.sql import one_connection, reading, writing_once
from durable_memory.models.turn import TurnInput
from durable_memory.scripted_model import ScriptedModelServer
from durable_memory.workers.worker import ACTIVITY_THREADS
from tests.support.postgres import fresh_schema_url


@pytest.fixture
def engine(postgres_url: str) -> Iterator[Engine]:
    engine = make_engine(fresh_schema_url(postgres_url))
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE notes (id integer PRIMARY KEY, body text NOT NULL)"))
    yield engine
    engine.dispose()


@contextlib.contextmanager
def _checkouts(engine: Engine) -> Iterator[list[int]]:
    """The pool's checkouts within the block, each as the id of the driver connection."""
    seen: list[int] = []

    def checked_out(dbapi_connection: Any, _record: Any, _proxy: Any) -> None:
        seen.append(id(dbapi_connection))

    event.listen(engine, "checkout", checked_out)
    try:
        yield seen
    finally:
        event.remove(engine, "checkout", checked_out)


def _checked_out(engine: Engine) -> int:
    pool = engine.pool
    assert isinstance(pool, QueuePool)
    return pool.checkedout()


def _insert(engine: Engine, note_id: int) -> None:
    with writing_once(engine) as conn:
        conn.execute(text("INSERT INTO notes VALUES (:id, 'x')"), {"id": note_id})


def _count(engine: Engine) -> int:
    with reading(engine) as conn:
        return int(conn.execute(text("SELECT count(*) FROM notes")).scalar_one())


@pytest.mark.postgres
def test_lone_statements_share_one_checkout_and_each_commits_alone(engine: Engine) -> None:
    other = make_engine(engine.url.render_as_string(hide_password=False))
    try:
        with _checkouts(engine) as seen, one_connection(engine):
            for note_id in range(5):
                _insert(engine, note_id)
                # committed at once: another connection sees it before the block ends
                with other.connect() as conn:
                    visible = conn.execute(text("SELECT count(*) FROM notes")).scalar_one()
                assert visible == note_id + 1
            assert _count(engine) == 5
            with one_connection(engine):  # nested: the outer block's connection
                assert _count(engine) == 5
        assert len(seen) == 1
        assert _checked_out(engine) == 0  # given back when the block ended
        with _checkouts(engine) as seen:
            for note_id in range(5, 8):  # outside a block, as before: one checkout each
                _insert(engine, note_id)
        assert len(seen) == 3
    finally:
        other.dispose()


@pytest.mark.postgres
def test_a_failed_statement_gives_its_connection_back(engine: Engine) -> None:
    with _checkouts(engine) as seen, one_connection(engine):
        _insert(engine, 1)
        with pytest.raises(IntegrityError):
            _insert(engine, 1)  # the same key again
        assert _checked_out(engine) == 0  # not kept after the failure
        _insert(engine, 2)  # a fresh checkout, in a usable state
        assert _count(engine) == 2
    assert len(seen) == 2


@pytest.mark.postgres
def test_an_inner_failure_leaves_the_outer_blocks_connection(engine: Engine) -> None:
    """Nested blocks share the connection; a failure inside the inner one that the outer
    code catches must not close the connection the outer block is still using."""
    with one_connection(engine), reading(engine) as outer:
        _insert(engine, 1)
        with pytest.raises(IntegrityError):
            _insert(engine, 1)
        assert outer.execute(text("SELECT count(*) FROM notes")).scalar_one() == 1
    assert _checked_out(engine) == 0


@pytest.mark.postgres
def test_a_transaction_in_the_block_has_a_connection_of_its_own(engine: Engine) -> None:
    with one_connection(engine):
        _insert(engine, 1)
        held = _checked_out(engine)
        with engine.connect() as conn:
            transaction = conn.begin()
            conn.execute(text("INSERT INTO notes VALUES (2, 'y')"))
            assert _checked_out(engine) == held + 1
            transaction.rollback()
        assert _count(engine) == 1  # the transaction's insert rolled back; the lone one stays
    assert _checked_out(engine) == 0


@pytest.mark.parametrize(
    "dialect", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def test_every_activity_thread_holds_a_connection_and_takes_a_transaction_at_once(
    request: pytest.FixtureRequest, tmp_path: Path, dialect: str
) -> None:
    """A worker runs ACTIVITY_THREADS activities at once, each holding a connection for its
    statements and taking a second one for a transaction: twenty approvals of one user do
    exactly that, their commits contending for the user's git lock. A pool smaller than
    2 x ACTIVITY_THREADS lets the threads that hold one wait for a second until the pool's
    timeout (30 s), then fail; SQLite's engines had SQLAlchemy's 5 + 10."""
    if dialect == "sqlite":
        engine = make_engine(f"sqlite:///{tmp_path / 'memory.db'}")
    else:
        engine = make_engine(fresh_schema_url(request.getfixturevalue("postgres_url")))
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE notes (id integer PRIMARY KEY, body text NOT NULL)"))
    all_hold_one = threading.Barrier(ACTIVITY_THREADS, timeout=60)
    all_hold_two = threading.Barrier(ACTIVITY_THREADS, timeout=60)

    def activity(note_id: int) -> int:
        with one_connection(engine):
            _count(engine)  # the held connection is checked out
            all_hold_one.wait()
            with engine.connect() as second, second.begin():
                second.execute(text("SELECT count(*) FROM notes")).scalar_one()
                all_hold_two.wait()  # (SQLite lets one writer in at a time: a read here)
            _insert(engine, note_id)  # and the pool still serves each thread's writes
            return _count(engine)

    try:
        with concurrent.futures.ThreadPoolExecutor(ACTIVITY_THREADS) as pool:
            counts = list(pool.map(activity, range(ACTIVITY_THREADS)))
        assert len(counts) == ACTIVITY_THREADS
        assert min(counts) >= 1  # each thread read its own write back
        assert max(counts) == _count(engine) == ACTIVITY_THREADS  # every write committed
        assert _checked_out(engine) == 0
    finally:
        engine.dispose()


def test_on_sqlite_reads_share_one_checkout_and_writes_stay_transactions(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'memory.db'}")
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE notes (id integer PRIMARY KEY, body text NOT NULL)"))
    try:
        with _checkouts(engine) as seen, one_connection(engine):
            for note_id in range(3):
                assert _count(engine) == note_id
                _insert(engine, note_id)  # a transaction of its own, committed
            assert _count(engine) == 3  # the held connection reads the latest commit
        assert len(seen) == 1 + 3
        with one_connection(engine):
            with reading(engine) as conn:  # misuse: a write where a read belongs
                conn.execute(text("INSERT INTO notes VALUES (9, 'x')"))
            # ... is not left holding SQLite's write lock past its block (nor committed)
            assert _checked_out(engine) == 0
            _insert(engine, 10)
            assert _count(engine) == 4
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_a_turns_first_activity_checks_out_one_connection(
    postgres_url: str, tmp_path: Path
) -> None:
    url = fresh_schema_url(postgres_url)
    stack = open_stack(tmp_path / "data", url, "essay_coach")
    with ScriptedModelServer([{"text": "Hello."}, {"text": "Hi again."}]) as server:
        model = AnthropicModel(base_url=server.url)
        activities = TurnActivities(stack, stack.turn_steps(model), Settings().turn_settings())
        try:
            for n in range(2):  # the first turn makes the user's memory; the second is plain
                with _checkouts(stack.engine) as seen:
                    turn = TurnInput(user_id="alice", turn_id=f"t{n}", message="hello")
                    started = ActivityEnvironment().run(activities.start_turn, turn)
                assert started.first.text
        finally:
            model.close()
            stack.close()
    # the second (warm) turn's statements, some 15, ran on one checked-out connection
    assert len(seen) == 1


@pytest.mark.postgres
def test_the_stacks_pin_holds_the_postgresql_archives_engine_too(
    postgres_url: str, tmp_path: Path
) -> None:
    stack = open_stack(
        tmp_path / "data", fresh_schema_url(postgres_url), archive_backend="postgres"
    )
    archive_engine = getattr(stack.archive, "engine", None)
    assert isinstance(archive_engine, Engine)
    assert archive_engine is not stack.engine  # a pool of its own
    try:
        with _checkouts(archive_engine) as archived, stack.pinned():
            for _ in range(3):
                assert stack.archive.count("alice") == 0
        assert len(archived) == 1
    finally:
        stack.close()
