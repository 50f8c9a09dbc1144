"""Executing the model's memory tool calls (what each tool is and accepts: tool_specs.py).

Edit tools never change memory: each creates a PendingDiff and tells the model that the edit
awaits human approval. Every error the model can cause comes back as an `is_error` result with
a message it can act on; a tool call never fails the turn.

Every result is cut to MAX_TOOL_RESULT_CHARS, saying so. Values the model has no say in
(passages, messages, block text) are framed in results as JSON strings, so none can pass for a
word of our own.
"""

import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, time, timedelta
from typing import Any

from anthropic.lib.tools import ToolError
from pydantic import ValidationError

from durable_memory.memory.agent.memory_tool import (
    ProposingMemoryTool,
    parse_command,
    proposal_text,
    settled_ahead,
)
from durable_memory.memory.agent.tool_specs import (
    MEMORY_TOOL_NAME,
    TOOL_DOCS,
    ArchivalInsert,
    ArchivalSearch,
    ConversationSearch,
    CoreMemoryAppend,
    CoreMemoryReplace,
    EditMemoryBlock,
    MemoryInsert,
    MemoryRethink,
    ToolArguments,
    check_input_size,
    tool_names,
)
from durable_memory.memory.archive.protocol import ArchiveStore
from durable_memory.memory.core.errors import (
    DurableMemoryError,
    UserBeingForgotten,
    UserForgotten,
    validation_message,
)
from durable_memory.memory.core.ids import validate_user_id
from durable_memory.memory.core.limits import cut_text
from durable_memory.memory.service.blocks import Blocks
from durable_memory.memory.service.review import Review
from durable_memory.memory.store.recall import RecallStore
from durable_memory.models.archive import ArchiveSearch, NewPassage, PassageSource
from durable_memory.models.diffs import Proposer
from durable_memory.models.limits import (
    MAX_ARGUMENT_NAME_CHARS,
    MAX_RESULT_TEXT_CHARS,
    MAX_TOOL_RESULT_CHARS,
)
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

_DIFF_NAMESPACE = uuid.UUID("0b7c2a55-8f3e-4a51-9d0e-3c6b1f2e7a90")


def call_diff_id(user_id: str, turn_id: str, call_id: str) -> str:
    """The id of the diff a tool call of a user's turn proposes, if it proposes one: derived
    from the call, so the call run again finds its diff instead of proposing a second."""
    return uuid.uuid5(_DIFF_NAMESPACE, f"{user_id}/{turn_id}/{call_id}").hex


@dataclass(frozen=True)
class ToolOutcome:
    content: str
    is_error: bool = False
    diff_id: str | None = None


def _edit_operation(call: ToolArguments) -> tuple[str, EditOperation, str]:
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


def _bounded(outcome: ToolOutcome) -> ToolOutcome:
    """The outcome with its content cut to MAX_TOOL_RESULT_CHARS, saying so."""
    if len(outcome.content) <= MAX_TOOL_RESULT_CHARS:
        return outcome
    content = cut_text(outcome.content, MAX_TOOL_RESULT_CHARS)
    return ToolOutcome(content, is_error=outcome.is_error, diff_id=outcome.diff_id)


def search_result(results: list[dict[str, Any]], text_key: str, **header: object) -> str:
    """A search tool's JSON result: the header fields, then as many results (best first) as
    fit in MAX_TOOL_RESULT_CHARS, each one's text (at `text_key`) cut to
    MAX_RESULT_TEXT_CHARS, and a note saying how many did not fit. JSON frames every value:
    a text can hold anything and still cannot pass for another result or field."""
    shown: list[dict[str, Any]] = []
    size = len(json.dumps(header, ensure_ascii=False)) + 200  # the results key and the note
    for result in results:
        result = {**result, text_key: cut_text(result[text_key], MAX_RESULT_TEXT_CHARS)}
        cost = len(json.dumps(result, ensure_ascii=False)) + 2
        if size + cost > MAX_TOOL_RESULT_CHARS:
            break
        shown.append(result)
        size += cost
    body: dict[str, object] = {**header, "results": shown}
    if len(shown) < len(results):
        body["note"] = (
            f"{len(results) - len(shown)} more results did not fit in a tool result of "
            f"{MAX_TOOL_RESULT_CHARS} characters; ask for fewer or narrow the search"
        )
    return json.dumps(body, ensure_ascii=False)


class MemoryTools:
    """Executes the model's tool calls for one user and turn: the tools the turn offered the
    model (its stored context's, `offered`), else those the user's profile offers now
    (tool_specs.tool_names), no others."""

    def __init__(
        self,
        blocks: Blocks,
        review: Review,
        recall: RecallStore,
        archive: ArchiveStore | None = None,
    ) -> None:
        self.blocks = blocks
        self.review = review
        self.recall = recall
        self.archive = archive

    def execute(
        self,
        user_id: str,
        turn_id: str,
        name: str,
        arguments: object,
        call_id: str | None = None,
        offered: Sequence[str] | None = None,
        before_write: Callable[[], object] | None = None,
    ) -> ToolOutcome:
        """Run one tool call. With the model's `call_id`, an edit's diff id derives from the
        turn and the call, so executing the same call again proposes nothing new. The
        result's content is at most MAX_TOOL_RESULT_CHARS long. `offered`: the tools the
        turn's model calls were offered (`offered_in` its stored context's); None: those the
        user's profile offers, read now (in the distributed mode a round trip to the git
        server). `before_write`: the turn's erasure check, made by an archive insert between
        its embedding (seconds) and its write; what it raises (UserForgotten,
        UserBeingForgotten) is the step's refusal, not the tool's error."""
        return _bounded(
            self._execute(user_id, turn_id, name, arguments, call_id, offered, before_write)
        )

    def _execute(
        self,
        user_id: str,
        turn_id: str,
        name: str,
        arguments: object,
        call_id: str | None,
        offered: Sequence[str] | None,
        before_write: Callable[[], object] | None = None,
    ) -> ToolOutcome:
        shown_name = cut_text(name, MAX_ARGUMENT_NAME_CHARS)
        try:
            validate_user_id(user_id)
            if offered is None:
                offered = tool_names(self.blocks.profile(user_id).tools)
        except DurableMemoryError as error:
            return ToolOutcome(f"{shown_name} failed: {error}", is_error=True)
        if name not in offered:
            return ToolOutcome(
                f"unknown tool '{shown_name}'; the tools are {', '.join(offered)}", is_error=True
            )
        try:
            check_input_size(name, arguments)
        except DurableMemoryError as error:
            return ToolOutcome(f"{name} failed: {error}", is_error=True)
        diff_id = call_diff_id(user_id, turn_id, call_id) if call_id else None
        if name == MEMORY_TOOL_NAME:
            return self._memory(user_id, turn_id, arguments, diff_id)
        args_type = TOOL_DOCS[name][0]
        try:
            call = args_type.model_validate(arguments)
        except ValidationError as error:
            return ToolOutcome(
                validation_message(error, f"invalid arguments for {name}"), is_error=True
            )
        try:
            if isinstance(call, ArchivalInsert):
                return self._archival_insert(user_id, turn_id, call, before_write)
            if isinstance(call, ArchivalSearch):
                return self._archival_search(user_id, call)
            if isinstance(call, ConversationSearch):
                return self._conversation_search(user_id, call)
            label, op, reasoning = _edit_operation(call)
            diff = self.review.propose(
                user_id, label, op, reasoning, Proposer.turn(turn_id), diff_id=diff_id
            )
        except (UserForgotten, UserBeingForgotten):
            raise  # the turn's refusal (`before_write`), not the tool's error
        except (DurableMemoryError, ValidationError) as error:
            if isinstance(error, DurableMemoryError) and error.retryable:
                raise  # e.g. the git remote is down: the step is retried, not reported failed
            return ToolOutcome(f"{name} failed: {error}", is_error=True)
        # The summary quotes the model's text: as a JSON string it cannot end the sentence.
        fate = settled_ahead(diff) or (
            "It awaits human approval and is not in memory yet; do not propose it again."
        )
        return ToolOutcome(
            f"Proposed edit {diff.id} to block '{label}': "
            f"{json.dumps(diff.summary, ensure_ascii=False)}. {fate}",
            diff_id=diff.id,
        )

    def _memory(
        self, user_id: str, turn_id: str, arguments: object, diff_id: str | None
    ) -> ToolOutcome:
        """Claude's memory tool (memory_tool.py): its edits become pending diffs."""
        tool = ProposingMemoryTool(self.blocks, self.review, user_id, turn_id, diff_id)
        try:
            # The call run again (its step retried): its edit may be in memory already (a
            # standing approval, or a person, settled it), so the command would now change
            # nothing and be refused. Answer what the first run proposed instead.
            command = parse_command(arguments)
            proposes = command.command != "view"  # a view never proposes: no lookup
            again = self.review.proposed_again(diff_id, user_id) if diff_id and proposes else None
            if again is not None:
                return ToolOutcome(proposal_text(again), diff_id=again.id)
            content = tool.execute(command)
        except (ToolError, DurableMemoryError) as error:
            if isinstance(error, DurableMemoryError) and error.retryable:
                raise  # as for edit_memory_block: the step is retried, not reported failed
            return ToolOutcome(f"Error: {error}", is_error=True)
        diff = tool.proposed
        return ToolOutcome(str(content), diff_id=diff.id if diff is not None else None)

    def _require_archive(self) -> ArchiveStore:
        if self.archive is None:
            raise DurableMemoryError("archival memory is not configured for this agent")
        return self.archive

    def _archival_insert(
        self,
        user_id: str,
        turn_id: str,
        call: ArchivalInsert,
        before_write: Callable[[], object] | None = None,
    ) -> ToolOutcome:
        ids = self._require_archive().insert(
            NewPassage(
                user_id=user_id,
                text=call.content,
                tags=tuple(call.tags),
                source=PassageSource.AGENT,
                label=None,
                commit_sha=None,
            ),
            before_write=before_write,
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
        return ToolOutcome(search_result(results, "text"))

    def _conversation_search(self, user_id: str, call: ConversationSearch) -> ToolOutcome:
        start = datetime.combine(call.start_date, time(), UTC) if call.start_date else None
        end = (
            datetime.combine(call.end_date + timedelta(days=1), time(), UTC)
            if call.end_date
            else None
        )
        page = self.recall.search(
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
        return ToolOutcome(search_result(results, "content", total=page.total))
