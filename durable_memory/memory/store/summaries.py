"""Conversation summaries: when messages overflow the context window, the oldest are summarised.

The summarised messages are never deleted: they stay in recall, searchable. A summary records
the id of the last message it covers; the context shows the summary and the messages after it.
"""

from datetime import UTC, datetime

from sqlalchemy import Engine, UniqueConstraint
from sqlalchemy import select as select_columns
from sqlmodel import Field, Session, SQLModel, select

from durable_memory.memory.store.sql import keyed, reading, table_of
from durable_memory.memory.store.sql.direct import run


class ConversationSummaryRow(SQLModel, table=True):
    __tablename__ = "conversation_summaries"
    __table_args__ = (UniqueConstraint("user_id", "through_message_id"),)

    id: int | None = Field(default=None, primary_key=True)
    user_id: str = Field(index=True, max_length=64)
    through_message_id: int
    text: str
    created_at: datetime


_SUMMARIES = table_of(ConversationSummaryRow)
LATEST_SUMMARY = (
    select_columns(_SUMMARIES.c.through_message_id, _SUMMARIES.c.text)
    .where(*keyed(_SUMMARIES, "user_id"))
    .order_by(_SUMMARIES.c.through_message_id.desc())
    .limit(1)
)
"""The newest summary: every turn asks (built once, store/sql `keyed`), in the statement that
reads its prompt base (store/turns.py `PromptBaseStore.with_last_reply`)."""


class SummaryStore:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def latest(self, user_id: str) -> tuple[int, str] | None:
        """(id of the last message covered, summary text), or None."""
        with reading(self.engine) as connection:  # a plain row: every turn asks
            row = run(connection, LATEST_SUMMARY, {"user_id": user_id}).first()
        return (row.through_message_id, row.text) if row else None

    def add(self, user_id: str, through_message_id: int, text: str) -> None:
        """Idempotent: a summary through the same message is stored once."""
        with Session(self.engine) as session:
            exists = session.exec(
                select(ConversationSummaryRow.id).where(
                    ConversationSummaryRow.user_id == user_id,
                    ConversationSummaryRow.through_message_id == through_message_id,
                )
            ).first()
            if exists is None:
                session.add(
                    ConversationSummaryRow(
                        user_id=user_id,
                        through_message_id=through_message_id,
                        text=text,
                        created_at=datetime.now(UTC),
                    )
                )
                session.commit()
