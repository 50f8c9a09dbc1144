"""Activities of a conversation turn. The turn's steps are `TurnSteps`'s (memory/agent/steps.py)
and each activity here only runs one of them with its errors classified; the decisions on
diffs, their expiry and the rotation check follow. Each is idempotent: a retry after a crash
finds what the first attempt stored and reuses it.
"""

from temporalio import activity

from durable_memory.activities.errors import classified_errors
from durable_memory.bootstrap import MemoryStack
from durable_memory.faults import MID_START, MID_TOOLS_THEN_MODEL, crash_point
from durable_memory.memory.agent.steps import TurnSteps
from durable_memory.memory.core.errors import DiffAlreadyDecided
from durable_memory.memory.store.redaction.gate import RedactionGate
from durable_memory.models.diffs import DiffStatus, PendingDiff
from durable_memory.models.turn import (
    DecisionOutcome,
    DiffDecision,
    FinishedTurn,
    FinishInput,
    ModelStepResult,
    PreparedTurn,
    RotationCandidate,
    StartedTurn,
    StepInput,
    ToolStepResult,
    ToolsThenModel,
    TurnInput,
    WorkerTurnSettings,
)


def _retried() -> bool:
    """Whether this activity ran before (a retry after a crash, a timeout or a failure), so a
    step it began may have stored its model reply: only then is the stored reply looked up
    before the model call (`TurnSteps.call_model`)."""
    return activity.info().attempt > 1


def _outcome(diff: PendingDiff, message: str = "") -> DecisionOutcome:
    return DecisionOutcome.of_diff(diff, message)


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
    def __init__(self, stack: MemoryStack, steps: TurnSteps, settings: WorkerTurnSettings) -> None:
        self.stack = stack
        self.steps = steps
        self.settings = settings
        self.redaction_gate = RedactionGate(stack.engine)

    @activity.defn(name="dmem.turn_settings")
    def turn_settings(self) -> WorkerTurnSettings:
        """The deployment's settings for a turn (run as a local activity: its result is
        recorded in the turn's history, so replay and every later step see the same)."""
        return self.settings

    @activity.defn(name="dmem.prepare_turn")
    def prepare_turn(self, turn: TurnInput) -> PreparedTurn:
        with classified_errors(), self.stack.pinned():
            return self.steps.prepare_context(turn)[0]

    @activity.defn(name="dmem.start_turn")
    def start_turn(self, turn: TurnInput) -> StartedTurn:
        """A turn's first activity: `prepare_turn` then the first model call, and the
        deployment's settings for the turn. One activity, so a turn's first workflow task
        runs no local activity at all (each cost ~2-4 ms of SDK round trips, more than
        prepare's own work); each half is idempotent as before, so a retry after a crash
        anywhere in it finds the stored context and the stored reply (docs/temporal.md,
        "The first step")."""
        with classified_errors(), self.stack.pinned():
            prepared, context = self.steps.prepare_context(turn)
            crash_point(MID_START)
            first = self.steps.call_model(
                StepInput(
                    user_id=turn.user_id,
                    turn_id=turn.turn_id,
                    step=1,
                    erasures_seen=prepared.erasures_seen,
                ),
                context,
                retried=_retried(),
            )
            return StartedTurn(settings=self.settings, prepared=prepared, first=first)

    @activity.defn(name="dmem.call_model")
    def call_model(self, step: StepInput) -> ModelStepResult:
        with classified_errors(), self.stack.pinned():
            return self.steps.call_model(step, retried=_retried())

    @activity.defn(name="dmem.run_tools")
    def run_tools(self, step: StepInput) -> ToolStepResult:
        with classified_errors(), self.stack.pinned():
            return self.steps.run_tools(step)

    @activity.defn(name="dmem.step_diffs")
    def step_diffs(self, step: StepInput) -> ToolStepResult:
        """What a step's tool calls proposed, read from the store, running no tool: for a turn
        whose `tools_then_model` failed after its tools may have proposed."""
        with classified_errors(), self.stack.pinned():
            return self.steps.step_diffs(step)

    @activity.defn(name="dmem.tools_then_model")
    def tools_then_model(self, step: StepInput) -> ToolsThenModel:
        """`run_tools` of `step`, then `call_model` of the step after it: one activity where a
        tool-using turn ran a local activity and a model call (patch `tools-in-model-step`;
        the local activity's own SDK round trips cost more than the tools on local data).
        Each half is idempotent as before: a retry after a crash anywhere in it finds the
        diffs and results the tools stored and the reply the model gave (docs/temporal.md,
        "Tools and the next model call")."""
        with classified_errors(), self.stack.pinned():
            tools = self.steps.run_tools_in_context(step)
            crash_point(MID_TOOLS_THEN_MODEL)
            following = step.model_copy(
                update={"step": step.step + 1, "erasures_seen": tools.erasures_seen}
            )
            return ToolsThenModel(
                tools=tools.result,
                next=self.steps.call_model(following, tools.context, retried=_retried()),
            )

    @activity.defn(name="dmem.finish_turn")
    def finish_turn(self, finish: FinishInput) -> FinishedTurn:
        with classified_errors(), self.stack.pinned():
            return self.steps.finish(finish)

    @activity.defn(name="dmem.decide")
    def decide(self, decision: DiffDecision) -> DecisionOutcome:
        """Apply a human decision and answer the truth. Exactly one decision on a diff wins;
        a loser gets the winner's outcome with a message saying its own was not applied.
        Idempotent: a retry after the decision was recorded (and perhaps committed) finishes
        and returns it instead of failing."""
        with classified_errors(), self.stack.pinned():
            review = self.stack.review
            diff = review.get(decision.diff_id, decision.user_id)
            self.redaction_gate.refuse_if_open(diff.user_id)  # waits, as a new turn does
            if diff.status is DiffStatus.PENDING:
                try:
                    return _outcome(self._apply(decision))
                except DiffAlreadyDecided as lost:
                    diff = lost.diff or review.get(decision.diff_id, decision.user_id)
            if diff.status is DiffStatus.APPROVED and diff.commit_sha is None:
                # Whoever approved it, the approval is final: finish its commit (idempotent).
                diff = review.commit_approved(diff.id, diff.user_id)
            if _is_own(diff, decision):  # this activity's earlier attempt decided it
                return _outcome(diff)
            return _outcome(diff, _lost_message(diff, decision))

    def _apply(self, decision: DiffDecision) -> PendingDiff:
        review = self.stack.review
        if decision.decision == "approve":
            return review.approve(
                decision.diff_id,
                decision.approver,
                user_id=decision.user_id,
                edited_markdown=decision.edited_markdown,
                note=decision.reason,
            )
        return review.reject(
            decision.diff_id,
            decision.approver,
            decision.reason or "rejected",
            user_id=decision.user_id,
        )

    @activity.defn(name="dmem.expire_diffs")
    def expire_diffs(self, diff_ids: list[str]) -> list[DecisionOutcome]:
        """Expire a turn's undecided diffs. The ids come from the turn workflow's own state
        (the diffs its activities proposed for its user), never from a caller."""
        with classified_errors(), self.stack.pinned():
            review = self.stack.review
            outcomes = []
            for diff_id in diff_ids:
                diff = review.get(diff_id, None)
                if diff.status is DiffStatus.PENDING:
                    try:
                        diff = review.expire(diff_id, diff.user_id)
                    except DiffAlreadyDecided as lost:  # decided in the meantime
                        diff = lost.diff or diff
                if diff.status is DiffStatus.APPROVED and diff.commit_sha is None:
                    diff = review.commit_approved(diff_id, diff.user_id)
                outcomes.append(_outcome(diff))
            return outcomes

    @activity.defn(name="dmem.needs_rotation")
    def needs_rotation(self, candidate: RotationCandidate) -> bool:
        with classified_errors(), self.stack.pinned():
            return self.stack.rotator.check(candidate.user_id, candidate.label).should_rotate
