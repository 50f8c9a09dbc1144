"""What a turn keeps between its Temporal activities: the compiled context and each model
reply, stored by (turn, step) so that a retried activity reuses them instead of calling the
model again (a retry must not change what the model said, nor pay for it twice)."""

from datetime import UTC, datetime

from sqlalchemy import Engine
from sqlmodel import Field, Session, SQLModel

from durable_memory.memory.context import CompiledContext
from durable_memory.models.llm import ModelReply


class TurnContextRow(SQLModel, table=True):
    __tablename__ = "turn_contexts"

    turn_id: str = Field(primary_key=True, max_length=64)
    user_id: str = Field(index=True, max_length=64)
    body: str
    created_at: datetime


class TurnStepRow(SQLModel, table=True):
    __tablename__ = "turn_steps"

    turn_id: str = Field(primary_key=True, max_length=64)
    step: int = Field(primary_key=True)
    user_id: str = Field(index=True, max_length=64)
    reply: str
    created_at: datetime


class TurnStore:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def save_context(self, user_id: str, turn_id: str, context: CompiledContext) -> CompiledContext:
        """Keep the first context compiled for a turn; a retry gets that one back."""
        with Session(self.engine) as session:
            row = session.get(TurnContextRow, turn_id)
            if row is not None:
                return CompiledContext.model_validate_json(row.body)
            session.add(
                TurnContextRow(
                    turn_id=turn_id,
                    user_id=user_id,
                    body=context.model_dump_json(),
                    created_at=datetime.now(UTC),
                )
            )
            session.commit()
            return context

    def context(self, turn_id: str) -> CompiledContext:
        with Session(self.engine) as session:
            row = session.get(TurnContextRow, turn_id)
        if row is None:
            raise LookupError(f"turn {turn_id} has no compiled context")
        return CompiledContext.model_validate_json(row.body)

    def reply(self, turn_id: str, step: int) -> ModelReply | None:
        with Session(self.engine) as session:
            row = session.get(TurnStepRow, (turn_id, step))
        return ModelReply.model_validate_json(row.reply) if row else None

    def save_reply(self, user_id: str, turn_id: str, step: int, reply: ModelReply) -> ModelReply:
        """Keep the first reply stored for a step."""
        with Session(self.engine) as session:
            row = session.get(TurnStepRow, (turn_id, step))
            if row is not None:
                return ModelReply.model_validate_json(row.reply)
            session.add(
                TurnStepRow(
                    turn_id=turn_id,
                    step=step,
                    user_id=user_id,
                    reply=reply.model_dump_json(),
                    created_at=datetime.now(UTC),
                )
            )
            session.commit()
            return reply
