"""A compiled context: what one model call is sent, and how much of the window each part takes.
Plain data: compile_context (memory/agent/context.py) makes it, the turn bookkeeping
(memory/store/turns.py) keeps it for a retried step, the client shows its overview."""

from typing import Any

from pydantic import BaseModel, ConfigDict

from durable_memory.models.blocks import ModelSettings
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
    memory_update_tokens: int = 0
    """The memory update (blocks changed since the base), sent with the turn note."""


class PromptBase(BaseModel):
    """What a user's cached system prompt was compiled from: the commit whose memory blocks it
    shows, and the last message the conversation summary covered then (0: none)."""

    model_config = ConfigDict(frozen=True)

    commit: str
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
    memory_update: str = ""
    """The blocks changed since `memory_base`, their current text: sent before the turn note,
    after the cached prefix. Empty when the system prompt shows HEAD's blocks."""
    memory_base: str | None = None
    """The commit whose blocks the system prompt shows (None: a context stored before bases
    were kept). The turn's prompt base (PromptBaseStore, memory/store/turns.py) moves to it."""
    messages: list[ChatMessage]
    tools: list[dict[str, Any]]
    overview: ContextWindowOverview
    last_message_id: int
    model: ModelSettings | None = None
    """The profile's model settings the context was compiled for: every model call of the
    turn uses them (a profile changed meanwhile takes effect at the next turn), and no step
    reads the profile again, which in the distributed mode is a round trip to the git
    server. None in a context stored before: the profile is read."""
