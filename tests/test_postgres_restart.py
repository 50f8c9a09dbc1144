"""PostgreSQL restarting (or down) under a process that holds pooled connections to it.

A pooled connection idle for longer than `PING_AFTER_IDLE_S` is pinged before use and
replaced if dead, so after a restart the next call of every store succeeds and nothing is
lost; one held across an activity's statements (`one_connection`) is pinged itself once it sat
unused past that bound. A connection used within that window is trusted: the one statement that meets it
fails with a transient error (an activity retries it) and the pool drops every connection
made before, so the next calls succeed. A database that is down gives a transient error at
once, never a hang. Each test runs its own server (it restarts it), not the session's.
"""

import time
from collections.abc import Iterator
from contextlib import ExitStack

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.exc import OperationalError
from sqlmodel import SQLModel

from durable_memory.activities.errors import is_transient
from durable_memory.memory.archive.embedders import default_embedder
from durable_memory.memory.archive.postgres import PostgresArchive
from durable_memory.memory.store.recall import RecallStore
from durable_memory.memory.store.redaction.gate import RedactionGate
from durable_memory.memory.store.sql import PING_AFTER_IDLE_S, create_sql_engine, one_connection
from durable_memory.memory.store.users import UserDirectory
from durable_memory.models.archive import ArchiveSearch, NewPassage, PassageSource
from durable_memory.models.recall import MessageRole, NewMessage
from tests.support.postgres import PostgresServer, required_pg_bin, restartable_postgres

pytestmark = pytest.mark.postgres

POOLED = 3
"""Connections each test leaves in the pool before the restart."""


@pytest.fixture
def server() -> Iterator[PostgresServer]:
    with restartable_postgres(required_pg_bin()) as running:
        yield running


def _engine(url: str, ping_after_idle_s: float = PING_AFTER_IDLE_S) -> Engine:
    engine = create_sql_engine(url, ping_after_idle_s=ping_after_idle_s)
    SQLModel.metadata.create_all(engine)
    return engine


def _fill_pool(engine: Engine) -> None:
    """POOLED connections checked out at once and returned: all of them pooled, all used."""
    with ExitStack() as held:
        for _ in range(POOLED):
            held.enter_context(engine.connect()).execute(text("SELECT 1"))


def _backends(engine: Engine) -> set[int]:
    """The server process ids behind POOLED connections checked out at once."""
    with ExitStack() as held:
        return {
            held.enter_context(engine.connect())
            .execute(text("SELECT pg_backend_pid()"))
            .scalar_one()
            for _ in range(POOLED)
        }


def _write_and_read(engine: Engine, turn: str) -> None:
    """One call of each kind the turn's steps make: the checks, a read, a write."""
    users, recall, gate = UserDirectory(engine), RecallStore(engine), RedactionGate(engine)
    users.refuse_if_forgotten("ada")
    gate.refuse_if_open("ada")
    users.register(["ada"])
    recall.append("ada", turn, [NewMessage(role=MessageRole.USER, content=f"hello {turn}")])


def _state(engine: Engine) -> tuple[list[str], list[str]]:
    return UserDirectory(engine).users(), [m.content for m in RecallStore(engine).after("ada", 0)]


def test_idle_connections_are_replaced_after_a_restart_and_nothing_is_lost(
    server: PostgresServer,
) -> None:
    engine = _engine(server.url)
    _write_and_read(engine, "t1")
    _fill_pool(engine)
    before = _backends(engine)

    server.restart()
    time.sleep(PING_AFTER_IDLE_S + 0.2)  # every pooled connection is now past the idle bound

    _write_and_read(engine, "t2")  # the first call after the restart succeeds
    assert _state(engine) == (["ada"], ["hello t1", "hello t2"])
    assert not _backends(engine) & before  # every dead connection was replaced
    engine.dispose()


def test_a_connection_used_just_before_a_restart_fails_one_statement_then_the_pool_is_fresh(
    server: PostgresServer,
) -> None:
    engine = _engine(server.url, ping_after_idle_s=3600)  # nothing counts as idle here
    _write_and_read(engine, "t1")
    _fill_pool(engine)

    server.restart()

    with pytest.raises(OperationalError) as failed:
        UserDirectory(engine).refuse_if_forgotten("ada")
    assert is_transient(failed.value)  # an activity meeting it is retried, not failed
    # The pool dropped every connection made before the failure, not only the one that met it.
    _write_and_read(engine, "t2")
    assert len(_backends(engine)) == POOLED
    assert _state(engine) == (["ada"], ["hello t1", "hello t2"])
    engine.dispose()


def test_a_connection_held_across_a_restart_is_pinged_after_its_idle_bound(
    server: PostgresServer,
) -> None:
    """Within `one_connection` (an activity), the held connection is not checked out again,
    so it is pinged itself when it sat unused past the bound (a model call, a restart
    meanwhile): the step's next statement succeeds on a fresh connection."""
    engine = _engine(server.url)
    with one_connection(engine):
        _write_and_read(engine, "t1")
        server.restart()
        time.sleep(PING_AFTER_IDLE_S + 0.2)
        _write_and_read(engine, "t2")  # no statement meets the dead connection
    assert _state(engine) == (["ada"], ["hello t1", "hello t2"])
    engine.dispose()


def test_a_held_connection_used_just_before_a_restart_fails_one_statement_then_a_fresh_one(
    server: PostgresServer,
) -> None:
    engine = _engine(server.url, ping_after_idle_s=3600)
    with one_connection(engine):
        _write_and_read(engine, "t1")
        server.restart()
        with pytest.raises(OperationalError) as failed:
            UserDirectory(engine).refuse_if_forgotten("ada")
        assert is_transient(failed.value)
        _write_and_read(engine, "t2")  # the failed connection was given back: a fresh one
    assert _state(engine) == (["ada"], ["hello t1", "hello t2"])
    engine.dispose()


def test_a_database_that_is_down_gives_a_transient_error_at_once_and_works_once_back(
    server: PostgresServer,
) -> None:
    engine = _engine(server.url)
    _write_and_read(engine, "t1")
    _fill_pool(engine)

    server.halt()
    time.sleep(PING_AFTER_IDLE_S + 0.2)
    for attempt in range(2):  # the pooled connections, then a new one: refused, not hung
        with pytest.raises(OperationalError) as failed:
            _write_and_read(engine, f"down-{attempt}")
        assert is_transient(failed.value)

    server.serve()
    _write_and_read(engine, "t2")
    assert _state(engine) == (["ada"], ["hello t1", "hello t2"])
    engine.dispose()


@pytest.mark.parametrize("alpha", [1.0, 0.5])
def test_an_archive_search_on_a_connection_lost_just_before_fails_once_then_works(
    server: PostgresServer, alpha: float
) -> None:
    """The archive reads its vectors on the driver's own connection, where SQLAlchemy does not
    see the error (alpha 1.0: the only statement of the read): it must still fail with a
    transient error and leave a fresh pool, as every other statement does."""
    archive = PostgresArchive(server.url, default_embedder())
    archive.engine.dispose()  # its tables made: now an engine that trusts every connection
    archive.engine = create_sql_engine(server.url, ping_after_idle_s=3600)
    archive.insert(NewPassage(user_id="ada", text="robots are fun", source=PassageSource.AGENT))
    search = ArchiveSearch(query="robots", alpha=alpha)
    assert archive.search("ada", search)
    _fill_pool(archive.engine)

    server.restart()

    with pytest.raises(OperationalError) as failed:
        archive.search("ada", search)
    assert is_transient(failed.value)
    for _ in range(POOLED + 1):  # every pooled connection was dropped, not only the one
        assert [h.passage.text for h in archive.search("ada", search)] == ["robots are fun"]
    archive.close()
