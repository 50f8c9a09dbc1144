"""The SQL store for diffs, recall and bookkeeping: a SQLite file by default, PostgreSQL by URL."""

import sqlite3
from typing import Any

from sqlalchemy import Engine, event, text
from sqlmodel import SQLModel, create_engine

# Imported for their side effect: registering their tables on SQLModel.metadata.
from durable_memory.memory.rotation import state  # noqa: F401
from durable_memory.memory.store import diffs, recall, summaries, turns  # noqa: F401
from durable_memory.memory.store.fts import create_owned_index

# One FTS5 index for every user's messages, each row with its owner (memory.fts).
_SQLITE_FTS = [
    """CREATE VIEW IF NOT EXISTS recall_fts_source AS
        SELECT id, hex(user_id) AS owner, content FROM recall_messages""",
    """CREATE VIRTUAL TABLE IF NOT EXISTS recall_fts USING fts5(
        owner, content, content='recall_fts_source', content_rowid='id', tokenize='unicode61'
    )""",
    """CREATE TRIGGER IF NOT EXISTS recall_fts_insert AFTER INSERT ON recall_messages BEGIN
        INSERT INTO recall_fts(rowid, owner, content)
        VALUES (new.id, hex(new.user_id), new.content);
    END""",
    """CREATE TRIGGER IF NOT EXISTS recall_fts_delete AFTER DELETE ON recall_messages BEGIN
        INSERT INTO recall_fts(recall_fts, rowid, owner, content)
        VALUES ('delete', old.id, hex(old.user_id), old.content);
    END""",
]
_POSTGRES_FTS = [
    """CREATE INDEX IF NOT EXISTS recall_messages_fts ON recall_messages
       USING gin (to_tsvector('simple', content))""",
]


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    # WAL lets several processes (workers, CLI) read while one writes; busy_timeout makes a
    # writer wait for the lock instead of failing with "database is locked".
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def make_engine(url: str) -> Engine:
    """An engine with every table created. `url` is a SQLAlchemy URL (sqlite:/// or postgresql)."""
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url.removeprefix("postgresql://")
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})
        event.listen(engine, "connect", _sqlite_pragmas)
    else:
        engine = create_engine(url, pool_pre_ping=True)
    SQLModel.metadata.create_all(engine)
    if engine.dialect.name != "sqlite":
        with engine.begin() as conn:
            for ddl in _POSTGRES_FTS:
                conn.execute(text(ddl))
        return engine
    raw = engine.raw_connection()
    try:
        db = raw.driver_connection
        if not isinstance(db, sqlite3.Connection):
            raise TypeError(f"a sqlite engine gave a {type(db).__name__} connection")
        create_owned_index(db, "recall_fts", _SQLITE_FTS)
    finally:
        raw.close()
    return engine
