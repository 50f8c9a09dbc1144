"""Edit operations on a block: what a pending diff proposes and what a direct edit commits."""

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from durable_memory.models.blocks import BlockFields
from durable_memory.models.limits import MAX_ARGUMENT_NAME_CHARS, MAX_BLOCK_CHARS

EditText = Annotated[str, Field(max_length=MAX_BLOCK_CHARS)]
"""Any text an edit carries: no block holds more, so a longer argument is refused at once,
before it is applied, stored in a diff or sent in a workflow payload."""
NonEmptyEditText = Annotated[str, Field(min_length=1, max_length=MAX_BLOCK_CHARS)]
FieldArgument = Annotated[str, Field(max_length=MAX_ARGUMENT_NAME_CHARS)]


class _Op(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AppendText(_Op):
    """Append a line to a text block (Letta's core_memory_append)."""

    op: Literal["append"] = "append"
    content: EditText


class ReplaceText(_Op):
    """Replace one exact occurrence of `old_content` (Letta's core_memory_replace)."""

    op: Literal["replace"] = "replace"
    old_content: NonEmptyEditText
    new_content: EditText


class InsertText(_Op):
    """Insert text after line `insert_line` (0 = at the top, -1 = at the end)."""

    op: Literal["insert"] = "insert"
    new_string: EditText
    insert_line: int = Field(ge=-1)


class RethinkText(_Op):
    """Rewrite a text block's whole value (Letta's memory_rethink)."""

    op: Literal["rethink"] = "rethink"
    new_value: EditText


class ReplaceFields(_Op):
    """Rewrite a typed block's whole value."""

    op: Literal["replace_fields"] = "replace_fields"
    fields: BlockFields


class SetField(_Op):
    """Set one field of a typed block (`None` clears an optional field)."""

    op: Literal["set_field"] = "set_field"
    field: FieldArgument
    value: EditText | list[EditText] | None


class AddItem(_Op):
    op: Literal["add_item"] = "add_item"
    field: FieldArgument
    value: EditText


class RemoveItem(_Op):
    op: Literal["remove_item"] = "remove_item"
    field: FieldArgument
    value: EditText


class SetTask(_Op):
    """set_task of the seed 000_d8598551964ab573.txt: sets the current task and the state to
    active_task."""

    op: Literal["set_task"] = "set_task"
    task: NonEmptyEditText
    context: EditText | None = None


class ClearTask(_Op):
    """clear_task of the seed 000_d8598551964ab573.txt: back to idle; with `archive`, the task goes
    to archival memory."""

    op: Literal["clear_task"] = "clear_task"
    archive: bool = False


class LearnPreference(_Op):
    op: Literal["learn_preference"] = "learn_preference"
    preference: NonEmptyEditText


class LearnFact(_Op):
    op: Literal["learn_fact"] = "learn_fact"
    fact: NonEmptyEditText


class AddContext(_Op):
    op: Literal["add_context"] = "add_context"
    note: NonEmptyEditText


EditOperation = Annotated[
    AppendText
    | ReplaceText
    | InsertText
    | RethinkText
    | ReplaceFields
    | SetField
    | AddItem
    | RemoveItem
    | SetTask
    | ClearTask
    | LearnPreference
    | LearnFact
    | AddContext,
    Field(discriminator="op"),
]
