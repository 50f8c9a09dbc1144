"""Recall memory: every message of every turn, searchable."""

from datetime import datetime
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

from durable_memory.models.limits import MAX_RECALL_MESSAGE_CHARS


class MessageRole(StrEnum):
    USER = "user"
    ASSISTANT = "assistant"
    TOOL_CALL = "tool_call"
    TOOL_RESULT = "tool_result"
    SYSTEM = "system"


class NewMessage(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    role: MessageRole
    content: str = Field(max_length=MAX_RECALL_MESSAGE_CHARS)
    tool_name: str | None = None
    tool_call_id: str | None = None
    is_error: bool = False
    """For tool results: the tool reported an error to the model."""


class RecallMessage(NewMessage):
    id: int
    user_id: str
    turn_id: str
    seq: int
    created_at: datetime


class RecallPage(BaseModel):
    model_config = ConfigDict(frozen=True)

    messages: list[RecallMessage]
    total: int
    offset: int
    limit: int
