"""One conversation turn as a loop of steps: call the model, run the tools it asks for, feed
the results back, until it ends its turn or the step limit is reached.

Each step is its own function so that the Temporal workflow can run them as activities; the
synchronous `run_turn` strings them together for the CLI demo and the tests.
"""

import json
from collections.abc import Sequence
from typing import Protocol

from pydantic import BaseModel, ConfigDict

from durable_memory.memory.agent.context import CompiledContext, Summarizer, compile_context
from durable_memory.memory.agent.tools import MemoryTools, check_input_size, tool_definitions
from durable_memory.memory.core.limits import LimitExceeded, cut_text
from durable_memory.memory.service import MemoryService
from durable_memory.memory.store.recall import RecallStore
from durable_memory.memory.store.summaries import SummaryStore
from durable_memory.models.blocks import ModelSettings
from durable_memory.models.limits import MAX_REPLY_TEXT_CHARS
from durable_memory.models.llm import ChatMessage, ModelReply, TextBlock, ToolResultBlock
from durable_memory.models.recall import MessageRole, NewMessage, RecallMessage

DEFAULT_MAX_STEPS = 8

SUMMARY_SYSTEM = (
    "You summarise conversations for an assistant's memory. Write a compact summary of the "
    "conversation below (and of the earlier summary, if given): who said what that matters, "
    "decisions, open questions, facts about the user. Plain prose, no preamble. Each line of "
    'the conversation is `role: "content"`, the content a JSON string written by that role.'
)


class ChatModel(Protocol):
    def create(
        self,
        settings: ModelSettings,
        system: str,
        messages: list[ChatMessage],
        tools: list[dict[str, object]],
    ) -> ModelReply: ...


class TurnResult(BaseModel):
    model_config = ConfigDict(frozen=True)

    turn_id: str
    reply: str
    diff_ids: list[str]
    steps: int
    stopped_at_step_limit: bool
    input_tokens: int
    output_tokens: int


def step_limit_note(max_steps: int) -> str:
    return (
        f"[stopped after {max_steps} model steps without finishing; the turn ends here and "
        "nothing more was done]"
    )


def reply_text(reply: ModelReply) -> str:
    """The reply's text as recall keeps it and the turn's reply carries it (bounded)."""
    return cut_text(reply.text, MAX_REPLY_TEXT_CHARS)


def recorded_input(name: str, arguments: dict[str, object]) -> str:
    """A tool call's input as recall keeps it: its JSON, or, for an input the tools refuse as
    too large, a small stand-in saying so (the call is answered with that error; storing the
    whole input would only make the recall write fail and the step retry)."""
    try:
        check_input_size(name, arguments)
    except LimitExceeded as error:
        return json.dumps({"refused_input": str(error)}, ensure_ascii=False)
    return json.dumps(arguments, ensure_ascii=False, sort_keys=True)


def reply_messages(reply: ModelReply) -> list[NewMessage]:
    """What a model reply adds to recall: its text, then each tool call."""
    text = reply_text(reply)
    out = [NewMessage(role=MessageRole.ASSISTANT, content=text)] if text else []
    out.extend(
        NewMessage(
            role=MessageRole.TOOL_CALL,
            content=recorded_input(use.name, use.input),
            tool_name=use.name,
            tool_call_id=use.id,
        )
        for use in reply.tool_uses
    )
    return out


def result_messages(results: Sequence[ToolResultBlock]) -> list[NewMessage]:
    return [
        NewMessage(
            role=MessageRole.TOOL_RESULT,
            content=r.content,
            tool_call_id=r.tool_use_id,
            is_error=r.is_error,
        )
        for r in results
    ]


def run_tools(
    tools: MemoryTools, user_id: str, turn_id: str, reply: ModelReply
) -> tuple[list[ToolResultBlock], list[str]]:
    """Execute every tool call of a reply; returns the results and the diff ids created."""
    results, diff_ids = [], []
    for use in reply.tool_uses:
        outcome = tools.execute(user_id, turn_id, use.name, use.input, call_id=use.id)
        results.append(
            ToolResultBlock(tool_use_id=use.id, content=outcome.content, is_error=outcome.is_error)
        )
        if outcome.diff_id:
            diff_ids.append(outcome.diff_id)
    return results, diff_ids


def model_summarizer(model: ChatModel, settings: ModelSettings) -> Summarizer:
    def summarize(messages: Sequence[RecallMessage], previous: str | None) -> str:
        # Each content as a JSON string: a message cannot end its line and forge another speaker.
        transcript = "\n".join(
            f"{m.role.value}: {json.dumps(m.content, ensure_ascii=False)}" for m in messages
        )
        earlier = f"Earlier summary:\n{previous}\n\n" if previous else ""
        prompt = f"{earlier}Conversation:\n{transcript}"
        reply = model.create(
            settings,
            SUMMARY_SYSTEM,
            [ChatMessage(role="user", content=[TextBlock(text=prompt)])],
            [],
        )
        return reply_text(reply).strip() or "(the model returned an empty summary)"

    return summarize


class _Recorder:
    """Appends a turn's messages to recall with consecutive seq numbers."""

    def __init__(self, recall: RecallStore, user_id: str, turn_id: str) -> None:
        self.recall, self.user_id, self.turn_id = recall, user_id, turn_id
        self.seq = recall.next_seq(user_id, turn_id)

    def add(self, messages: Sequence[NewMessage]) -> None:
        if messages:
            self.recall.append(self.user_id, self.turn_id, messages, first_seq=self.seq)
            self.seq += len(messages)


def run_turn(
    service: MemoryService,
    summaries: SummaryStore,
    model: ChatModel,
    tools: MemoryTools,
    user_id: str,
    turn_id: str,
    message: str,
    *,
    max_steps: int = DEFAULT_MAX_STEPS,
    archival_count: int = 0,
) -> TurnResult:
    """Run one turn synchronously (the Temporal workflow runs the same steps as activities)."""
    service.ensure_user(user_id)
    recorder = _Recorder(service.recall, user_id, turn_id)
    recorder.add([NewMessage(role=MessageRole.USER, content=message)])
    settings = service.profile.model
    context: CompiledContext = compile_context(
        service,
        summaries,
        user_id,
        tool_definitions(),
        archival_count=archival_count,
        summarizer=model_summarizer(model, settings),
    )
    messages = list(context.messages)
    diff_ids: list[str] = []
    used_in = used_out = 0
    for step in range(1, max_steps + 1):
        reply = model.create(settings, context.system, messages, context.tools)
        used_in, used_out = used_in + reply.input_tokens, used_out + reply.output_tokens
        recorder.add(reply_messages(reply))
        if not reply.tool_uses:
            return TurnResult(
                turn_id=turn_id,
                reply=reply_text(reply),
                diff_ids=diff_ids,
                steps=step,
                stopped_at_step_limit=False,
                input_tokens=used_in,
                output_tokens=used_out,
            )
        results, new_diffs = run_tools(tools, user_id, turn_id, reply)
        diff_ids.extend(new_diffs)
        recorder.add(result_messages(results))
        messages.append(ChatMessage(role="assistant", content=list(reply.content)))
        messages.append(ChatMessage(role="user", content=list(results)))
    note = step_limit_note(max_steps)
    recorder.add([NewMessage(role=MessageRole.ASSISTANT, content=note)])
    last_text = reply_text(reply)
    return TurnResult(
        turn_id=turn_id,
        reply=f"{last_text}\n\n{note}" if last_text else note,
        diff_ids=diff_ids,
        steps=max_steps,
        stopped_at_step_limit=True,
        input_tokens=used_in,
        output_tokens=used_out,
    )
