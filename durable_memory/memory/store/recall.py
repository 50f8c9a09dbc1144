"""Recall memory: every message (user, assistant, tool call, tool result) with its turn and time.

Full-text search is SQLite FTS5 (BM25) on SQLite and `to_tsvector('simple')` on PostgreSQL.
Appends are idempotent per (user, turn, seq), so a retried write never duplicates a message.
"""

import functools
import re
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    Engine,
    Float,
    Integer,
    Row,
    Select,
    String,
    UniqueConstraint,
    bindparam,
    func,
    text,
)
from sqlalchemy import select as select_columns
from sqlmodel import Field, Session, SQLModel, col, select

from durable_memory.memory.core.errors import DurableMemoryError
from durable_memory.memory.core.ids import validate_user_id
from durable_memory.memory.core.limits import LimitExceeded, check_query
from durable_memory.memory.store.sql import (
    OwnedIndex,
    insert_keeping,
    keyed,
    postgres_text_index,
    postgres_text_query,
    postgres_text_vector,
    reading,
    table_of,
    utc,
    writing_once,
)
from durable_memory.memory.store.sql.direct import Write, run
from durable_memory.models.limits import MAX_QUERY_TERMS
from durable_memory.models.recall import MessageRole, NewMessage, RecallMessage, RecallPage

MAX_PAGE = 200


class RecallMessageRow(SQLModel, table=True):
    __tablename__ = "recall_messages"
    __table_args__ = (UniqueConstraint("user_id", "turn_id", "seq"),)

    id: int | None = Field(default=None, primary_key=True)
    user_id: str = Field(index=True, max_length=64)
    turn_id: str = Field(index=True, max_length=128)
    seq: int
    role: str = Field(max_length=16)
    content: str
    tool_name: str | None = None
    tool_call_id: str | None = None
    is_error: bool = False
    created_at: datetime = Field(index=True)


RECALL_FTS = OwnedIndex(
    "recall_fts", table="recall_messages", rowid="id", column="content", tokenize="unicode61"
)
"""SQLite: one full-text index for every user's messages, each row with its owner."""
RECALL_TEXT_INDEX = postgres_text_index("recall_messages_fts", "recall_messages", "content")
"""PostgreSQL: the full-text index of the messages' content."""


_COLUMNS: tuple[str, ...] = ("id", "user_id", "turn_id", "seq", "role", "content")
_COLUMNS += ("tool_name", "tool_call_id", "is_error", "created_at")
"""The columns `_plain_select` reads, in the order `_from_row` unpacks them."""


def _plain_select() -> Select[Any]:
    """Messages as plain rows: building ORM objects cost more than all the rest of compiling
    a context of 5,000 messages (35 us each, and garbage for the collector)."""
    table = table_of(RecallMessageRow)
    return select_columns(*(table.c[name] for name in _COLUMNS))


_RECALL = table_of(RecallMessageRow)
_COUNT = select_columns(func.count()).where(*keyed(_RECALL, "user_id"))
_OF_TURN = (
    _plain_select()
    .where(*keyed(_RECALL, "user_id", "turn_id"), _RECALL.c.seq >= bindparam("seq", type_=Integer))
    .order_by(_RECALL.c.seq)
)
_AFTER = (
    _plain_select()
    .where(*keyed(_RECALL, "user_id"), _RECALL.c.id > bindparam("id", type_=Integer))
    .order_by(_RECALL.c.id)
)
_AFTER_COUNTED = _AFTER.add_columns(_COUNT.scalar_subquery().label("user_total"))
"""A turn's statements, built once (store/sql `keyed`)."""


@functools.cache
def _search_statements(
    sqlite: bool, by_roles: bool, by_start: bool, by_end: bool, by_terms: bool
) -> tuple[Any, Any]:
    """`RecallStore.search`'s count and page statements of each shape, built once, every
    value bound (`keyed`): a search is a tool the model calls within a turn."""
    filters: list[Any] = keyed(_RECALL, "user_id")
    if by_roles:
        filters.append(_RECALL.c.role.in_(bindparam("roles", expanding=True)))
    if by_start:
        filters.append(_RECALL.c.created_at >= bindparam("start", type_=_RECALL.c.created_at.type))
    if by_end:
        filters.append(_RECALL.c.created_at < bindparam("end", type_=_RECALL.c.created_at.type))
    base = select(RecallMessageRow).where(*filters)
    if not by_terms:
        ranked = base.order_by(col(RecallMessageRow.id).desc())
    elif sqlite:
        # Match and rank once, in the index, among this user's rows only; then join for the
        # filters. MATERIALIZED keeps SQLite from probing the index again for every row of
        # the user.
        hits = (
            text(
                f"SELECT rowid AS id, {RECALL_FTS.rank} AS rank FROM {RECALL_FTS.name} "
                f"WHERE {RECALL_FTS.name} MATCH :match"
            )
            .columns(id=Integer, rank=Float)
            .cte("hits")
            .prefix_with("MATERIALIZED")
        )
        base = base.join(hits, hits.c.id == col(RecallMessageRow.id))
        ranked = base.order_by(hits.c.rank, col(RecallMessageRow.id).desc())
    else:
        tsquery = postgres_text_query(bindparam("words", type_=String))
        vector = postgres_text_vector(RecallMessageRow.content)
        base = base.where(vector.op("@@")(tsquery))
        ranked = base.order_by(
            func.ts_rank(vector, tsquery).desc(), col(RecallMessageRow.id).desc()
        )
    count = select(func.count()).select_from(base.subquery())
    page = ranked.limit(bindparam("limit", type_=Integer)).offset(
        bindparam("offset", type_=Integer)
    )
    return count, page


def _from_row(row: Row[Any] | tuple[Any, ...]) -> RecallMessage:
    """A row of `_plain_select` as the model, by position: a context reads every message of
    the conversation each turn, and named access to a row's fields cost as much again as the
    rest of reading it."""
    id_, user_id, turn_id, seq, role, content, tool_name, tool_call_id, is_error, created = tuple(
        row
    )
    return RecallMessage(
        id=id_,
        user_id=user_id,
        turn_id=turn_id,
        seq=seq,
        role=role,
        content=content,
        tool_name=tool_name,
        tool_call_id=tool_call_id,
        is_error=is_error,
        created_at=utc(created),
    )


def _to_model(row: RecallMessageRow) -> RecallMessage:
    """An ORM row (a search's) as the model."""
    return _from_row(tuple(getattr(row, name) for name in _COLUMNS))


def fts_terms(query: str) -> list[str]:
    """The words of a free-text query; FTS operators typed by a user are treated as text. A
    query over MAX_QUERY_CHARS, or with more than MAX_QUERY_TERMS distinct words, is refused."""
    check_query(query)
    terms: list[str] = re.findall(r"\w+", query)
    distinct = len(set(terms))
    if distinct > MAX_QUERY_TERMS:
        raise LimitExceeded(
            "the search query",
            distinct,
            MAX_QUERY_TERMS,
            "search with fewer key words",
            unit="distinct words",
        )
    return terms


class RecallStore:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def append(
        self,
        user_id: str,
        turn_id: str,
        messages: Sequence[NewMessage],
        *,
        first_seq: int = 0,
        at: datetime | None = None,
    ) -> list[RecallMessage]:
        """Store messages numbered from `first_seq` in a turn; already stored ones are kept.
        Returns what is stored at those positions (`record`, then a read of the rows; a row
        deleted in between, by a forget, is left out)."""
        self.record(user_id, turn_id, messages, first_seq=first_seq, at=at)
        if not messages:
            return []
        seqs = [first_seq + offset for offset in range(len(messages))]
        table = table_of(RecallMessageRow)
        with reading(self.engine) as connection:
            rows = {
                row.seq: row
                for row in connection.execute(
                    _plain_select().where(
                        table.c.user_id == user_id,
                        table.c.turn_id == turn_id,
                        table.c.seq.in_(seqs),
                    )
                )
            }
        return [_from_row(rows[seq]) for seq in seqs if seq in rows]

    def record(
        self,
        user_id: str,
        turn_id: str,
        messages: Sequence[NewMessage],
        *,
        first_seq: int = 0,
        at: datetime | None = None,
    ) -> None:
        """Store messages numbered from `first_seq` in a turn, keeping a message already
        stored at its position (a step run again after a crash): an insert that keeps stored
        rows, one round trip; for a caller that does not need the rows back (a turn's steps).
        Several messages are one executemany: a write cut short between rows is completed by
        the step's retry (the positions are fixed)."""
        write = self.recording(user_id, turn_id, messages, first_seq=first_seq, at=at)
        if write.params:
            with writing_once(self.engine) as connection:
                run(connection, write.statement, write.params)

    def recording(
        self,
        user_id: str,
        turn_id: str,
        messages: Sequence[NewMessage],
        *,
        first_seq: int = 0,
        at: datetime | None = None,
    ) -> Write:
        """`record`'s write, not run: for a caller that runs it with others (`run_together`)."""
        validate_user_id(user_id)
        stamp = utc(at or datetime.now(UTC))
        rows = [
            {
                "user_id": user_id,
                "turn_id": turn_id,
                "seq": first_seq + offset,
                "role": message.role.value,
                "content": message.content,
                "tool_name": message.tool_name,
                "tool_call_id": message.tool_call_id,
                "is_error": message.is_error,
                "created_at": stamp,
            }
            for offset, message in enumerate(messages)
        ]
        keeping = insert_keeping(self.engine, RecallMessageRow, "user_id", "turn_id", "seq")
        return Write(keeping, rows)

    def next_seq(self, user_id: str, turn_id: str) -> int:
        """The next free seq of a turn (0 for a new turn)."""
        with Session(self.engine) as session:
            top = session.exec(
                select(func.max(RecallMessageRow.seq)).where(
                    RecallMessageRow.user_id == user_id, RecallMessageRow.turn_id == turn_id
                )
            ).one()
            return 0 if top is None else top + 1

    def count(self, user_id: str) -> int:
        with reading(self.engine) as connection:
            counted: int = run(connection, _COUNT, {"user_id": user_id}).scalar_one()
        return counted

    def recent(self, user_id: str, limit: int = 50) -> list[RecallMessage]:
        """The newest `limit` messages, oldest first."""
        query = (
            _plain_select()
            .where(col(RecallMessageRow.user_id) == user_id)
            .order_by(col(RecallMessageRow.id).desc())
            .limit(limit)
        )
        with reading(self.engine) as connection:
            return [_from_row(r) for r in reversed(connection.execute(query).all())]

    def turn(self, user_id: str, turn_id: str, from_seq: int = 0) -> list[RecallMessage]:
        """The messages of one turn from `from_seq` on, in order."""
        key = {"user_id": user_id, "turn_id": turn_id, "seq": from_seq}
        with reading(self.engine) as connection:
            return [_from_row(r) for r in run(connection, _OF_TURN, key).all()]

    def after(self, user_id: str, after_id: int) -> list[RecallMessage]:
        """Every message with an id above `after_id`, oldest first: what a context holds after
        its summary (the summary keeps this list bounded)."""
        key = {"user_id": user_id, "id": after_id}
        with reading(self.engine) as connection:
            return [_from_row(r) for r in run(connection, _AFTER, key).all()]

    def after_counted(self, user_id: str, after_id: int) -> tuple[list[RecallMessage], int]:
        """`after`, and `count` of the user's messages beside it, in one statement (what a
        context compile reads every turn: two round trips were ~0.3 ms more on SQLite, ~0.7 ms
        on PostgreSQL); one snapshot, so the count includes every message listed."""
        key = {"user_id": user_id, "id": after_id}
        with reading(self.engine) as connection:
            rows = run(connection, _AFTER_COUNTED, key).all()
        if not rows:  # nothing after `after_id`: no row to carry the count
            return [], self.count(user_id)
        return [_from_row(r[:-1]) for r in rows], rows[0][-1]

    def search(
        self,
        user_id: str,
        query: str = "",
        *,
        roles: Sequence[MessageRole] | None = None,
        start: datetime | None = None,
        end: datetime | None = None,
        limit: int = 20,
        offset: int = 0,
    ) -> RecallPage:
        """Messages matching every word of `query` (best first), or all messages newest first
        when the query is empty; filtered by role and by `start <= created_at < end`."""
        validate_user_id(user_id)
        if not 1 <= limit <= MAX_PAGE:
            raise DurableMemoryError(f"limit must be between 1 and {MAX_PAGE}, got {limit}")
        if offset < 0:
            raise DurableMemoryError(f"offset must not be negative, got {offset}")
        if start is not None and end is not None and start >= end:
            raise DurableMemoryError("start must be before end")
        terms = fts_terms(query)
        values: dict[str, Any] = {"user_id": user_id, "limit": limit, "offset": offset}
        if roles:
            values["roles"] = [r.value for r in roles]
        if start is not None:
            values["start"] = utc(start)
        if end is not None:
            values["end"] = utc(end)
        sqlite = self.engine.dialect.name == "sqlite"
        if terms and sqlite:
            values["match"] = RECALL_FTS.match(user_id, terms, "AND")
        elif terms:
            values["words"] = " ".join(terms)
        count, page = _search_statements(
            sqlite, bool(roles), start is not None, end is not None, bool(terms)
        )
        with Session(self.engine) as session:
            total = session.exec(count, params=values).one()
            rows = session.exec(page, params=values).all()
            return RecallPage(
                messages=[_to_model(r) for r in rows], total=total, offset=offset, limit=limit
            )
