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

# One FTS5 index holds every user's messages; each row carries its owner as one token (the
# user id in hex) so that a search matches `owner AND terms` and walks that user's rows only.
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
_SQLITE_FTS_BEFORE_OWNER = [
    "DROP TRIGGER IF EXISTS recall_fts_insert",
    "DROP TRIGGER IF EXISTS recall_fts_delete",
    "DROP TABLE recall_fts",
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
    with engine.connect() as conn:
        conn.exec_driver_sql("BEGIN IMMEDIATE")  # one process at a time brings the index up
        try:
            found = conn.exec_driver_sql(
                "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'recall_fts'"
            ).scalar()
            outdated = found is not None and "owner" not in found
            for ddl in (_SQLITE_FTS_BEFORE_OWNER if outdated else []) + _SQLITE_FTS:
                conn.exec_driver_sql(ddl)
            if outdated:  # rebuilt from the messages; the messages themselves are untouched
                conn.exec_driver_sql("INSERT INTO recall_fts(recall_fts) VALUES ('rebuild')")
            conn.exec_driver_sql("COMMIT")
        except BaseException:
            conn.exec_driver_sql("ROLLBACK")
            raise
    return engine
