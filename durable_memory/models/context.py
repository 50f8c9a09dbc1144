"""A compiled context: what one model call is sent, and how much of the window each part takes.
Plain data: compile_context (memory/agent/context.py) makes it, the turn bookkeeping
(memory/store/turns.py) keeps it for a retried step, the client shows its overview."""

from typing import Any

from pydantic import BaseModel, ConfigDict

from durable_memory.models.llm import ChatMessage


class ContextWindowOverview(BaseModel):
    model_config = ConfigDict(frozen=True)

    context_window: int
    system_tokens: int
    core_memory_tokens: int
    metadata_tokens: int
    summary_tokens: int
    messages_tokens: int
    tools_tokens: int
    total_tokens: int
    share_used: float
    message_count: int
    recall_message_count: int
    archival_passage_count: int
    summarized_through_message_id: int


class CompiledContext(BaseModel):
    model_config = ConfigDict(frozen=True)

    system: str
    """The system prompt as one text: its sections joined by a blank line."""
    system_sections: list[str] = []
    """The same sections, stable first (instructions, memory blocks, summary): the request's
    system blocks. Empty in a context stored before requests were laid out for the cache."""
    turn_note: str = ""
    """What changes every turn (the memory metadata): sent as the last block of the newest
    user turn, after the cached prefix."""
    messages: list[ChatMessage]
    tools: list[dict[str, Any]]
    overview: ContextWindowOverview
    last_message_id: int
