"""What the model is offered: each memory tool's name, description and argument schema (the
`tools` parameter of a model call), and the bounds a call's input is checked against before
any work is done. Executing the calls is tools.py's job.

Every size the model controls is bounded (durable_memory.models.limits): the whole input of a
call (`check_input_size`) and each argument (the argument models' fields).
"""

import functools
import json
from collections.abc import Sequence
from datetime import date, datetime
from typing import Annotated, Any, Literal, get_args

from anthropic.types import MemoryTool20250818Param
from anthropic.types.beta import BetaMemoryTool20250818Command
from pydantic import BaseModel, ConfigDict, Field

from durable_memory.memory.archive.protocol import AGENT_INSERT_TOKEN_LIMIT
from durable_memory.memory.core.limits import LimitExceeded
from durable_memory.models.archive import TagMatch
from durable_memory.models.blocks import ToolSet
from durable_memory.models.limits import (
    MAX_ARGUMENT_NAME_CHARS,
    MAX_PASSAGE_TAGS,
    MAX_QUERY_CHARS,
    MAX_TAG_CHARS,
    MAX_TOOL_ARGUMENT_CHARS,
    MAX_TOOL_INPUT_CHARS,
    MAX_TOOL_INPUT_DEPTH,
    MAX_TOOL_LIST_ITEMS,
)
from durable_memory.models.recall import MessageRole

_APPROVAL = (
    "The edit is NOT applied yet: it becomes a pending diff that a human approves or rejects. "
    "Do not propose the same edit again while it is pending."
)


class ToolArguments(BaseModel):
    """The arguments of one tool call; an argument the tool does not have is refused."""

    model_config = ConfigDict(extra="forbid")


Text = Annotated[str, Field(max_length=MAX_TOOL_ARGUMENT_CHARS)]
NonEmptyText = Annotated[str, Field(min_length=1, max_length=MAX_TOOL_ARGUMENT_CHARS)]
Name = Annotated[str, Field(max_length=MAX_ARGUMENT_NAME_CHARS)]
Query = Annotated[str, Field(max_length=MAX_QUERY_CHARS)]
Tag = Annotated[str, Field(max_length=MAX_TAG_CHARS)]


class CoreMemoryAppend(ToolArguments):
    label: Name
    content: NonEmptyText
    reasoning: Text = ""


class CoreMemoryReplace(ToolArguments):
    label: Name
    old_content: NonEmptyText
    new_content: Text
    reasoning: Text = ""


class MemoryInsert(ToolArguments):
    label: Name
    new_string: NonEmptyText
    insert_line: int = Field(default=-1, ge=-1)
    reasoning: Text = ""


class MemoryRethink(ToolArguments):
    label: Name
    new_memory: Text
    reasoning: Text = ""


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


class EditMemoryBlock(ToolArguments):
    label: Name
    field: Name = ""
    operation: EditKind
    value: Text | Annotated[list[Text], Field(max_length=MAX_TOOL_LIST_ITEMS)] | None = None
    reasoning: NonEmptyText


class ArchivalInsert(ToolArguments):
    content: NonEmptyText
    tags: list[Tag] = Field(default_factory=list, max_length=MAX_PASSAGE_TAGS)


class ArchivalSearch(ToolArguments):
    query: Query
    tags: list[Tag] = Field(default_factory=list, max_length=MAX_PASSAGE_TAGS)
    tag_match_mode: TagMatch = TagMatch.ANY
    start_datetime: datetime | None = None
    end_datetime: datetime | None = None
    top_k: int = Field(default=5, ge=1, le=50)


class ConversationSearch(ToolArguments):
    query: Query = ""
    roles: list[MessageRole] = Field(default_factory=list, max_length=len(MessageRole))
    start_date: date | None = None
    end_date: date | None = None
    limit: int = Field(default=10, ge=1, le=50)


def _schema(args: type[BaseModel], description: str) -> dict[str, Any]:
    schema = args.model_json_schema()
    schema.pop("title", None)
    for prop in schema.get("properties", {}).values():
        prop.pop("title", None)
    return {"description": description, "input_schema": schema}


TOOL_DOCS: dict[str, tuple[type[ToolArguments], str]] = {
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


LETTA_EDIT_TOOLS = (
    "core_memory_append",
    "core_memory_replace",
    "memory_insert",
    "memory_rethink",
    "edit_memory_block",
)
"""The tools of ToolSet.LETTA; the others of TOOL_DOCS come with every tool set."""

MEMORY_TOOL_NAME = "memory"
MEMORY_TOOL_DEFINITION: MemoryTool20250818Param = {"type": "memory_20250818", "name": "memory"}
"""Claude's memory tool (ToolSet.CLAUDE_MEMORY): the API knows its commands' schema."""
MEMORY_COMMANDS = get_args(get_args(BetaMemoryTool20250818Command)[0])
"""The SDK's models of the memory tool's commands (view, create, str_replace, ...)."""


def tool_names(tool_sets: Sequence[ToolSet]) -> tuple[str, ...]:
    """The tools a profile's tool sets offer, in the order `tool_definitions` gives them:
    fixed whatever the profile's order, so equal sets give the same bytes."""
    letta = LETTA_EDIT_TOOLS if ToolSet.LETTA in tool_sets else ()
    memory = (MEMORY_TOOL_NAME,) if ToolSet.CLAUDE_MEMORY in tool_sets else ()
    return (*letta, *memory, *(name for name in TOOL_DOCS if name not in LETTA_EDIT_TOOLS))


NON_PROPOSING_ARGUMENTS: tuple[type[ToolArguments], ...] = (
    ArchivalInsert,
    ArchivalSearch,
    ConversationSearch,
)
"""The arguments of the tools that never propose a diff: the archive's and recall's (an
insert writes a passage, not a diff). Every other tool of TOOL_DOCS edits a block."""


def proposes_diffs(name: str) -> bool:
    """Whether a call of the tool `name` can propose a diff, and so have one stored under the
    id derived from its call: Claude's memory tool and the block edits can; the archive's and
    recall's tools, and a name no tool has, cannot."""
    if name == MEMORY_TOOL_NAME:
        return True
    doc = TOOL_DOCS.get(name)
    return doc is not None and not issubclass(doc[0], NON_PROPOSING_ARGUMENTS)


def offered_in(definitions: Sequence[dict[str, Any]]) -> tuple[str, ...]:
    """The tools a model call's `tools` parameter offered (a turn's stored context's): the
    names of its definitions that are tools of ours, in their order."""
    known = tool_names(tuple(ToolSet))
    return tuple(d["name"] for d in definitions if d.get("name") in known)


def argument_names(name: str) -> list[str]:
    """The argument names of an offered tool, for messages."""
    if name == MEMORY_TOOL_NAME:
        return list(dict.fromkeys(f for command in MEMORY_COMMANDS for f in command.model_fields))
    return list(TOOL_DOCS[name][0].model_fields)


@functools.cache
def _tool_definitions_json(tool_sets: tuple[ToolSet, ...]) -> str:
    # Building the JSON schemas costs milliseconds, and every turn needs them: once a process.
    defs = [
        dict(MEMORY_TOOL_DEFINITION)
        if name == MEMORY_TOOL_NAME
        else {"name": name, **_schema(*TOOL_DOCS[name])}
        for name in tool_names(tool_sets)
    ]
    return json.dumps(defs)


def tool_definitions(tool_sets: Sequence[ToolSet] = (ToolSet.LETTA,)) -> list[dict[str, Any]]:
    """The `tools` parameter of a Messages API call for a profile's tool sets, in a stable
    order (a fresh copy)."""
    defs: list[dict[str, Any]] = json.loads(_tool_definitions_json(tuple(sorted(tool_sets))))
    return defs


def check_input_size(name: str, arguments: object) -> None:
    """Refuse a tool call's input over MAX_TOOL_INPUT_CHARS (the characters of its strings and
    argument names, one more for each value), nested deeper than MAX_TOOL_INPUT_DEPTH, with a
    list or object of more than MAX_TOOL_LIST_ITEMS entries or an argument name longer than
    MAX_ARGUMENT_NAME_CHARS. Walks the input without recursion and stops at the first excess,
    so a huge input costs no more than the limit to look at."""
    size = 0
    pending: list[tuple[object, int]] = [(arguments, 1)]
    while pending:
        value, depth = pending.pop()
        if depth > MAX_TOOL_INPUT_DEPTH:
            raise LimitExceeded(
                f"the input of {name}",
                depth,
                MAX_TOOL_INPUT_DEPTH,
                "flatten it",
                unit="levels deep",
            )
        size += 1
        if isinstance(value, str):
            size += len(value)
        elif isinstance(value, dict | list | tuple):
            if len(value) > MAX_TOOL_LIST_ITEMS:
                raise LimitExceeded(
                    f"a list or object in the input of {name}",
                    len(value),
                    MAX_TOOL_LIST_ITEMS,
                    "send fewer items",
                    unit="items long",
                )
            if isinstance(value, dict):
                for key in value:
                    if len(str(key)) > MAX_ARGUMENT_NAME_CHARS:
                        raise LimitExceeded(
                            f"an argument name of {name}",
                            len(str(key)),
                            MAX_ARGUMENT_NAME_CHARS,
                            f"the arguments are {', '.join(argument_names(name))}",
                        )
                    size += len(str(key))
                pending.extend((item, depth + 1) for item in value.values())
            else:
                pending.extend((item, depth + 1) for item in value)
        if size > MAX_TOOL_INPUT_CHARS:
            raise LimitExceeded(
                f"the input of {name}",
                size,
                MAX_TOOL_INPUT_CHARS,
                "split the content into several smaller calls",
                unit="characters or more",
            )
