"""Each user's prompt base: the commit whose memory blocks the cached system prompt shows,
and how far the conversation summary reached then (memory/agent/context.py compiles the
blocks changed since as a memory update). In the shared database, so every worker compiles
the same request from the same state; a turn moves it to the base its stored context used
(TurnSteps.prepare), after storing that context, so a crash in between is repaired by the
retry, which finds the stored context and moves the base again."""

from sqlalchemy import Engine
from sqlmodel import Field, Session, SQLModel

from durable_memory.models.context import PromptBase


class PromptBaseRow(SQLModel, table=True):
    __tablename__ = "prompt_bases"

    user_id: str = Field(primary_key=True, max_length=64)
    commit_sha: str = Field(max_length=64)
    summarized_through_message_id: int = 0


class PromptBaseStore:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def get(self, user_id: str) -> PromptBase | None:
        with Session(self.engine) as session:
            row = session.get(PromptBaseRow, user_id)
        if row is None:
            return None
        return PromptBase(
            commit=row.commit_sha, summarized_through_message_id=row.summarized_through_message_id
        )

    def move(self, user_id: str, base: PromptBase) -> None:
        """Set the user's base (idempotent: a retry writes nothing new)."""
        with Session(self.engine) as session:
            row = session.get(PromptBaseRow, user_id)
            if row is None:
                row = PromptBaseRow(user_id=user_id, commit_sha=base.commit)
            elif row.commit_sha == base.commit and (
                row.summarized_through_message_id == base.summarized_through_message_id
            ):
                return
            row.commit_sha = base.commit
            row.summarized_through_message_id = base.summarized_through_message_id
            session.add(row)
            session.commit()
