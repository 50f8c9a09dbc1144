"""The SQL store for diffs, recall and bookkeeping: a SQLite file by default, PostgreSQL by URL."""

from sqlalchemy import Engine, text
from sqlmodel import SQLModel

# Imported for their side effect: registering their tables on SQLModel.metadata.
from durable_memory.memory.store import (  # noqa: F401
    diffs,
    erasure,
    recall,
    rotation_state,
    summaries,
    turns,
    users,
)
from durable_memory.memory.store.redaction import gate  # noqa: F401
from durable_memory.memory.store.sql import create_sql_engine, raw_sqlite


def make_engine(url: str) -> Engine:
    """An engine with every table created. `url` is a SQLAlchemy URL (sqlite:/// or postgresql)."""
    engine = create_sql_engine(url)
    SQLModel.metadata.create_all(engine)
    if engine.dialect.name == "sqlite":
        with raw_sqlite(engine) as db:
            recall.RECALL_FTS.create(db)
    else:
        with engine.begin() as conn:
            conn.execute(text(recall.RECALL_TEXT_INDEX))
    return engine
