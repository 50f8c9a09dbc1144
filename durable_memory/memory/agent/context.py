"""compile_context: everything one model call needs, and how much of the window it takes;
model_request: how a call lays it out for the prompt cache.

A request runs from the most stable part to the least, because Anthropic's prompt cache
reuses a prefix only while it is byte-identical: the tools, the profile's instructions (not
editable by the agent), the memory blocks in Letta's rendering, the conversation summary if
older messages were summarised (these three are the system prompt's blocks), the messages
(recall's messages after the summary), and last the turn note: the memory-metadata section
(archival and recall counts, when memory last changed, the agent's own pending proposals),
which changes every turn, as the last block of the newest user turn. The system prompt shows
the blocks at the user's prompt base; the blocks changed since (an approval) come as the
memory update, before the turn note, so an approval does not rewrite the cached
conversation; the base moves to HEAD when that is free or needed (`_memory_parts`,
`warm_base`). Every text in a section
is escaped (formats.escape_prompt_text): no block value, diff summary or summary can close or
open a section, and no message or tool result can open or close the memory update or the
turn note (`neutralised`). The output is a pure function of the stored state and the prompt
base the caller passes (whether the base is still warm is decided before, from the clock, in
`warm_base`): compiling twice gives the same bytes. docs/context-and-tools.md has the
breakpoints and what invalidates what.

Over 300 lines because the layout's parts share one rule (same state, same bytes) and each
decides what the next depends on: the memory parts, the sections, the request's markers.
"""

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from durable_memory.memory.core.errors import DurableMemoryError
from durable_memory.memory.core.formats import escape_prompt_text, render_memory
from durable_memory.memory.core.tokens import count_tokens, count_tokens_cached
from durable_memory.memory.service.access import Block
from durable_memory.memory.service.blocks import Blocks, BlocksRead
from durable_memory.memory.service.review import Review
from durable_memory.memory.store.recall import RecallStore
from durable_memory.memory.store.summaries import SummaryStore
from durable_memory.memory.store.turns import BaseRead, PromptBaseStore
from durable_memory.models.blocks import AgentProfile, ModelSettings
from durable_memory.models.context import CompiledContext, ContextWindowOverview, PromptBase
from durable_memory.models.history import CommitInfo
from durable_memory.models.llm import (
    CACHE_TTL_SECONDS,
    CacheControl,
    CacheTTL,
    ChatMessage,
    ContentBlock,
    ModelRequest,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from durable_memory.models.recall import MessageRole, RecallMessage

DEFAULT_OVERFLOW_SHARE = 0.9
KEEP_SHARE_AFTER_SUMMARY = 0.5
MESSAGE_OVERHEAD_TOKENS = 4
"""Per message, for the role and framing around its content block."""
"""After summarising, the kept messages take at most this share of the message budget."""

TURN_NOTE_START = "<memory_metadata>"
"""How the turn note begins: the block after the user's own text in the newest user turn."""
MEMORY_UPDATE_START = "<memory_update>"
"""How the memory update begins: the block before the turn note, when blocks changed since
the prompt base."""

Summarizer = Callable[[Sequence[RecallMessage], str | None], str]
"""(messages to fold in, previous summary) -> new summary. In production: a model call."""


@dataclass(frozen=True)
class ContextSources:
    """What a context is compiled from: the blocks, the agent's pending proposals, the
    conversation and its summary."""

    blocks: Blocks
    review: Review
    recall: RecallStore
    summaries: SummaryStore


_OUR_TAIL_TAG = re.compile(r"<(\s*/?\s*)(memory_update|memory_metadata)", re.IGNORECASE)
"""The opening of a tag of the sections we append to the newest user turn."""


def neutralised(text: str) -> str:
    """`text` from the user's side of the conversation (their messages, tool results quoting
    the archive or recall) with the `<` of our own tail sections' tags escaped: the memory
    update and the turn note carry our authority ("replaces what the system prompt shows"),
    so a message must not be able to open or close one. Everything else is left as the user
    wrote it (code, maths), and the escaping is a pure function of the text."""
    if "<" not in text:  # most messages; every turn neutralises the whole conversation
        return text
    return _OUR_TAIL_TAG.sub(r"&lt;\1\2", text)


def _block(m: RecallMessage) -> tuple[str, ContentBlock] | None:
    """The Messages API role and content block a recall message becomes (None: not sent)."""
    if m.role is MessageRole.USER:
        return "user", TextBlock(text=neutralised(m.content))
    if m.role is MessageRole.ASSISTANT:
        return "assistant", TextBlock(text=m.content)
    if m.role is MessageRole.TOOL_CALL:
        use = ToolUseBlock(
            id=m.tool_call_id or "", name=m.tool_name or "", input=json.loads(m.content)
        )
        return "assistant", use
    if m.role is MessageRole.TOOL_RESULT:
        result = ToolResultBlock(
            tool_use_id=m.tool_call_id or "", content=neutralised(m.content), is_error=m.is_error
        )
        return "user", result
    return None


MESSAGE_TOKENS_KEPT = 20_000
"""Token counts of recall messages kept by `message_tokens` (two ints each, about 2 MiB)."""
_message_tokens: dict[int, int] = {}


def message_tokens(m: RecallMessage) -> int:
    """Tokens a recall message costs in the context: its content block as sent. Every turn
    counts every message of its window again, so the counts are kept, by a hash of what the
    block is made of (a message edited since, by a redaction, is counted afresh)."""
    key = hash((m.role, m.content, m.tool_name, m.tool_call_id, m.is_error))
    found = _message_tokens.get(key)
    if found is None:
        block = _block(m)
        found = count_tokens(block[1].model_dump_json()) + MESSAGE_OVERHEAD_TOKENS if block else 0
        if len(_message_tokens) >= MESSAGE_TOKENS_KEPT:  # bounded: start again
            _message_tokens.clear()
        _message_tokens[key] = found
    return found


def to_chat_messages(
    messages: Sequence[RecallMessage], *, start_with_user: bool = True
) -> list[ChatMessage]:
    """Recall messages as Messages API turns: consecutive blocks of one role are merged, and a
    tool call whose result never arrived (a turn cut short) is left out. A context starts
    with a user message; a continuation of a turn (`start_with_user=False`) need not."""
    answered = {m.tool_call_id for m in messages if m.role is MessageRole.TOOL_RESULT}
    turns: list[tuple[str, list[ContentBlock]]] = []
    for m in messages:
        found = _block(m)
        if found is None or (m.role is MessageRole.TOOL_CALL and m.tool_call_id not in answered):
            continue
        role, block = found
        if turns and turns[-1][0] == role:
            turns[-1][1].append(block)
        else:
            turns.append((role, [block]))
    while start_with_user and turns and turns[0][0] != "user":
        turns.pop(0)
    return [ChatMessage.model_validate({"role": r, "content": b}) for r, b in turns]


def _metadata(
    sources: ContextSources,
    user_id: str,
    last: CommitInfo | None,
    archival_count: int,
    recall_count: int,
) -> str:
    own = [d for d in sources.review.pending(user_id) if d.proposer.turn_id is not None]
    changed = last.timestamp.isoformat() if last else "never"
    lines = [
        TURN_NOTE_START,
        f"- Memory blocks were last modified at {changed}",
        f"- {recall_count} messages between you and the user are stored in recall memory "
        "(use conversation_search to find them)",
        f"- {archival_count} passages are stored in archival memory "
        "(use archival_memory_search to find them)",
    ]
    if own:
        lines.append("- Your memory edits awaiting human approval (do not propose them again):")
        # A summary quotes the model's text: as a JSON string on one line it cannot end its
        # list item or add one, and escaped it cannot end the section.
        lines.extend(
            escape_prompt_text(f"  - {d.id}: {json.dumps(d.summary, ensure_ascii=False)}")
            for d in sorted(own, key=lambda d: d.id)
        )
    else:
        lines.append("- You have no memory edits awaiting approval")
    lines.append("</memory_metadata>")
    return "\n".join(lines)


def _cut_index(messages: Sequence[RecallMessage], keep_budget: int) -> int:
    """Where the kept messages start: the newest that fit in `keep_budget` tokens, starting
    at a user message so that no tool call is separated from its result. 0: nothing to cut."""
    kept = 0
    cut = len(messages)
    for index in range(len(messages) - 1, -1, -1):
        kept += message_tokens(messages[index])
        if messages[index].role is MessageRole.USER:
            if kept > keep_budget and cut < len(messages):
                break
            cut = index
    return cut if cut < len(messages) else 0


def compile_context(
    sources: ContextSources,
    user_id: str,
    tools: list[dict[str, Any]],
    *,
    archival_count: int = 0,
    overflow_share: float = DEFAULT_OVERFLOW_SHARE,
    summarizer: Summarizer | None = None,
    base: PromptBase | None = None,
    profile: AgentProfile | None = None,
    summary: tuple[int, str | None] | None = None,
) -> CompiledContext:
    """Compile the context; if messages push it past `overflow_share` of the window and a
    summarizer is given, fold the oldest messages into the summary first.

    The system prompt shows the memory blocks at `base` (the user's prompt base, None: at
    HEAD), and the blocks changed since come as the memory update, unless the base moves to
    HEAD here (`_memory_parts` says when); `memory_base` says where the blocks are from.
    `profile` is the user's, if the caller has just read it (else it is read here), and
    `summary` their newest summary (the last message it covers, its text; (0, None): none),
    if the caller has just read it (`PromptBaseStore.with_last_reply` does, with the base);
    a summary made here is read back."""
    profile = profile or sources.blocks.profile(user_id)
    context = _compile(sources, user_id, profile, tools, archival_count, base, summary)
    window = profile.model.context_window
    if summarizer is None or context.overview.total_tokens <= overflow_share * window:
        return context
    after, previous = _summary(sources.summaries, user_id)
    messages = sources.recall.after(user_id, after)
    fixed = context.overview.total_tokens - context.overview.messages_tokens
    budget = max(0, int(overflow_share * window) - fixed)
    cut = _cut_index(messages, int(budget * KEEP_SHARE_AFTER_SUMMARY))
    if cut == 0:
        return context
    folded = messages[:cut]
    sources.summaries.add(user_id, folded[-1].id, summarizer(folded, previous))
    return _compile(sources, user_id, profile, tools, archival_count, base)


def _summary(summaries: SummaryStore, user_id: str) -> tuple[int, str | None]:
    latest = summaries.latest(user_id)
    return (latest[0], latest[1]) if latest else (0, None)


def _rendered(blocks: dict[str, Block]) -> str:
    return render_memory({b.label: (b.spec, b.fields) for b in blocks.values()})


def _memory_update(changed: dict[str, Block]) -> str:
    """The blocks changed since the prompt base, with their current text, saying that it
    replaces the system prompt's: the model is never left believing the older text."""
    return "\n".join(
        [
            MEMORY_UPDATE_START,
            "Your memory changed after this conversation's system prompt was compiled (an "
            "approved edit, a person's edit, a restore or a rotation). Below is the current "
            "text of the blocks that "
            f"changed ({', '.join(changed)}): it replaces what the system prompt's memory blocks "
            "show for them. The other blocks there are current.",
            _rendered(changed),
            "</memory_update>",
        ]
    )


def _memory_parts(
    blocks: Blocks,
    user_id: str,
    settings: ModelSettings,
    base: PromptBase | None,
    summarized_through: int,
) -> tuple[str, str, str | None, CommitInfo | None]:
    """(the system prompt's memory blocks, the memory update, the commit they show, HEAD's
    commit).

    They show the base's blocks, and the update carries the blocks changed since, unless the
    base moves to HEAD: when there is none or the caller let it go (the cache is cold), when
    the profile turns the update off or caches nothing, when a new summary rewrote the
    conversation anyway (its cached prefix is written again, so the blocks cost little more),
    or when the update would pass `memory_delta_max_share` of the blocks' tokens. A base that
    is no longer in HEAD's history (a redaction rewrote it, a forget removed it) or that
    today's profile cannot read is dropped: its text may be what was meant to go."""
    base_commit = (
        base.commit
        if base is not None
        and settings.memory_delta
        and settings.cache_ttl != "off"
        and base.summarized_through_message_id == summarized_through
        else None
    )
    read: BlocksRead
    try:
        read = blocks.read_blocks_and_base(user_id, base_commit)
    except DurableMemoryError:
        if base_commit is None:
            raise
        read = blocks.read_blocks_and_base(user_id, None)  # unreadable at the base
    head, at_base, last = read.head, read.at_base, read.head_info
    head_commit = next(iter(head.values())).sha if head else None
    current = _rendered(head)
    if at_base is None or base_commit is None or head_commit == base_commit:
        return current, "", head_commit, last
    changed = {label: b for label, b in head.items() if b.fields != at_base[label].fields}
    if not changed:  # the same blocks: the same bytes at HEAD
        return current, "", head_commit, last
    shown, update = _rendered(at_base), _memory_update(changed)
    if count_tokens(update) > settings.memory_delta_max_share * count_tokens(shown):
        return current, "", head_commit, last
    return shown, update, base_commit, last


def _compile(
    sources: ContextSources,
    user_id: str,
    profile: AgentProfile,
    tools: list[dict[str, Any]],
    archival_count: int,
    base: PromptBase | None,
    summary_read: tuple[int, str | None] | None = None,
) -> CompiledContext:
    after, summary = summary_read or _summary(sources.summaries, user_id)
    core, update, memory_base, last = _memory_parts(
        sources.blocks, user_id, profile.model, base, after
    )
    recent, recall_count = sources.recall.after_counted(user_id, after)
    metadata = _metadata(sources, user_id, last, archival_count, recall_count)
    summary_text = (
        f"<conversation_summary>\n{escape_prompt_text(summary)}\n</conversation_summary>"
        if summary
        else ""
    )
    instructions = profile.persona.instructions.strip()
    sections = [p for p in (instructions, core, summary_text) if p]
    messages = to_chat_messages(recent)
    tokens = {
        "system": count_tokens_cached(instructions),
        "core": count_tokens(core),
        "update": count_tokens(update),
        "metadata": count_tokens(metadata),
        "summary": count_tokens(summary_text),
        "messages": sum(message_tokens(m) for m in recent),
        "tools": count_tokens_cached(json.dumps(tools, sort_keys=True)),
    }
    total = sum(tokens.values())
    window = profile.model.context_window
    return CompiledContext(
        system="\n\n".join(sections),
        system_sections=sections,
        turn_note=metadata,
        memory_update=update,
        memory_base=memory_base,
        messages=messages,
        tools=tools,
        last_message_id=recent[-1].id if recent else after,
        model=profile.model,
        overview=ContextWindowOverview(
            context_window=window,
            system_tokens=tokens["system"],
            core_memory_tokens=tokens["core"],
            metadata_tokens=tokens["metadata"],
            summary_tokens=tokens["summary"],
            messages_tokens=tokens["messages"],
            tools_tokens=tokens["tools"],
            total_tokens=total,
            share_used=round(total / window, 6),
            message_count=len(recent),
            recall_message_count=recall_count,
            archival_passage_count=archival_count,
            summarized_through_message_id=after,
            memory_update_tokens=tokens["update"],
        ),
    )


def warm_base(read: BaseRead, settings: ModelSettings, now: datetime) -> PromptBase | None:
    """The user's prompt base (as `PromptBaseStore.with_last_reply` read it) while the prompt
    cache may still hold it; None (move it to HEAD) once the user's last model call is older
    than the profile's cache TTL: the next request writes everything again anyway. (The
    reply's time stands for the call's, which began a little earlier: a call that took longer
    than the gap left to the TTL leaves the base one turn longer than a cold cache needed.)"""
    base, last = read.base, read.last_reply_at
    ttl = CACHE_TTL_SECONDS.get(settings.cache_ttl)
    if last is None or ttl is None or (now - last).total_seconds() > ttl:
        return None
    return base


def keep_base(
    bases: PromptBaseStore, user_id: str, context: CompiledContext, read: BaseRead
) -> None:
    """Move the user's prompt base to what a turn's stored context was compiled from; `read`:
    the base as the step read it before compiling (`PromptBaseStore.move`)."""
    if context.memory_base is not None:
        base = PromptBase(
            commit=context.memory_base,
            summarized_through_message_id=context.overview.summarized_through_message_id,
        )
        bases.move(user_id, base, read=read)


def _with_marker(message: ChatMessage, marker: CacheControl) -> ChatMessage:
    """`message` with a cache breakpoint on its last block."""
    *before, last = message.content
    return message.model_copy(
        update={"content": [*before, last.model_copy(update={"cache_control": marker})]}
    )


def model_request(
    context: CompiledContext, continuation: Sequence[ChatMessage], ttl: CacheTTL | None
) -> ModelRequest:
    """One model call of a turn: the turn's compiled context, the messages its earlier steps
    added (`continuation`), and the memory update and the turn note at the end of the newest
    user turn.

    With a `ttl`, cache breakpoints (at most 4, the API's limit) sit after the instructions
    (with the tools before them: stable until a deploy changes either), after the memory
    blocks and summary (until an approval or a summary changes them), after the turn's
    user message (for every later step of the turn), and after the conversation so far,
    just before the memory update and the turn note (what the next step and the next turn
    read). Those two, sent after the last breakpoint, are never written to the cache: the
    next turn sends them at the end of another message, so it would never be read.
    A context stored before it had sections is sent as one system block."""
    sections = context.system_sections or [context.system]
    system = [TextBlock(text=text) for text in sections]
    messages = [*context.messages, *continuation]
    if ttl is not None:
        marker = CacheControl(ttl=ttl)
        system = [
            block.model_copy(update={"cache_control": marker})
            if index in (0, len(system) - 1)
            else block
            for index, block in enumerate(system)
        ]
        if continuation and context.messages:
            turn_start = len(context.messages) - 1
            messages[turn_start] = _with_marker(messages[turn_start], marker)
        if messages:
            messages[-1] = _with_marker(messages[-1], marker)
    tail = [TextBlock(text=text) for text in (context.memory_update, context.turn_note) if text]
    if tail:
        if messages and messages[-1].role == "user":
            last = messages[-1]
            messages[-1] = last.model_copy(update={"content": [*last.content, *tail]})
        else:
            messages.append(ChatMessage(role="user", content=tail))
    return ModelRequest(system=system, messages=messages, tools=context.tools)
