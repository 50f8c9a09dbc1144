"""One conversation turn, step by step: `TurnSteps` owns every step, and nothing else does.

A turn is: `prepare` (record the user's message, compile and store the context), then up to
`max_steps` times `call_model` and, while the model asks for tools, `run_tools`; then `finish`
(note a step-limit stop, describe the proposed diffs). The Temporal workflow runs each step as
an activity (activities/turn.py only adapts them); the tests call them in the same order
without Temporal (tests/support/agent_helpers.py).

Every step is idempotent, so a retry after a crash lands where the first attempt did: the
context and each model reply are stored (store/turns.py) and reused, a tool call proposes the
diff it proposed before, and recall rows sit at positions fixed by the step (`TurnPositions`).
The context is deleted once the agent loop is over (the last model call, or `finish` after a
step-limit stop): a retry of the last call finds its stored reply and needs no context.

One module (over 300 lines) because the steps share these rules: the positions, the form a
reply and a tool call take in recall, the stored replies; apart, a rule would drift from the
steps that rely on it.
"""

import json
import logging
from collections.abc import Callable, Collection, Sequence
from datetime import UTC, datetime
from typing import Final, NamedTuple, Protocol

from durable_memory.faults import AFTER_MODEL_CALL, crash_point
from durable_memory.memory.agent.context import (
    ContextSources,
    Summarizer,
    compile_context,
    keep_base,
    model_request,
    to_chat_messages,
    warm_base,
)
from durable_memory.memory.agent.llm import ModelCallError
from durable_memory.memory.agent.tool_specs import (
    check_input_size,
    offered_in,
    proposes_diffs,
    tool_definitions,
)
from durable_memory.memory.agent.tools import MemoryTools, call_diff_id
from durable_memory.memory.archive.protocol import ArchiveStore
from durable_memory.memory.core.errors import (
    DurableMemoryError,
    UserBeingForgotten,
    UserForgotten,
)
from durable_memory.memory.core.limits import LimitExceeded, cut_text
from durable_memory.memory.store.erasure import erase_user_rows, erasures_read
from durable_memory.memory.store.redaction.gate import RedactionGate
from durable_memory.memory.store.turns import PromptBaseStore, TurnStore
from durable_memory.memory.store.users import ErasuresRead
from durable_memory.models.blocks import AgentProfile, ModelSettings
from durable_memory.models.context import CompiledContext, PromptBase
from durable_memory.models.diffs import DiffStatus
from durable_memory.models.limits import MAX_REPLY_TEXT_CHARS, MAX_TOOL_CALLS_PER_REPLY
from durable_memory.models.llm import ChatMessage, ModelReply, TextBlock, ToolResultBlock
from durable_memory.models.recall import MessageRole, NewMessage, RecallMessage
from durable_memory.models.turn import (
    DecisionOutcome,
    DiffPreview,
    FinishedTurn,
    FinishInput,
    ModelStepResult,
    PreparedTurn,
    ProposedDiff,
    StepInput,
    SupersededDiff,
    ToolStepResult,
    TurnInput,
)

SUMMARY_SYSTEM = (
    "You summarise conversations for an assistant's memory. Write a compact summary of the "
    "conversation below (and of the earlier summary, if given): who said what that matters, "
    "decisions, open questions, facts about the user. Plain prose, no preamble. Each line of "
    'the conversation is `role: "content"`, the content a JSON string written by that role.'
)
MAX_PREVIEW_CHARS = 6000
"""Of one diff's unified diff in a turn's state (its `diff` query, the UI's details):
`dmem diffs` shows a longer one whole."""
MAX_PREVIEW_REASONING_CHARS = 2000

log = logging.getLogger(__name__)


def _bounded_preview(unified_diff: str) -> str:
    """The unified diff, cut after the last whole line that fits in MAX_PREVIEW_CHARS."""
    if len(unified_diff) <= MAX_PREVIEW_CHARS:
        return unified_diff
    kept = unified_diff[:MAX_PREVIEW_CHARS].rsplit("\n", 1)[0]
    return f"{kept}\n... ({len(unified_diff) - len(kept)} more characters: dmem diffs USER)\n"


"""Characters of diff previews shown as a workflow's current details in the UI."""


def check_tool_calls(reply: ModelReply, used: Collection[str] = ()) -> None:
    """Refuse a reply with more tool calls than its place in recall holds, or with a call
    whose id is empty or repeats another's, in the reply or among `used` (the turn's earlier
    calls): a misbehaving model server. The turn fails at this step, nothing of the reply
    stored, rather than results overwriting the next step's messages, or a call's edit being
    taken for an earlier call's diff, or its diff going unfound (a diff's id derives from its
    call's id, and the step reports the diffs found under those ids)."""
    if len(reply.tool_uses) > MAX_TOOL_CALLS_PER_REPLY:
        raise LimitExceeded(
            "the model's tool calls in one reply",
            len(reply.tool_uses),
            MAX_TOOL_CALLS_PER_REPLY,
            "ask for fewer tools at a time",
            unit="calls",
        )
    ids = [use.id for use in reply.tool_uses]
    if not all(ids) or len(set(ids)) != len(ids) or not set(ids).isdisjoint(used):
        raise ModelCallError(
            "the model's reply has a tool call whose id is empty or repeats another's",
            retryable=False,
        )


class TurnPositions:
    """Where a turn's messages sit in recall: their `seq` within the turn. Positions are fixed
    by the step, not counted from what is stored, so a retried step writes the same rows again
    and recall keeps the first ones. Stored turns carry these positions: never renumber."""

    USER: Final = 0
    """The user's message."""
    STEP_STRIDE: Final = 1000
    """Step s's model reply (its text, then its tool calls) is stored from s * STEP_STRIDE."""
    RESULT_OFFSET: Final = 500
    """... and the results of its tool calls from s * STEP_STRIDE + RESULT_OFFSET (a reply's
    messages stay below it: a reply makes at most MAX_TOOL_CALLS_PER_REPLY tool calls)."""
    STEP_LIMIT_NOTE: Final = 999_000
    """The note saying the turn stopped at its step limit (above every step: at most 50)."""

    FIRST_STEP: Final = STEP_STRIDE
    """Where the steps' messages start: what a model call adds to the compiled context."""

    @staticmethod
    def reply_seq(step: int) -> int:
        return step * TurnPositions.STEP_STRIDE

    @staticmethod
    def results_seq(step: int) -> int:
        return step * TurnPositions.STEP_STRIDE + TurnPositions.RESULT_OFFSET


class ChatModel(Protocol):
    def create(
        self,
        settings: ModelSettings,
        system: str | list[TextBlock],
        messages: list[ChatMessage],
        tools: list[dict[str, object]],
    ) -> ModelReply: ...


def _step_result(reply: ModelReply) -> ModelStepResult:
    return ModelStepResult(
        text=reply_text(reply),
        tool_calls=len(reply.tool_uses),
        stop_reason=reply.stop_reason,
        usage=reply.usage,
    )


def step_limit_note(max_steps: int) -> str:
    return (
        f"[stopped after {max_steps} model steps without finishing; the turn ends here and "
        "nothing more was done]"
    )


def turn_reply(last_text: str, stopped_at_step_limit: bool, max_steps: int) -> str:
    """What the user is told: the last reply's text, and the step-limit note if the turn
    stopped there."""
    if not stopped_at_step_limit:
        return last_text
    note = step_limit_note(max_steps)
    return f"{last_text}\n\n{note}" if last_text else note


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


def turn_context(
    sources: ContextSources,
    archive: ArchiveStore | None,
    user_id: str,
    summarizer: Summarizer | None = None,
    base: PromptBase | None = None,
    profile: AgentProfile | None = None,
    summary: tuple[int, str | None] | None = None,
) -> CompiledContext:
    """The context a turn starts from: memory, recall and the tools the user's profile offers
    (also what `dmem context` shows, with the blocks at HEAD). With a summarizer, an
    overflowing context is summarised first; with a prompt base, blocks changed since it come
    as the memory update (compile_context). `profile` and `summary`: the user's, if the
    caller has them."""
    profile = profile or sources.blocks.profile(user_id)
    return compile_context(
        sources,
        user_id,
        tool_definitions(profile.tools),
        archival_count=archive.count(user_id) if archive is not None else 0,
        summarizer=summarizer,
        base=base,
        profile=profile,
        summary=summary,
    )


class ToolsRun(NamedTuple):
    """What `TurnSteps.run_tools_in_context` returns."""

    result: ToolStepResult
    context: CompiledContext | None
    """The turn's stored context (None once the turn's agent loop is over)."""
    erasures_seen: int
    """The `since` of the next step's erasure checks."""


class TurnSteps:
    """Every step of a turn, each idempotent (see the module doc)."""

    def __init__(
        self,
        sources: ContextSources,
        archive: ArchiveStore | None,
        tools: MemoryTools,
        model: ChatModel,
        turns: TurnStore,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.sources = sources
        self.archive = archive
        self.tools = tools
        self.model = model
        self.turns = turns
        # The prompt base is turn bookkeeping: it lives in the turns' database.
        self.bases = PromptBaseStore(turns.engine)
        self.gate = RedactionGate(turns.engine)
        self.clock = clock

    def prepare(self, turn: TurnInput) -> PreparedTurn:
        """Record the user's message and compile the context (summarising on overflow)."""
        return self.prepare_context(turn)[0]

    def prepare_context(self, turn: TurnInput) -> tuple[PreparedTurn, CompiledContext]:
        """`prepare`, and the context it stored (the first compiled for the turn): for the
        first model call in the same activity, which need not read it back.

        Behind the redaction gate: a turn is admitted before a redaction of its user or after
        it, never across it (memory/store/redaction/gate.py), so the gate is asked before
        anything is compiled and again once the context is stored. Each time it is read with
        the erasure ledger in one statement (`Blocks.admission`; the first also says whether
        the user is listed): where the two checks meet, one round trip, not two or three."""
        sources = self.sources
        read = sources.blocks.admission(turn.user_id)
        self.gate.admit_turn_as_read(turn.user_id, turn.turn_id, read.redaction)
        admission = sources.blocks.admit(
            turn.user_id, turn.profile, fresh=bool(turn.fresh_user), read=read
        )
        profile, seen = admission.profile, admission.erasures_seen
        # An approval recorded but not committed when a process died is finished first,
        # so no diff stays approved without its commit once the user is back. The admission
        # read says whether there is one (nearly never): no read of them otherwise.
        if read.unfinished_approvals:
            sources.review.finish_approvals(turn.user_id)
        said = sources.recall.recording(
            turn.user_id,
            turn.turn_id,
            [NewMessage(role=MessageRole.USER, content=turn.message)],
            first_seq=TurnPositions.USER,
        )
        base_read = self.bases.with_last_reply(turn.user_id, after=said)  # one round trip
        context = turn_context(
            sources,
            self.archive,
            turn.user_id,
            summarizer=self._checked(
                model_summarizer(self.model, profile.model), turn.user_id, seen
            ),
            base=warm_base(base_read, profile.model, self.clock()),
            profile=profile,
            summary=base_read.summary,
        )
        context = self.turns.save_context(turn.user_id, turn.turn_id, context)
        # After the context is stored: a retry of a step that died in between finds the
        # stored context and moves the base to what it was compiled from.
        keep_base(self.bases, turn.user_id, context, base_read)
        self._refuse_if_forgotten_after_writing(turn.user_id, seen, admitting=turn.turn_id)
        prepared = PreparedTurn(
            total_tokens=context.overview.total_tokens,
            share_used=context.overview.share_used,
            profile=profile.name,
            erasures_seen=seen,
        )
        return prepared, context

    def _checked(self, summarize: Summarizer, user_id: str, since: int) -> Summarizer:
        """`summarize`, then the erasure check: its summary is stored right after, and the
        model call before it may take a minute, a forget's whole run."""

        def checked(messages: Sequence[RecallMessage], previous: str | None) -> str:
            text = summarize(messages, previous)
            self._refuse_if_forgotten_after_writing(user_id, since)
            return text

        return checked

    def call_model(
        self, step: StepInput, context: CompiledContext | None = None, *, retried: bool = True
    ) -> ModelStepResult:
        """One model call; its reply is stored, so a retry does not call the model again.
        Nothing is stored for a user forgotten meanwhile (the call may take a minute).
        `context`: the turn's stored context, if the caller holds it (`prepare_context` or
        `run_tools_in_context` in the same activity, each of which refused a forgotten user
        moments before: not asked again before the call), else it is read from the store.
        `retried=False`: the caller's first attempt (an activity's attempt 1), which has no
        stored reply to find, so none is looked up before the call. Should one be stored all
        the same (the workflow or the activity was reset, a turn id was used again), the
        reply stored first is still the step's: `save_reply` keeps it if the call succeeds
        (one model call more, never a second reply), and it is looked up if the call fails
        (its request, built after the step, may be refused where the first was not)."""
        reply = self.turns.reply(step.user_id, step.turn_id, step.step) if retried else None
        if reply is None:
            seen = step.erasures_seen
            if context is None:
                seen = self._refuse_if_forgotten_after_writing(step.user_id, seen)
            try:
                asked = self._ask_model(step, context)
            except Exception:
                reply = None if retried else self.turns.reply(step.user_id, step.turn_id, step.step)
                if reply is None:
                    raise
            else:
                self._refuse_if_forgotten_after_writing(step.user_id, seen)
                # The reply, its messages in recall and (the turn's last call) the context
                # dropped, in one write; the long way below if a reply was stored before.
                recorded = self.sources.recall.recording(
                    step.user_id,
                    step.turn_id,
                    reply_messages(asked),
                    first_seq=TurnPositions.reply_seq(step.step),
                )
                last = not asked.tool_uses
                if self.turns.save_new_reply(
                    step.user_id, step.turn_id, step.step, asked, [recorded], drop_context=last
                ):
                    crash_point(AFTER_MODEL_CALL)
                    return _step_result(asked)
                reply = self.turns.save_reply(step.user_id, step.turn_id, step.step, asked)
                crash_point(AFTER_MODEL_CALL)
        self.sources.recall.record(
            step.user_id,
            step.turn_id,
            reply_messages(reply),
            first_seq=TurnPositions.reply_seq(step.step),
        )
        if not reply.tool_uses:  # the turn's last model call: its context is done with
            self.turns.drop_context(step.user_id, step.turn_id)
        return _step_result(reply)

    def _ask_model(self, step: StepInput, context: CompiledContext | None) -> ModelReply:
        """The model's reply to the step's request: the turn's context (read from the store
        if not given), then what the turn's earlier steps said and their tools answered."""
        if context is None:
            context = self.turns.context(step.user_id, step.turn_id)
        # Step 1's model call follows no step of its turn: no reply stored (so none
        # recorded, which follows the store), no tool results.
        earlier = (
            []
            if step.step == 1
            else self.sources.recall.turn(step.user_id, step.turn_id, TurnPositions.FIRST_STEP)
        )
        continuation = to_chat_messages(earlier, start_with_user=False)
        settings = context.model or self.sources.blocks.profile(step.user_id).model
        ttl = None if settings.cache_ttl == "off" else settings.cache_ttl
        request = model_request(context, continuation, ttl)
        reply = self.model.create(settings, request.system, request.messages, request.tools)
        check_tool_calls(reply, {m.tool_call_id for m in earlier if m.tool_call_id})
        return reply

    def _refuse_if_forgotten_after_writing(
        self,
        user_id: str,
        since: int | None,
        *,
        admitting: str | None = None,
        read: ErasuresRead | None = None,
    ) -> int:
        """The erasure check of every step once the turn has written for the user (its
        message, context, a summary, replies, tool results, proposals, archived passages):
        all but the first, at the start of prepare, before anything is written. Write, then
        check: a forget that began after this check empties what was written (it empties
        the stores after its record opened); one that began before is seen here, and what
        was written is deleted now, since the forget's own emptying may have passed while
        the step ran (a summary or a model call: up to a minute; a retry after an outage).
        The writes right after a check (a reply stored) are microseconds behind it. What
        cannot be deleted now (a store down) is logged: the refusal is still the answer,
        and `dmem forget` run again deletes the rest.

        `since`: what the turn's first check returned (None: this step's own first check
        sets it, for a turn recorded before turns carried it). A forget begun after it
        refuses the turn even once the user was started afresh; then nothing is deleted,
        since what the user has now is their new memory: the checks before each write that
        follows a long wait (a model call, the summary, an archive insert's embedding, the
        tools) kept the turn out of it. Returns what the step's later checks pass as
        `since`.

        `admitting`: the turn whose context was just stored, admitted again at the redaction
        gate once the erasure check passed, on the same read (`prepare_context`). `read`: the
        user's erasure records, read by the caller just now with a read of its own, on which
        the check decides (`run_tools_in_context`)."""
        blocks = self.sources.blocks
        admission = blocks.admission(user_id) if admitting is not None else None
        try:
            seen = blocks.refuse_if_forgotten(
                user_id, since, read=read if admission is None else admission
            )
        except UserForgotten as closed:
            if closed.started_afresh:
                raise
            self._delete_what_the_turn_wrote(user_id, keep_listed=False)
            raise
        except UserBeingForgotten:
            self._delete_what_the_turn_wrote(user_id, keep_listed=True)
            raise
        if admitting is not None and admission is not None:
            self.gate.admit_turn_as_read(user_id, admitting, admission.redaction)
        return seen

    def _delete_what_the_turn_wrote(self, user_id: str, *, keep_listed: bool) -> None:
        """Delete the user's passages, then their rows (the forget's own deletions, made
        again), logging what fails: the refusal that follows is the step's answer, and
        nothing retries a forgotten turn. Not once the user was started afresh after the
        refusal was decided: each deletion asks the ledger again, the rows' in their own
        transaction (a fresh start waits for it or comes first)."""
        engine = self.turns.engine
        self.turns.parsed_contexts.forget_user(user_id)
        cleanups: list[Callable[[], object]] = [
            lambda: erase_user_rows(
                engine, user_id, keep_listed=keep_listed, only_while_closed=True
            )
        ]
        archive = self.archive
        if archive is not None:  # a passage the model's tool call inserted
            cleanups.insert(0, lambda: self._forget_passages_while_closed(archive, user_id))
        for cleanup in cleanups:
            try:
                cleanup()
            except Exception:
                log.warning(
                    "user '%s': a step could not delete what its turn wrote before the "
                    "forget; `dmem forget` run again deletes it",
                    user_id,
                    exc_info=True,
                )

    def _forget_passages_while_closed(self, archive: ArchiveStore, user_id: str) -> None:
        try:
            self.sources.blocks.refuse_if_forgotten(user_id)
        except (UserBeingForgotten, UserForgotten):
            archive.forget_user(user_id)  # still closed: theirs are the forgotten memory's
            return
        log.info("user '%s' was started afresh: their new memory's passages stay", user_id)

    def run_tools(self, step: StepInput) -> ToolStepResult:
        """Execute the tool calls of a step's reply; edits become pending diffs. The answer is
        what the store holds for the step's calls (`step_diffs`), not what this run's tools
        said: run again after its edits were applied (a standing approval commits one at
        once, a person may approve one before the step is retried), a tool's answer may
        differ from its first (the command now changes nothing), yet its diff is the
        step's."""
        return self.run_tools_in_context(step).result

    def run_tools_in_context(self, step: StepInput) -> ToolsRun:
        """`run_tools`, and the turn's stored context it read (for the next model call in the
        same activity, which need not read it again; None once the turn's agent loop is
        over), and what the next step's erasure checks pass as `since`. A call is answered
        only by a tool that context offered the model: a profile changed meanwhile (its
        tools, or the deploy's) applies from the next turn, as its model settings do, and no
        step reads the profile again. A context already dropped (this step run again after
        the turn's last model call) leaves the profile's tools."""
        # The step's reply and context read with its erasure check's records: one round trip.
        stored, context, records = self.turns.reply_and_context(
            step.user_id, step.turn_id, step.step, erasures_read(step.user_id)
        )
        seen = self._refuse_if_forgotten_after_writing(
            step.user_id, step.erasures_seen, read=ErasuresRead(records)
        )
        reply = self._stored_reply(step, stored)
        offered = None if context is None else offered_in(context.tools)
        results = []

        def check() -> int:
            return self._refuse_if_forgotten_after_writing(step.user_id, seen)

        for n, use in enumerate(reply.tool_uses):
            if n:  # before the first, the step's own check was made moments ago
                check()
            outcome = self.tools.execute(
                step.user_id,
                step.turn_id,
                use.name,
                use.input,
                call_id=use.id,
                offered=offered,
                before_write=check,  # an archive insert, between its embedding and its write
            )
            results.append(
                ToolResultBlock(
                    tool_use_id=use.id, content=outcome.content, is_error=outcome.is_error
                )
            )
        if reply.tool_uses:  # after the tools' writes, before their results are recorded
            check()
        self.sources.recall.record(
            step.user_id,
            step.turn_id,
            result_messages(results),
            first_seq=TurnPositions.results_seq(step.step),
        )
        return ToolsRun(self._diffs_of(step, reply), context, seen)

    def step_diffs(self, step: StepInput) -> ToolStepResult:
        """What a step's tool calls proposed, as the store holds it (each call's diff found by
        the id derived from the call) and the older diffs those superseded, running no tool:
        read only. For a turn whose step failed after its tools may have proposed."""
        return self._diffs_of(step, self._reply_of(step))

    def _reply_of(self, step: StepInput) -> ModelReply:
        return self._stored_reply(step, self.turns.reply(step.user_id, step.turn_id, step.step))

    @staticmethod
    def _stored_reply(step: StepInput, reply: ModelReply | None) -> ModelReply:
        if reply is None:
            raise DurableMemoryError(f"turn {step.turn_id} step {step.step} has no reply")
        return reply

    def _diffs_of(self, step: StepInput, reply: ModelReply) -> ToolStepResult:
        review = self.sources.review
        # Only a call of a tool that proposes can have a diff under its derived id (a call's
        # id is unique in its turn: check_tool_calls); a step of searches asks the store
        # nothing.
        derived = [
            call_diff_id(step.user_id, step.turn_id, use.id)
            for use in reply.tool_uses
            if proposes_diffs(use.name)
        ]
        diff_ids = review.existing(step.user_id, derived)
        superseded = [
            SupersededDiff(diff_id=d.id, turn_id=d.proposer.turn_id)
            for d in review.superseded_by(step.user_id, diff_ids)
        ]
        return ToolStepResult(diff_ids=diff_ids, superseded=superseded)

    def finish(self, finish: FinishInput) -> FinishedTurn:
        """Note a step-limit stop in recall; describe the proposed diffs for the reply and UI."""
        sources = self.sources
        self._refuse_if_forgotten_after_writing(finish.user_id, finish.erasures_seen)
        if finish.stopped_at_step_limit:
            note = NewMessage(role=MessageRole.ASSISTANT, content=step_limit_note(finish.max_steps))
            sources.recall.record(
                finish.user_id, finish.turn_id, [note], first_seq=TurnPositions.STEP_LIMIT_NOTE
            )
            self.turns.drop_context(finish.user_id, finish.turn_id)  # no model call follows
        diffs = [sources.review.get(d, finish.user_id) for d in finish.diff_ids]
        previews = [
            DiffPreview(
                diff_id=d.id,
                reasoning=cut_text(d.reasoning, MAX_PREVIEW_REASONING_CHARS),
                unified_diff=_bounded_preview(sources.review.preview(d.id, finish.user_id)),
            )
            for d in diffs
            if d.status is DiffStatus.PENDING
        ]
        return FinishedTurn(
            diffs=[
                ProposedDiff(
                    id=d.id,
                    label=d.label,
                    summary=d.summary,
                    status=d.status,
                    outcome=None if d.status is DiffStatus.PENDING else DecisionOutcome.of_diff(d),
                )
                for d in diffs
            ],
            previews=previews,
        )
