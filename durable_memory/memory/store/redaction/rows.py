"""Redacting a text from a user's SQL rows (`dmem redact`): every text column of every table
keyed by the user (pending diffs' proposals and reasons, recall messages, summaries, turn
bookkeeping) gets the text replaced by REDACTED, and every commit id a redaction rewrote is
replaced by its new id (the `*_sha` columns: a diff's `commit_sha` and `base_sha`).

The text is matched as written and as JSON writes it inside a string (`"` and `\\` escaped,
non-ASCII escaped or not), since proposals and turn bookkeeping are stored as JSON. Idempotent:
a second run finds nothing. On SQLite the replaced bytes do not linger: connections run with
`secure_delete`, the recall full-text index is told of each change (it has no update trigger)
and merged, and the WAL is emptied (store/erasure.py).
"""

import json
from collections.abc import Iterator, Mapping

from sqlalchemy import Column, Connection, Engine, String, Table, TypeDecorator, func, text
from sqlmodel import SQLModel

from durable_memory.memory.core.ids import validate_user_id
from durable_memory.memory.store.erasure import truncate_wal
from durable_memory.memory.store.recall import RECALL_FTS
from durable_memory.memory.store.redaction.history import REDACTED
from durable_memory.memory.store.sql import raw_sqlite

REDACTED_TABLES = (
    "pending_diffs",
    "recall_messages",
    "conversation_summaries",
    "user_turn_contexts",
    "user_turn_steps",
    "rotation_state",
)
"""The tables keyed by a user that hold what was said or proposed (store/erasure.py's
USER_TABLES but the list of users and the payload keys, which hold no content and must
never be edited)."""


def spellings(needle: str) -> list[str]:
    """The ways a text is stored: as written, and inside a JSON string."""
    forms = [needle, json.dumps(needle, ensure_ascii=False)[1:-1], json.dumps(needle)[1:-1]]
    return list(dict.fromkeys(forms))


def _text_columns(table: Table) -> Iterator[Column[str]]:
    keys = {c.name for c in table.primary_key.columns} | {"user_id"}
    for column in table.columns:
        # SQLModel's str columns are AutoString, a TypeDecorator over String.
        kind = column.type.impl if isinstance(column.type, TypeDecorator) else column.type
        if isinstance(kind, String) and column.name not in keys:
            yield column


def rows_holding(engine: Engine, user_id: str, needle: str) -> int:
    """How many of the user's rows hold the text in any spelling (for the redaction's count
    and its tests)."""
    found = 0
    with engine.connect() as conn:
        for name in REDACTED_TABLES:
            table = SQLModel.metadata.tables[name]
            for column in _text_columns(table):
                for form in spellings(needle):
                    query = (
                        table.select()
                        .with_only_columns(func.count())
                        .where(table.c.user_id == user_id, column.contains(form, autoescape=True))
                    )
                    found += int(conn.execute(query).scalar_one())
    return found


def redact_user_rows(engine: Engine, user_id: str, needle: str, commits: Mapping[str, str]) -> int:
    """Replace the text (REDACTED) and the rewritten commit ids (old -> new) in every row of
    the user; how many column values held the text."""
    validate_user_id(user_id)
    sqlite = engine.dialect.name == "sqlite"
    replaced = 0
    with engine.begin() as conn:
        recall = (
            sorted({i for form in spellings(needle) for i in _recall_ids(conn, user_id, form)})
            if sqlite
            else []
        )
        _index_recall(conn, recall, "delete")
        for name in REDACTED_TABLES:
            table = SQLModel.metadata.tables[name]
            for column in _text_columns(table):
                for form in spellings(needle):
                    replaced += _replace(conn, table, column, user_id, form, REDACTED)
                if column.name.endswith("_sha"):  # a commit id, whole: mapped to its new one
                    for old, new in commits.items():
                        conn.execute(
                            table.update()
                            .where(table.c.user_id == user_id, column == old)
                            .values({column.name: new})
                        )
        _index_recall(conn, recall, "insert")
    if sqlite:
        with raw_sqlite(engine) as db:
            db.execute(f"INSERT INTO {RECALL_FTS.name} ({RECALL_FTS.name}) VALUES ('optimize')")
            db.commit()
            truncate_wal(db)
    return replaced


def _replace(
    conn: Connection, table: Table, column: Column[str], user_id: str, old: str, new: str
) -> int:
    statement = (
        table.update()
        .where(table.c.user_id == user_id, column.contains(old, autoescape=True))
        .values({column.name: func.replace(column, old, new)})
    )
    return int(conn.execute(statement).rowcount)


def _recall_ids(conn: Connection, user_id: str, needle: str) -> list[int]:
    """The user's messages whose content holds the text."""
    query = text(
        f"SELECT {RECALL_FTS.rowid} FROM {RECALL_FTS.table} "
        f"WHERE user_id = :u AND instr({RECALL_FTS.column}, :n) > 0"
    )
    return [int(row[0]) for row in conn.execute(query, {"u": user_id, "n": needle})]


def _index_recall(conn: Connection, ids: list[int], action: str) -> None:
    """SQLite's recall index has no update trigger: before the change, the messages are taken
    out of it ('delete', with their old content); after, put back as they now read."""
    name, rowid, column = RECALL_FTS.name, RECALL_FTS.rowid, RECALL_FTS.column
    command = "'delete', " if action == "delete" else ""
    target = f"{name}, " if action == "delete" else ""
    for start in range(0, len(ids), 500):
        part = ids[start : start + 500]
        marks = ",".join(str(i) for i in part)  # integers read from the table itself
        conn.execute(
            text(
                f"INSERT INTO {name} ({target}rowid, owner, {column}) "
                f"SELECT {command}{rowid}, hex(user_id), {column} FROM {RECALL_FTS.table} "
                f"WHERE {rowid} IN ({marks})"
            )
        )
