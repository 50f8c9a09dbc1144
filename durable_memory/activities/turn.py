"""Activities of a conversation turn. Each is idempotent: a retry after a crash finds what the
first attempt stored (the context, the model's reply, the diffs, the commit) and reuses it.

Recall positions are fixed by the step, so a retried write lands on the same rows:
seq 0 is the user's message, step s writes the model's messages from s*1000 and the tool
results from s*1000+500, and a step-limit note goes to 999000.
"""

from temporalio import activity

from durable_memory.activities.errors import classified_errors
from durable_memory.bootstrap import MemoryStack
from durable_memory.faults import AFTER_MODEL_CALL, crash_point
from durable_memory.memory.agent.context import to_chat_messages
from durable_memory.memory.agent.turn_loop import (
    ChatModel,
    model_summarizer,
    reply_messages,
    reply_text,
    result_messages,
    run_tools,
    step_limit_note,
)
from durable_memory.memory.core.errors import DiffAlreadyDecided, DurableMemoryError
from durable_memory.memory.store.turns import TurnStore
from durable_memory.models.diffs import DiffStatus, PendingDiff
from durable_memory.models.recall import MessageRole, NewMessage
from durable_memory.models.turn import (
    DecisionOutcome,
    DiffDecision,
    FinishedTurn,
    FinishInput,
    ModelStepResult,
    PreparedTurn,
    ProposedDiff,
    RotationCandidate,
    StepInput,
    SupersededDiff,
    ToolStepResult,
    TurnInput,
)

STEP_SEQ = 1000
RESULT_OFFSET = 500
NOTE_SEQ = 999_000
DETAILS_LIMIT = 8000
"""Characters of diff previews shown as a workflow's current details in the UI."""


def _outcome(diff: PendingDiff, message: str = "") -> DecisionOutcome:
    return DecisionOutcome(
        diff_id=diff.id,
        status=diff.status,
        commit_sha=diff.commit_sha,
        message=message or (diff.decision_reason or ""),
        label=diff.label,
        decided_by=diff.decided_by,
        decided_at=diff.decided_at,
    )


_DECIDED_AS = {
    "approve": {DiffStatus.APPROVED, DiffStatus.CONFLICTED},
    "reject": {DiffStatus.REJECTED},
}
"""The statuses a decision leaves a diff in (an approval that stopped applying: conflicted)."""


def _is_own(diff: PendingDiff, decision: DiffDecision) -> bool:
    return diff.decided_by == decision.approver and diff.status in _DECIDED_AS[decision.decision]


def _lost_message(diff: PendingDiff, decision: DiffDecision) -> str:
    who = f" by {diff.decided_by}" if diff.decided_by else ""
    when = f" at {diff.decided_at.isoformat()}" if diff.decided_at else ""
    why = f" ({diff.decision_reason})" if diff.decision_reason else ""
    return (
        f"not applied: {decision.approver}'s {decision.decision} lost; diff {diff.id} was "
        f"already {diff.status.value}{who}{when}{why}"
    )


class TurnActivities:
    def __init__(self, stack: MemoryStack, model: ChatModel, turns: TurnStore) -> None:
        self.stack = stack
        self.model = model
        self.turns = turns

    @activity.defn(name="dmem.prepare_turn")
    def prepare_turn(self, turn: TurnInput) -> PreparedTurn:
        """Record the user's message and compile the context (summarising on overflow)."""
        with classified_errors():
            service = self.stack.service
            service.ensure_user(turn.user_id)
            # An approval recorded but not committed when a process died is finished first,
            # so no diff stays approved without its commit once the user is back.
            service.finish_approvals(turn.user_id)
            service.recall.append(
                turn.user_id,
                turn.turn_id,
                [NewMessage(role=MessageRole.USER, content=turn.message)],
                first_seq=0,
            )
            context = self.stack.compile(
                turn.user_id, summarizer=model_summarizer(self.model, service.profile.model)
            )
            context = self.turns.save_context(turn.user_id, turn.turn_id, context)
            return PreparedTurn(
                total_tokens=context.overview.total_tokens,
                share_used=context.overview.share_used,
            )

    @activity.defn(name="dmem.call_model")
    def call_model(self, step: StepInput) -> ModelStepResult:
        """One model call; its reply is stored, so a retry does not call the model again."""
        with classified_errors():
            reply = self.turns.reply(step.user_id, step.turn_id, step.step)
            if reply is None:
                context = self.turns.context(step.user_id, step.turn_id)
                earlier = self.stack.service.recall.turn(step.user_id, step.turn_id, STEP_SEQ)
                messages = context.messages + to_chat_messages(earlier, start_with_user=False)
                settings = self.stack.service.profile.model
                reply = self.model.create(settings, context.system, messages, context.tools)
                reply = self.turns.save_reply(step.user_id, step.turn_id, step.step, reply)
                crash_point(AFTER_MODEL_CALL)
            self.stack.service.recall.append(
                step.user_id, step.turn_id, reply_messages(reply), first_seq=step.step * STEP_SEQ
            )
            return ModelStepResult(
                text=reply_text(reply),
                tool_calls=len(reply.tool_uses),
                stop_reason=reply.stop_reason,
            )

    @activity.defn(name="dmem.run_tools")
    def run_tools(self, step: StepInput) -> ToolStepResult:
        """Execute the tool calls of a step's reply; edits become pending diffs."""
        with classified_errors():
            reply = self.turns.reply(step.user_id, step.turn_id, step.step)
            if reply is None:
                raise DurableMemoryError(f"turn {step.turn_id} step {step.step} has no reply")
            results, diff_ids = run_tools(self.stack.tools, step.user_id, step.turn_id, reply)
            self.stack.service.recall.append(
                step.user_id,
                step.turn_id,
                result_messages(results),
                first_seq=step.step * STEP_SEQ + RESULT_OFFSET,
            )
            superseded = [
                SupersededDiff(
                    diff_id=d.id,
                    turn_id=(
                        d.proposed_by.removeprefix("turn:")
                        if d.proposed_by.startswith("turn:")
                        else None
                    ),
                )
                for d in self.stack.service.diffs.superseded_by(step.user_id, diff_ids)
            ]
            return ToolStepResult(diff_ids=diff_ids, superseded=superseded)

    @activity.defn(name="dmem.finish_turn")
    def finish_turn(self, finish: FinishInput) -> FinishedTurn:
        """Note a step-limit stop in recall; describe the proposed diffs for the reply and UI."""
        with classified_errors():
            service = self.stack.service
            if finish.stopped_at_step_limit:
                note = NewMessage(
                    role=MessageRole.ASSISTANT, content=step_limit_note(finish.max_steps)
                )
                service.recall.append(finish.user_id, finish.turn_id, [note], first_seq=NOTE_SEQ)
            diffs = [service.diffs.get(d, finish.user_id) for d in finish.diff_ids]
            lines = ["### Proposed memory edits", ""]
            for diff in diffs:
                lines.append(f"- `{diff.id}` **{diff.summary}** ({diff.status.value})")
                if diff.status is DiffStatus.PENDING:
                    lines.append(f"  > {diff.reasoning}" if diff.reasoning else "")
                    lines.append("```diff\n" + service.preview(diff.id, finish.user_id) + "```")
            details = "\n".join(lines)
            if len(details) > DETAILS_LIMIT:
                details = details[:DETAILS_LIMIT] + "\n\n(truncated; `dmem diffs USER` shows all)"
            return FinishedTurn(
                diffs=[
                    ProposedDiff(id=d.id, label=d.label, summary=d.summary, status=d.status)
                    for d in diffs
                ],
                details_markdown=details,
            )

    @activity.defn(name="dmem.decide")
    def decide(self, decision: DiffDecision) -> DecisionOutcome:
        """Apply a human decision and answer the truth. Exactly one decision on a diff wins;
        a loser gets the winner's outcome with a message saying its own was not applied.
        Idempotent: a retry after the decision was recorded (and perhaps committed) finishes
        and returns it instead of failing."""
        with classified_errors():
            service = self.stack.service
            diff = service.diffs.get(decision.diff_id, decision.user_id)
            if diff.status is DiffStatus.PENDING:
                try:
                    return _outcome(self._apply(decision))
                except DiffAlreadyDecided as lost:
                    diff = lost.diff or service.diffs.get(decision.diff_id, decision.user_id)
            if diff.status is DiffStatus.APPROVED and diff.commit_sha is None:
                # Whoever approved it, the approval is final: finish its commit (idempotent).
                diff = service.commit_approved(diff.id, diff.user_id)
            if _is_own(diff, decision):  # this activity's earlier attempt decided it
                return _outcome(diff)
            return _outcome(diff, _lost_message(diff, decision))

    def _apply(self, decision: DiffDecision) -> PendingDiff:
        service = self.stack.service
        if decision.decision == "approve":
            return service.approve(
                decision.diff_id,
                decision.approver,
                user_id=decision.user_id,
                edited_markdown=decision.edited_markdown,
                note=decision.reason,
            )
        return service.reject(
            decision.diff_id,
            decision.approver,
            decision.reason or "rejected",
            user_id=decision.user_id,
        )

    @activity.defn(name="dmem.expire_diffs")
    def expire_diffs(self, diff_ids: list[str]) -> list[DecisionOutcome]:
        """Expire a turn's undecided diffs. The ids come from the turn workflow's own state
        (the diffs its activities proposed for its user), never from a caller."""
        with classified_errors():
            service = self.stack.service
            outcomes = []
            for diff_id in diff_ids:
                diff = service.diffs.get(diff_id, None)
                if diff.status is DiffStatus.PENDING:
                    try:
                        diff = service.expire(diff_id, diff.user_id)
                    except DiffAlreadyDecided as lost:  # decided in the meantime
                        diff = lost.diff or diff
                if diff.status is DiffStatus.APPROVED and diff.commit_sha is None:
                    diff = service.commit_approved(diff_id, diff.user_id)
                outcomes.append(_outcome(diff))
            return outcomes

    @activity.defn(name="dmem.needs_rotation")
    def needs_rotation(self, candidate: RotationCandidate) -> bool:
        with classified_errors():
            return self.stack.rotator.check(candidate.user_id, candidate.label).should_rotate
