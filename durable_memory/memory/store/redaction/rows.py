"""Redacting a text from a user's SQL rows (`dmem redact`): in the columns that hold what
was said or proposed (a pending diff's proposal, reasoning and reasons, recall messages,
summaries, the turns' stored contexts and model replies) the text is replaced by REDACTED,
and every commit id the redaction rewrote is replaced by its new one (a diff's `commit_sha`
and `base_sha`, the prompt base's commit). Nothing else is edited: ids, statuses, names.

The text is found as written and as JSON writes it inside a string; in a JSON column it is
replaced in the string values only (a key that happens to read as the text stays), so every
model reads back. Idempotent: a second run finds nothing. On SQLite the replaced bytes do not
linger: connections run with `secure_delete`, the recall full-text index is told of each
change (it has no update trigger) and merged, and the WAL is emptied (store/erasure.py).
"""

import json
from collections.abc import Iterator, Mapping
from typing import Any

from sqlalchemy import Column, Connection, Engine, Select, Table, or_, select, text
from sqlmodel import SQLModel

from durable_memory.memory.core.ids import validate_user_id
from durable_memory.memory.store.erasure import truncate_wal
from durable_memory.memory.store.recall import RECALL_FTS
from durable_memory.memory.store.redaction.history import REDACTED
from durable_memory.memory.store.sql import raw_sqlite

CONTENT_COLUMNS: dict[str, tuple[str, ...]] = {
    "pending_diffs": ("reasoning", "summary", "decision_reason"),
    "recall_messages": ("content",),
    "conversation_summaries": ("text",),
}
"""Text columns of what was said or proposed. Ids, statuses, names and labels are never
edited: a short text may be part of one."""
JSON_COLUMNS: dict[str, tuple[str, ...]] = {
    "pending_diffs": ("operation", "edited_operation"),
    "user_turn_contexts": ("body",),
    "user_turn_steps": ("reply",),
}
"""Columns holding a model as JSON: the text is replaced in its string values only, never in
a key, so the model still reads back."""
COMMIT_COLUMNS: dict[str, tuple[str, ...]] = {
    "pending_diffs": ("base_sha", "commit_sha"),
    "prompt_bases": ("commit_sha",),
}
"""Columns holding one commit id, whole: mapped to the rewritten one."""


def spellings(needle: str) -> list[str]:
    """The ways a text is stored: as written, and inside a JSON string."""
    forms = [needle, json.dumps(needle, ensure_ascii=False)[1:-1], json.dumps(needle)[1:-1]]
    return list(dict.fromkeys(forms))


def _columns() -> Iterator[tuple[Table, Column[str], bool]]:
    """(table, column, holds JSON) of every column a text is redacted from."""
    for columns, is_json in ((CONTENT_COLUMNS, False), (JSON_COLUMNS, True)):
        for name, names in columns.items():
            table = SQLModel.metadata.tables[name]
            for column in names:
                yield table, table.c[column], is_json


STRUCTURAL_KEYS = frozenset(
    {
        "id",
        "op",
        "type",
        "role",
        "kind",
        "name",
        "label",
        "field",
        "operation",
        "status",
        "source",
        "stop_reason",
        "tool_use_id",
        "tool_call_id",
        "turn_id",
        "user_id",
        "model",
    }
)
"""Keys whose string values are tags, ids or names in our models (an operation's `op`, a
message's `role`, a content block's `type`...): never edited, or the model no longer reads
back. What a person or the model wrote is under other keys (`value`, `fact`, `text`...)."""


def _redacted_json(value: object, needle: str, key: str = "") -> object:
    if isinstance(value, str):
        return value if key in STRUCTURAL_KEYS else value.replace(needle, REDACTED)
    if isinstance(value, list):
        return [_redacted_json(item, needle, key) for item in value]
    if isinstance(value, dict):
        return {k: _redacted_json(item, needle, k) for k, item in value.items()}
    return value


def _holding(table: Table, column: Column[str], user_id: str, needle: str) -> Select[Any]:
    found = [column.contains(form, autoescape=True) for form in spellings(needle)]
    return select(*table.primary_key.columns, column).where(table.c.user_id == user_id, or_(*found))


def rows_holding(engine: Engine, user_id: str, needle: str) -> int:
    """How many of the user's column values hold the text, in any spelling (for the
    redaction's tests and its count)."""
    with engine.connect() as conn:
        return sum(
            len(conn.execute(_holding(table, column, user_id, needle)).all())
            for table, column, _ in _columns()
        )


def redact_user_rows(engine: Engine, user_id: str, needle: str, commits: Mapping[str, str]) -> int:
    """Replace the text (REDACTED) in what the user said and was proposed, and the rewritten
    commit ids (old -> new); how many column values held the text."""
    validate_user_id(user_id)
    sqlite = engine.dialect.name == "sqlite"
    replaced = 0
    with engine.begin() as conn:
        recall = _recall_ids(conn, user_id, needle) if sqlite else []
        _index_recall(conn, recall, "delete")
        for table, column, is_json in _columns():
            keys = list(table.primary_key.columns)
            for row in conn.execute(_holding(table, column, user_id, needle)).all():
                *key, value = row
                if is_json:
                    new = json.dumps(
                        _redacted_json(json.loads(value), needle),
                        ensure_ascii=False,
                        separators=(",", ":"),
                    )
                else:
                    new = value.replace(needle, REDACTED)
                where = [k == v for k, v in zip(keys, key, strict=True)]
                conn.execute(table.update().where(*where).values({column.name: new}))
                replaced += 1
        for name, names in COMMIT_COLUMNS.items():
            table = SQLModel.metadata.tables[name]
            for column_name in names:
                column = table.c[column_name]
                for old, new_id in commits.items():
                    conn.execute(
                        table.update()
                        .where(table.c.user_id == user_id, column == old)
                        .values({column_name: new_id})
                    )
        _index_recall(conn, recall, "insert")
    if sqlite:
        with raw_sqlite(engine) as db:
            db.execute(f"INSERT INTO {RECALL_FTS.name} ({RECALL_FTS.name}) VALUES ('optimize')")
            db.commit()
            truncate_wal(db)
    return replaced


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
