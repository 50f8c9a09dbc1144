"""The SQL store for diffs, recall and bookkeeping: a SQLite file by default, PostgreSQL by URL."""

from typing import Any

from sqlalchemy import Engine, event, text
from sqlmodel import SQLModel, create_engine

# Imported for their side effect: registering their tables on SQLModel.metadata.
from durable_memory.memory import (  # noqa: F401
    diffs,
    recall,
    rotation_state,
    summaries,
    turns,
)

_SQLITE_FTS = [
    """CREATE VIRTUAL TABLE IF NOT EXISTS recall_fts USING fts5(
        content, content='recall_messages', content_rowid='id', tokenize='unicode61'
    )""",
    """CREATE TRIGGER IF NOT EXISTS recall_fts_insert AFTER INSERT ON recall_messages BEGIN
        INSERT INTO recall_fts(rowid, content) VALUES (new.id, new.content);
    END""",
    """CREATE TRIGGER IF NOT EXISTS recall_fts_delete AFTER DELETE ON recall_messages BEGIN
        INSERT INTO recall_fts(recall_fts, rowid, content) VALUES ('delete', old.id, old.content);
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
    with engine.begin() as conn:
        for ddl in _SQLITE_FTS if engine.dialect.name == "sqlite" else _POSTGRES_FTS:
            conn.execute(text(ddl))
    return engine
