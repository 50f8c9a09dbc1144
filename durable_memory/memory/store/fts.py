"""SQLite FTS5 indexes shared by all users, whose rows carry their owner.

Recall and the embedded archive each keep one FTS5 index for every user. Each row holds its
owner as one token, the user id's bytes in hex (one alphanumeric token, unique per user id,
case included), so a search matches `owner AND terms` and walks that user's rows only,
instead of ranking every user's matches and filtering after.
"""

import sqlite3
from collections.abc import Sequence


def owner_match(user_id: str, column: str, terms: Sequence[str], operator: str) -> str:
    """An FTS5 query: the user's rows whose `column` holds the terms joined by `operator`."""
    phrases = f" {operator} ".join('"' + t.replace('"', '""') + '"' for t in terms)
    return f'owner : "{user_id.encode().hex()}" AND {column} : ({phrases})'


def create_owned_index(db: sqlite3.Connection, table: str, schema: Sequence[str]) -> None:
    """Run `schema` (CREATE ... IF NOT EXISTS statements, among them the index named `table`
    and its triggers `<table>_insert` and `<table>_delete`) in one immediate transaction. An
    index from before the owner column is dropped with its triggers first and rebuilt from
    its content after; the indexed rows are not touched."""
    db.execute("BEGIN IMMEDIATE")  # one process at a time brings the index up
    try:
        found = db.execute(
            "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)
        ).fetchone()
        outdated = found is not None and "owner" not in found[0]
        if outdated:
            db.execute(f"DROP TRIGGER IF EXISTS {table}_insert")
            db.execute(f"DROP TRIGGER IF EXISTS {table}_delete")
            db.execute(f"DROP TABLE {table}")
        for ddl in schema:
            db.execute(ddl)
        if outdated:
            db.execute(f"INSERT INTO {table} ({table}) VALUES ('rebuild')")
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise
