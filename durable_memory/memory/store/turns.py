"""What a turn keeps between its Temporal activities: the compiled context and each model
reply, stored by (user, turn, step) so that a retried activity reuses them instead of calling
the model again (a retry must not change what the model said, nor pay for it twice); and
what turns keep between them: each user's prompt base (below).

Turn ids are chosen by callers, so every record is keyed by its user as well: two users who
both send turn `t1` never see each other's context or replies.

Migration: databases made before this keyed the records by turn id alone, in the tables
`turn_contexts` and `turn_steps`. The tables here have new names with the composite key; when
one is created and its old table exists, the old rows are copied into it (each old row
carries its user, and the old keys are unique, so the copy is exact) and the old table is
dropped, in the same transaction as the creation. A database is migrated by the first
`make_engine` that opens it.
"""

import functools
import threading
from collections import OrderedDict
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, NamedTuple

from sqlalchemy import (
    Connection,
    Engine,
    Insert,
    Select,
    Table,
    event,
    insert,
    inspect,
    or_,
    text,
)
from sqlalchemy import select as select_columns
from sqlalchemy.exc import DataError, IntegrityError
from sqlmodel import Field, Session, SQLModel, col, func, select

from durable_memory.memory.store.sql import (
    by_key,
    conflict_insert,
    insert_keeping,
    keyed,
    reading,
    table_of,
    utc,
    writing_once,
)
from durable_memory.memory.store.sql.direct import Write, run, run_together
from durable_memory.memory.store.summaries import LATEST_SUMMARY
from durable_memory.models.context import CompiledContext, PromptBase
from durable_memory.models.llm import ModelReply, TokenUsage


class TurnContextRow(SQLModel, table=True):
    __tablename__ = "user_turn_contexts"

    user_id: str = Field(primary_key=True, max_length=64)
    turn_id: str = Field(primary_key=True, max_length=64)
    body: str
    created_at: datetime


class TurnStepRow(SQLModel, table=True):
    __tablename__ = "user_turn_steps"

    user_id: str = Field(primary_key=True, max_length=64)
    turn_id: str = Field(primary_key=True, max_length=64)
    step: int = Field(primary_key=True)
    reply: str
    created_at: datetime


_LEGACY_TABLES = {
    "user_turn_contexts": ("turn_contexts", "user_id, turn_id, body, created_at"),
    "user_turn_steps": ("turn_steps", "user_id, turn_id, step, reply, created_at"),
}
"""New table -> (the table keyed by turn id alone that it replaces, the columns to copy)."""


def _adopt_legacy_rows(table: Table, connection: Connection, **_: Any) -> None:
    """Runs when the new table is created: copies and drops the old table, if there is one."""
    legacy, columns = _LEGACY_TABLES[table.name]
    if not inspect(connection).has_table(legacy):
        return
    connection.execute(text(f"INSERT INTO {table.name} ({columns}) SELECT {columns} FROM {legacy}"))
    connection.execute(text(f"DROP TABLE {legacy}"))


for _name in _LEGACY_TABLES:
    event.listen(SQLModel.metadata.tables[_name], "after_create", _adopt_legacy_rows)


_DROP_CONTEXT = (
    table_of(TurnContextRow).delete().where(*keyed(TurnContextRow, "user_id", "turn_id"))
)
_NEW_REPLY = insert(table_of(TurnStepRow))
"""A step's reply, refused (an integrity error) where one is stored: `save_new_reply`."""
_LAST_REPLY_AT = select_columns(func.max(table_of(TurnStepRow).c.created_at)).where(
    *keyed(TurnStepRow, "user_id")
)

_REPLY_AND_CONTEXT = select_columns(
    by_key(table_of(TurnStepRow), ("reply",), ("user_id", "turn_id", "step"))
    .scalar_subquery()
    .label("reply"),
    by_key(table_of(TurnContextRow), ("body",), ("user_id", "turn_id"))
    .scalar_subquery()
    .label("body"),
)
"""A step's stored reply and its turn's stored context (NULL for either missing)."""

KEEP_FIRST_ROUNDS = 3
"""`TurnStore._keep_first`'s tries of insert-or-read while a stored row is deleted between."""


PARSED_CONTEXTS = 32
"""Turns whose parsed context `_ParsedContexts` keeps at most (the activity threads' worth)."""
PARSED_CONTEXT_CHARS = 2**20
"""Their stored texts' length at most, together (the parsed objects take a few times that); a
longer context is not kept."""


class _ParsedContexts:
    """The parsed contexts of turns whose agent loop this process runs, each beside the text
    stored for it: a tool step reads its turn's stored context, and when the text read is
    exactly the one kept, the value kept is the one parsing it gives (0.6 ms for a 40-turn
    conversation's 23 KB, 3.8 ms for 428 KB), so it is not parsed again. The store stays what
    a step reads: the row is read as before, and only the same text gets the kept value
    (another process's context, or none, is parsed or missed as before). `CompiledContext`
    is frozen and no step changes one in place, so steps can share a value. An entry goes
    when the turn's context is dropped (its agent loop over), and the least recently used
    beyond the bounds."""

    def __init__(self) -> None:
        self._kept: OrderedDict[tuple[str, str], tuple[str, CompiledContext]] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def parsed(self, key: tuple[str, str], body: str) -> CompiledContext:
        with self._lock:
            found = self._kept.get(key)
            if found is not None and found[0] == body:
                self._kept.move_to_end(key)
                return found[1]
        context = CompiledContext.model_validate_json(body)
        self.keep(key, body, context)
        return context

    def keep(self, key: tuple[str, str], body: str, context: CompiledContext) -> None:
        with self._lock:
            self._pop(key)
            if len(body) > PARSED_CONTEXT_CHARS:
                return
            self._kept[key] = (body, context)
            self._chars += len(body)
            while len(self._kept) > PARSED_CONTEXTS or self._chars > PARSED_CONTEXT_CHARS:
                self._pop(next(iter(self._kept)))

    def drop(self, key: tuple[str, str]) -> None:
        with self._lock:
            self._pop(key)

    def forget_user(self, user_id: str) -> None:
        """Every entry of the user (their forget, in this process)."""
        with self._lock:
            for key in [k for k in self._kept if k[0] == user_id]:
                self._pop(key)

    def _pop(self, key: tuple[str, str]) -> None:
        found = self._kept.pop(key, None)
        if found is not None:
            self._chars -= len(found[0])

    def __len__(self) -> int:
        return len(self._kept)

    def turns(self) -> list[tuple[str, str]]:
        """The (user, turn) of each entry, least recently used first."""
        with self._lock:
            return list(self._kept)


class TurnStore:
    """Plain statements on the hot path (every step of every turn reads and writes here),
    not ORM sessions and objects, whose bookkeeping cost more than the SQL."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.parsed_contexts = _ParsedContexts()

    def _stored(self, row_type: type[SQLModel], column: str, key: dict[str, Any]) -> str | None:
        """`column` of the row with primary key `key`, None if there is none."""
        query = by_key(table_of(row_type), (column,), tuple(key))
        with reading(self.engine) as connection:
            found: str | None = run(connection, query, key).scalar()
        return found

    def _keep_first(
        self, row_type: type[TurnContextRow | TurnStepRow], values: dict[str, Any], column: str
    ) -> str | None:
        """Store the row of `values` (every column of `row_type`'s table, as the row holds
        them: no row object is built, ~0.3 ms of SQLModel's per call) unless a row with its key
        is stored already: that one's `column`, else None. One statement when nothing was
        stored (an insert that keeps a stored row); the stored row is read only when the insert
        kept it (a step run again)."""
        table = table_of(row_type)
        key = {c.name: values[c.name] for c in table.primary_key.columns}
        keeping = insert_keeping(self.engine, table, *key)
        of_key = by_key(table, (column,), tuple(key))
        with writing_once(self.engine) as connection:
            for _ in range(KEEP_FIRST_ROUNDS):
                if run(connection, keeping, values).rowcount == 1:
                    return None
                stored: str | None = run(connection, of_key, key).scalar()
                if stored is not None:
                    return stored
                # PostgreSQL (each statement alone): deleted in between (a context dropped by
                # an earlier attempt still running, a forget): the insert may keep ours now.
        raise LookupError(f"{table.name} {key}: a stored row kept vanishing as it was kept")

    def save_context(self, user_id: str, turn_id: str, context: CompiledContext) -> CompiledContext:
        """Keep the first context compiled for a user's turn; a retry gets that one back."""
        body = context.model_dump_json()
        stored = self._keep_first(
            TurnContextRow,
            {"user_id": user_id, "turn_id": turn_id, "body": body, "created_at": datetime.now(UTC)},
            "body",
        )
        if stored is None:
            self.parsed_contexts.keep((user_id, turn_id), body, context)
            return context
        return self.parsed_contexts.parsed((user_id, turn_id), stored)

    def drop_context(self, user_id: str, turn_id: str) -> None:
        """Delete a turn's stored context once its agent loop is over: no step reads it again
        (a retried model step finds its stored reply first), and each one holds the whole
        conversation window, so keeping every turn's would grow a user's rows with the square
        of the conversation's length. Idempotent."""
        self.parsed_contexts.drop((user_id, turn_id))
        with writing_once(self.engine) as connection:
            run(connection, _DROP_CONTEXT, {"user_id": user_id, "turn_id": turn_id})

    def context(self, user_id: str, turn_id: str) -> CompiledContext:
        context = self.stored_context(user_id, turn_id)
        if context is None:
            raise LookupError(f"turn {turn_id} of user '{user_id}' has no compiled context")
        return context

    def stored_context(self, user_id: str, turn_id: str) -> CompiledContext | None:
        """The turn's stored context; None once its agent loop is over (`drop_context`)."""
        body = self._stored(TurnContextRow, "body", {"user_id": user_id, "turn_id": turn_id})
        return None if body is None else self.parsed_contexts.parsed((user_id, turn_id), body)

    def reply_and_context(
        self, user_id: str, turn_id: str, step: int, read: Write | None = None
    ) -> tuple[ModelReply | None, CompiledContext | None, list[Any]]:
        """`reply` and `stored_context` of a step's turn in one statement (what a tool step
        reads before its tools run): one round trip where two cost ~0.3 ms more on SQLite and
        ~0.7 ms on PostgreSQL. A single statement sees one state of both rows. With the rows
        of the caller's `read` (none without one), sent before it in the same round trip
        (`run_together`): a tool step's erasure check (store/erasure.py `erasures_read`)."""
        # A read only: on SQLite `reading` is no transaction of ours to keep a write in.
        assert read is None or isinstance(read.statement, Select), "a read, not a write"
        key = {"user_id": user_id, "turn_id": turn_id, "step": step}
        mine = Write(_REPLY_AND_CONTEXT, key)
        with reading(self.engine) as connection:
            *theirs, ours = run_together(connection, [*([] if read is None else [read]), mine])
        row, other = ours.one(), (theirs[0].all() if theirs else [])
        reply = None if row.reply is None else ModelReply.model_validate_json(row.reply)
        context = (
            None if row.body is None else self.parsed_contexts.parsed((user_id, turn_id), row.body)
        )
        return reply, context, other

    def reply(self, user_id: str, turn_id: str, step: int) -> ModelReply | None:
        key = {"user_id": user_id, "turn_id": turn_id, "step": step}
        stored = self._stored(TurnStepRow, "reply", key)
        return ModelReply.model_validate_json(stored) if stored is not None else None

    def latest_usage(self, user_id: str) -> tuple[str, TokenUsage] | None:
        """The user's most recent turn that called the model, and its calls' usage summed."""
        with Session(self.engine) as session:
            newest = session.exec(
                select(TurnStepRow)
                .where(TurnStepRow.user_id == user_id)
                .order_by(col(TurnStepRow.created_at).desc())
                .limit(1)
            ).first()
            if newest is None:
                return None
            rows = session.exec(
                select(TurnStepRow).where(
                    TurnStepRow.user_id == user_id, TurnStepRow.turn_id == newest.turn_id
                )
            ).all()
        usage = sum((ModelReply.model_validate_json(r.reply).usage for r in rows), TokenUsage())
        return newest.turn_id, usage

    def save_new_reply(
        self,
        user_id: str,
        turn_id: str,
        step: int,
        reply: ModelReply,
        also: Sequence[Write] = (),
        *,
        drop_context: bool = False,
    ) -> bool:
        """Store a step's reply, with the writes `also` (its messages in recall) and, for the
        turn's last step, `drop_context`: all at once, one round trip on PostgreSQL
        (`run_together`), where each alone cost one (the turn's last step ran three, in a
        step that does nothing else). All or none: False, with nothing written, when the step
        has a reply stored already (an insert that does not keep a stored row: its conflict
        fails the batch), and the caller goes the long way (`save_reply`, which keeps that
        reply, and the writes of what it holds). Nearly always True: a step's first attempt
        finds no reply stored (`TurnSteps.call_model`). Also False for a value the database
        refuses in `also` (then the long way meets the refusal again, the reply kept)."""
        values = {
            "user_id": user_id,
            "turn_id": turn_id,
            "step": step,
            "reply": reply.model_dump_json(),
            "created_at": datetime.now(UTC),
        }
        writes = [Write(_NEW_REPLY, values), *also]
        key = {"user_id": user_id, "turn_id": turn_id}
        if drop_context:
            writes.append(Write(_DROP_CONTEXT, key))
        try:
            with writing_once(self.engine) as connection:
                run_together(connection, writes)
        except (IntegrityError, DataError):
            # A value the database refuses (PostgreSQL: a NUL byte in a message's text) fails
            # the batch as a stored reply does: the long way keeps the reply on its own, and
            # a retry finds it instead of asking the model again, as before the batch.
            return False
        if drop_context:
            self.parsed_contexts.drop((user_id, turn_id))
        return True

    def save_reply(self, user_id: str, turn_id: str, step: int, reply: ModelReply) -> ModelReply:
        """Keep the first reply stored for a step of a user's turn."""
        stored = self._keep_first(
            TurnStepRow,
            {
                "user_id": user_id,
                "turn_id": turn_id,
                "step": step,
                "reply": reply.model_dump_json(),
                "created_at": datetime.now(UTC),
            },
            "reply",
        )
        return reply if stored is None else ModelReply.model_validate_json(stored)


class PromptBaseRow(SQLModel, table=True):
    __tablename__ = "prompt_bases"

    user_id: str = Field(primary_key=True, max_length=64)
    commit_sha: str = Field(max_length=64)
    summarized_through_message_id: int = 0


def _base_of() -> Select[Any]:
    return by_key(
        table_of(PromptBaseRow), ("commit_sha", "summarized_through_message_id"), ("user_id",)
    )


class BaseRead(NamedTuple):
    """A user's prompt base as read (None: none yet), when their newest model reply was
    stored (None: never) and their newest conversation summary (the last message it covers
    and its text; (0, None): none, as memory/agent/context.py reads it)."""

    base: PromptBase | None
    last_reply_at: datetime | None
    summary: tuple[int, str | None] = (0, None)


class PromptBaseStore:
    """Each user's prompt base: the commit whose memory blocks the cached system prompt shows, and
    how far the conversation summary reached then (memory/agent/context.py sends the blocks
    changed since as the memory update). In the shared database, so every worker compiles the
    same request from the same state. A turn moves it to the base its stored context used
    (TurnSteps.prepare), after storing that context: a crash in between is repaired by the
    retry, which finds the stored context and moves the base again."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def get(self, user_id: str) -> PromptBase | None:
        with reading(self.engine) as connection:
            row = run(connection, _base_of(), {"user_id": user_id}).first()
        return _base(row)

    def with_last_reply(self, user_id: str, *, after: Write | None = None) -> BaseRead:
        """The user's base, when their newest model reply was stored (in UTC; None before
        the first): how long the prompt cache has gone unread (memory/agent/context.py's
        `warm_base`), and their newest summary, which the turn's compile starts from. One
        statement: each part alone would cost a round trip more on every turn (~0.15 ms on
        loopback alone, over 1 ms among the distributed mode's processes on two cores).
        `after`: a write the caller makes just before (the turn's message recorded), sent
        with the read in one round trip (`run_together`): both or neither."""
        read = Write(_BASE_AND_LAST_REPLY, {"user_id": user_id})
        with (reading if after is None else writing_once)(self.engine) as connection:
            row = run_together(connection, [*([] if after is None else [after]), read])[-1].one()
        last: datetime | None = row.last_reply_at
        summary = (0, None) if row.summary_through is None else (row.summary_through, row.summary)
        return BaseRead(
            _base(None if row.commit_sha is None else row),
            None if last is None else utc(last),
            summary,
        )

    def move(self, user_id: str, base: PromptBase, *, read: BaseRead | None = None) -> None:
        """Set the user's base (idempotent: a retry writes nothing new). Nearly every turn
        leaves it where it was: a read, alone, finds that (`read`: the caller's own, made
        moments before in the same step, `with_last_reply`'s: not made again; should another
        turn of the user have moved the base in between, the base stays where that turn put
        it, as if it had moved it just after this one); only a base that differs is
        written, by an insert that updates a stored row (so two workers moving one user's
        base at once do not collide on its key). Not the upsert alone: an ON CONFLICT DO
        UPDATE whose WHERE is false still locks the row, which on PostgreSQL takes a
        transaction id and flushes a commit to the WAL, and on SQLite the write lock."""
        if (self.get(user_id) if read is None else read.base) == base:
            return
        values = {
            "user_id": user_id,
            "commit_sha": base.commit,
            "summarized_through_message_id": base.summarized_through_message_id,
        }
        with writing_once(self.engine) as connection:
            run(connection, _moving(self.engine.dialect.name), values)


def _base(row: Any) -> PromptBase | None:
    """A `_base_of` row (commit, summarized through) as the base; None for no row."""
    if row is None:
        return None
    return PromptBase(commit=row.commit_sha, summarized_through_message_id=row[1])


_BASE_AND_LAST_REPLY = select_columns(
    *(
        by_key(table_of(PromptBaseRow), (c,), ("user_id",)).scalar_subquery().label(c)
        for c in ("commit_sha", "summarized_through_message_id")
    ),
    _LAST_REPLY_AT.scalar_subquery().label("last_reply_at"),
    *(
        LATEST_SUMMARY.with_only_columns(column).scalar_subquery().label(name)
        for column, name in zip(
            LATEST_SUMMARY.selected_columns, ("summary_through", "summary"), strict=True
        )
    ),
)


@functools.cache
def _moving(dialect: str) -> Insert:
    """`PromptBaseStore.move`'s statement for a dialect (both share the upsert's syntax)."""
    table = table_of(PromptBaseRow)
    insert = conflict_insert(dialect, table)
    changed = {c: insert.excluded[c] for c in ("commit_sha", "summarized_through_message_id")}
    return insert.on_conflict_do_update(
        index_elements=["user_id"],
        set_=changed,
        where=or_(*(table.c[c] != new for c, new in changed.items())),
    )
