"""The memory tools offered to the model, and their execution.

Edit tools never change memory: each creates a PendingDiff and tells the model that the edit
awaits human approval. Every error the model can cause comes back as an `is_error` result with
a message it can act on; a tool call never fails the turn.
"""

import functools
import json
import uuid
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from durable_memory.memory.archive import AGENT_INSERT_TOKEN_LIMIT, ArchiveStore
from durable_memory.memory.errors import DurableMemoryError, validation_message
from durable_memory.memory.ids import validate_user_id
from durable_memory.memory.service import MemoryService
from durable_memory.models.archive import ArchiveSearch, NewPassage, PassageSource, TagMatch
from durable_memory.models.operations import (
    AddContext,
    AddItem,
    AppendText,
    ClearTask,
    EditOperation,
    InsertText,
    LearnFact,
    LearnPreference,
    RemoveItem,
    ReplaceText,
    RethinkText,
    SetField,
    SetTask,
)
from durable_memory.models.recall import MessageRole

_DIFF_NAMESPACE = uuid.UUID("0b7c2a55-8f3e-4a51-9d0e-3c6b1f2e7a90")

_APPROVAL = (
    "The edit is NOT applied yet: it becomes a pending diff that a human approves or rejects. "
    "Do not propose the same edit again while it is pending."
)


@dataclass(frozen=True)
class ToolOutcome:
    content: str
    is_error: bool = False
    diff_id: str | None = None


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CoreMemoryAppend(_Args):
    label: str
    content: str = Field(min_length=1)
    reasoning: str = ""


class CoreMemoryReplace(_Args):
    label: str
    old_content: str = Field(min_length=1)
    new_content: str
    reasoning: str = ""


class MemoryInsert(_Args):
    label: str
    new_string: str = Field(min_length=1)
    insert_line: int = Field(default=-1, ge=-1)
    reasoning: str = ""


class MemoryRethink(_Args):
    label: str
    new_memory: str
    reasoning: str = ""


EditKind = Literal[
    "set",
    "add",
    "remove",
    "set_task",
    "clear_task",
    "learn_preference",
    "learn_fact",
    "add_context",
]


class EditMemoryBlock(_Args):
    label: str
    field: str = ""
    operation: EditKind
    value: str | list[str] | None = None
    reasoning: str = Field(min_length=1)


class ArchivalInsert(_Args):
    content: str = Field(min_length=1)
    tags: list[str] = Field(default_factory=list, max_length=20)


class ArchivalSearch(_Args):
    query: str
    tags: list[str] = Field(default_factory=list)
    tag_match_mode: TagMatch = TagMatch.ANY
    start_datetime: datetime | None = None
    end_datetime: datetime | None = None
    top_k: int = Field(default=5, ge=1, le=50)


class ConversationSearch(_Args):
    query: str = ""
    roles: list[MessageRole] = Field(default_factory=list)
    start_date: date | None = None
    end_date: date | None = None
    limit: int = Field(default=10, ge=1, le=50)


def _schema(args: type[BaseModel], description: str) -> dict[str, Any]:
    schema = args.model_json_schema()
    schema.pop("title", None)
    for prop in schema.get("properties", {}).values():
        prop.pop("title", None)
    return {"description": description, "input_schema": schema}


TOOL_DOCS: dict[str, tuple[type[_Args], str]] = {
    "core_memory_append": (
        CoreMemoryAppend,
        (
            "Propose appending a new line to a free-text memory block (label). Use it when you "
            "learn something lasting about the user or yourself that belongs in core memory. "
            "Give your reasoning for the reviewer. " + _APPROVAL
        ),
    ),
    "core_memory_replace": (
        CoreMemoryReplace,
        (
            "Propose replacing an exact passage of a free-text memory block. old_content must "
            "appear exactly once in the block, copied character for character; new_content may "
            "be empty to delete it. " + _APPROVAL
        ),
    ),
    "memory_insert": (
        MemoryInsert,
        (
            "Propose inserting text into a free-text memory block after line insert_line "
            "(0 inserts at the top, -1 at the end). " + _APPROVAL
        ),
    ),
    "memory_rethink": (
        MemoryRethink,
        (
            "Propose rewriting a free-text memory block as a whole, when it has become "
            "disorganised or outdated. new_memory replaces the entire value. " + _APPROVAL
        ),
    ),
    "edit_memory_block": (
        EditMemoryBlock,
        (
            "Propose a change to a typed memory block (one with fields, such as student or "
            "journey). operation: 'set' sets field to value (null clears it); 'add' and "
            "'remove' add or remove one item of a list field; on a human block, 'set_task' "
            "(value = the task), 'clear_task' (value 'archive' also files the finished task in "
            "archival memory), 'learn_preference', 'learn_fact' and 'add_context' (value = the "
            "text) need no field. Explain in reasoning why the change is right. " + _APPROVAL
        ),
    ),
    "archival_memory_insert": (
        ArchivalInsert,
        (
            "Store a passage in archival memory, your long-term store outside the context "
            "window, for things worth finding later but not worth keeping in core memory. Tags "
            f"help later searches. At most {AGENT_INSERT_TOKEN_LIMIT} tokens per insert; split "
            "longer text. Stored at once and searchable with archival_memory_search."
        ),
    ),
    "archival_memory_search": (
        ArchivalSearch,
        (
            "Search archival memory (past passages, archived tasks, text rotated out of core "
            "memory) by meaning and keywords. Filter by tags (tag_match_mode 'any' or 'all') and "
            "by an ISO 8601 time range. Returns the best top_k passages with their ids."
        ),
    ),
    "conversation_search": (
        ConversationSearch,
        (
            "Search the full history of messages with this user (recall memory), including "
            "those no longer in your context. query matches every word; filter by role (user, "
            "assistant, tool_call, tool_result) and by dates (YYYY-MM-DD, inclusive)."
        ),
    ),
}


@functools.cache
def _tool_definitions_json() -> str:
    # Building the JSON schemas costs milliseconds, and every turn needs them: once a process.
    defs = [{"name": name, **_schema(args, doc)} for name, (args, doc) in TOOL_DOCS.items()]
    return json.dumps(defs)


def tool_definitions() -> list[dict[str, Any]]:
    """The `tools` parameter of a Messages API call, in a stable order (a fresh copy)."""
    defs: list[dict[str, Any]] = json.loads(_tool_definitions_json())
    return defs


def _edit_operation(call: _Args) -> tuple[str, EditOperation, str]:
    """(label, operation, reasoning) for an edit tool's arguments."""
    match call:
        case CoreMemoryAppend(label=label, content=content, reasoning=why):
            return label, AppendText(content=content), why
        case CoreMemoryReplace(label=label, old_content=old, new_content=new, reasoning=why):
            return label, ReplaceText(old_content=old, new_content=new), why
        case MemoryInsert(label=label, new_string=text, insert_line=line, reasoning=why):
            return label, InsertText(new_string=text, insert_line=line), why
        case MemoryRethink(label=label, new_memory=text, reasoning=why):
            return label, RethinkText(new_value=text), why
        case EditMemoryBlock():
            return call.label, _typed_operation(call), call.reasoning
    raise AssertionError(call)


def _text_value(call: EditMemoryBlock) -> str:
    if not isinstance(call.value, str) or not call.value.strip():
        raise DurableMemoryError(f"operation '{call.operation}' needs a non-empty string value")
    return call.value


def _typed_operation(call: EditMemoryBlock) -> EditOperation:
    needs_field = call.operation in ("set", "add", "remove")
    if needs_field and not call.field:
        raise DurableMemoryError(f"operation '{call.operation}' needs a field")
    match call.operation:
        case "set":
            return SetField(field=call.field, value=call.value)
        case "add":
            return AddItem(field=call.field, value=_text_value(call))
        case "remove":
            return RemoveItem(field=call.field, value=_text_value(call))
        case "set_task":
            return SetTask(task=_text_value(call))
        case "clear_task":
            return ClearTask(archive=call.value == "archive")
        case "learn_preference":
            return LearnPreference(preference=_text_value(call))
        case "learn_fact":
            return LearnFact(fact=_text_value(call))
        case "add_context":
            return AddContext(note=_text_value(call))
    raise AssertionError(call.operation)


class MemoryTools:
    """Executes the model's tool calls for one user and turn."""

    def __init__(self, service: MemoryService, archive: ArchiveStore | None = None) -> None:
        self.service = service
        self.archive = archive

    def execute(
        self,
        user_id: str,
        turn_id: str,
        name: str,
        arguments: object,
        call_id: str | None = None,
    ) -> ToolOutcome:
        """Run one tool call. With the model's `call_id`, an edit's diff id derives from the
        turn and the call, so executing the same call again proposes nothing new."""
        try:
            validate_user_id(user_id)
        except DurableMemoryError as error:
            return ToolOutcome(f"{name} failed: {error}", is_error=True)
        if name not in TOOL_DOCS:
            return ToolOutcome(
                f"unknown tool '{name}'; the tools are {', '.join(TOOL_DOCS)}", is_error=True
            )
        args_type = TOOL_DOCS[name][0]
        try:
            call = args_type.model_validate(arguments)
        except ValidationError as error:
            return ToolOutcome(
                validation_message(error, f"invalid arguments for {name}"), is_error=True
            )
        try:
            if isinstance(call, ArchivalInsert):
                return self._archival_insert(user_id, turn_id, call)
            if isinstance(call, ArchivalSearch):
                return self._archival_search(user_id, call)
            if isinstance(call, ConversationSearch):
                return self._conversation_search(user_id, call)
            label, op, reasoning = _edit_operation(call)
            diff_id = (
                uuid.uuid5(_DIFF_NAMESPACE, f"{user_id}/{turn_id}/{call_id}").hex
                if call_id
                else None
            )
            diff = self.service.propose(
                user_id, label, op, reasoning, f"turn:{turn_id}", diff_id=diff_id
            )
        except (DurableMemoryError, ValidationError) as error:
            return ToolOutcome(f"{name} failed: {error}", is_error=True)
        return ToolOutcome(
            f"Proposed edit {diff.id} to block '{label}' ({diff.summary}). It awaits human "
            "approval and is not in memory yet; do not propose it again.",
            diff_id=diff.id,
        )

    def _require_archive(self) -> ArchiveStore:
        if self.archive is None:
            raise DurableMemoryError("archival memory is not configured for this agent")
        return self.archive

    def _archival_insert(self, user_id: str, turn_id: str, call: ArchivalInsert) -> ToolOutcome:
        ids = self._require_archive().insert(
            NewPassage(
                user_id=user_id,
                text=call.content,
                tags=tuple(call.tags),
                source=PassageSource.AGENT,
                label=None,
                commit_sha=None,
            )
        )
        return ToolOutcome(f"Stored in archival memory as passage {ids[0]} (turn {turn_id}).")

    def _archival_search(self, user_id: str, call: ArchivalSearch) -> ToolOutcome:
        hits = self._require_archive().search(
            user_id,
            ArchiveSearch(
                query=call.query,
                tags=tuple(call.tags),
                tag_match=call.tag_match_mode,
                start=call.start_datetime,
                end=call.end_datetime,
                top_k=call.top_k,
            ),
        )
        results = [
            {
                "id": h.passage.id,
                "text": h.passage.text,
                "tags": list(h.passage.tags),
                "created_at": h.passage.created_at.isoformat(),
                "score": round(h.score, 4),
            }
            for h in hits
        ]
        return ToolOutcome(json.dumps({"results": results}, ensure_ascii=False))

    def _conversation_search(self, user_id: str, call: ConversationSearch) -> ToolOutcome:
        start = datetime.combine(call.start_date, time(), UTC) if call.start_date else None
        end = (
            datetime.combine(call.end_date + timedelta(days=1), time(), UTC)
            if call.end_date
            else None
        )
        page = self.service.recall.search(
            user_id, call.query, roles=call.roles or None, start=start, end=end, limit=call.limit
        )
        results = [
            {
                "turn_id": m.turn_id,
                "role": m.role.value,
                "content": m.content,
                "created_at": m.created_at.isoformat(),
            }
            for m in page.messages
        ]
        return ToolOutcome(
            json.dumps({"total": page.total, "results": results}, ensure_ascii=False)
        )
