"""One conversation turn: compile, call the model, run its tools, reply; then wait for a
human decision on each proposed diff, commit the approved ones, and trigger rotation.

Deterministic orchestration only: every side effect is an activity. Decisions arrive as
signals (`approve`, `reject`: fire-and-forget, accepted while workers are down) or as the
`decide` Update, whose validator refuses unknown, foreign or already-decided diffs before
anything enters history. The reply is returned through the `reply` Update, so a caller that
starts the turn with update-with-start gets it in the same call.
"""

import contextlib
from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from durable_memory.activities.turn import TurnActivities
    from durable_memory.memory.agent import step_limit_note
    from durable_memory.memory.errors import DurableMemoryError
    from durable_memory.memory.git_store import validate_author_name
    from durable_memory.models.diffs import DiffStatus
    from durable_memory.models.turn import (
        DecisionOutcome,
        DiffDecision,
        FinishInput,
        ProposedDiff,
        RotationCandidate,
        RotationInput,
        StepInput,
        TurnInput,
        TurnOutcome,
        TurnReply,
        TurnStatus,
        turn_workflow_id,
    )
    from durable_memory.workflows.common import PENDING_DIFFS, TURN_STATUS, activity_options
    from durable_memory.workflows.rotation import start_rotation


SIGNAL_TICKET = 0
ANSWER_BEFORE_ROTATION_CHECK = "answer-decision-before-rotation-check"
"""Patch: a decision's Update is answered once its commit exists; the rotation check after
it no longer delays the approver. Histories recorded before it replay the old order."""


@workflow.defn
class TurnWorkflow:
    def __init__(self) -> None:
        self._turn: TurnInput | None = None
        self._reply: TurnReply | None = None
        self._status = TurnStatus.REPLYING
        self._open: dict[str, ProposedDiff] = {}
        self._outcomes: dict[str, DecisionOutcome] = {}
        self._queue: list[tuple[int, DiffDecision]] = []
        self._answers: dict[int, DecisionOutcome | str] = {}
        self._tickets = 0

    # -- the turn --------------------------------------------------------------------------

    @workflow.run
    async def run(self, turn: TurnInput) -> TurnOutcome:
        self._turn = turn
        self._set_status(TurnStatus.REPLYING)
        memory = activity_options(turn.activities.memory)
        await workflow.execute_activity_method(
            TurnActivities.prepare_turn,
            turn,
            summary="record the message, compile context",
            **memory,
        )
        diff_ids, text, stopped = await self._steps(turn)
        finished = await workflow.execute_activity_method(
            TurnActivities.finish_turn,
            FinishInput(
                user_id=turn.user_id,
                turn_id=turn.turn_id,
                diff_ids=diff_ids,
                stopped_at_step_limit=stopped,
                max_steps=turn.max_steps,
            ),
            summary="describe the proposed diffs",
            **memory,
        )
        note = step_limit_note(turn.max_steps)
        reply = (f"{text}\n\n{note}" if text else note) if stopped else text
        self._reply = TurnReply(
            user_id=turn.user_id,
            turn_id=turn.turn_id,
            workflow_id=workflow.info().workflow_id,
            reply=reply,
            diffs=finished.diffs,
            stopped_at_step_limit=stopped,
        )
        for diff in finished.diffs:
            if diff.status is DiffStatus.PENDING:
                self._open.setdefault(diff.id, diff)
            else:
                self._outcomes[diff.id] = DecisionOutcome(
                    diff_id=diff.id, status=diff.status, label=diff.label
                )
        if self._open:
            workflow.set_current_details(finished.details_markdown)
            await self._await_decisions(turn)
        final = (
            TurnStatus.EXPIRED
            if any(o.status is DiffStatus.EXPIRED for o in self._outcomes.values())
            else TurnStatus.DONE
        )
        self._set_status(final)
        await workflow.wait_condition(workflow.all_handlers_finished)
        return TurnOutcome(
            turn_id=turn.turn_id,
            reply=reply,
            decisions=list(self._outcomes.values()),
            status=final,
        )

    async def _steps(self, turn: TurnInput) -> tuple[list[str], str, bool]:
        """The agent loop: (diff ids proposed, last reply text, stopped at the step limit)."""
        diff_ids: list[str] = []
        text = ""
        for step in range(1, turn.max_steps + 1):
            where = StepInput(user_id=turn.user_id, turn_id=turn.turn_id, step=step)
            result = await workflow.execute_activity_method(
                TurnActivities.call_model,
                where,
                summary=f"model call {step}",
                **activity_options(turn.activities.model_call),
            )
            text = result.text
            if result.tool_calls == 0:
                return diff_ids, text, False
            tools = await workflow.execute_activity_method(
                TurnActivities.run_tools,
                where,
                summary=f"run {result.tool_calls} tool call(s) of step {step}",
                **activity_options(turn.activities.memory),
            )
            diff_ids.extend(tools.diff_ids)
            for old in tools.superseded:
                if old.turn_id and old.turn_id != turn.turn_id:
                    await self._tell_superseded(turn.user_id, old.turn_id, old.diff_id)
        return diff_ids, text, True

    async def _tell_superseded(self, user_id: str, turn_id: str, diff_id: str) -> None:
        """End the older turn's wait for a diff this turn superseded."""
        handle = workflow.get_external_workflow_handle(turn_workflow_id(user_id, turn_id))
        try:
            await handle.signal(TurnWorkflow.superseded, diff_id)
        except ApplicationError:
            workflow.logger.info("turn %s has already ended; nothing to tell", turn_id)

    async def _await_decisions(self, turn: TurnInput) -> None:
        deadline = workflow.now() + turn.approval_ttl
        self._set_status(TurnStatus.AWAITING_APPROVAL)
        while self._open:
            remaining = (deadline - workflow.now()).total_seconds()
            if remaining > 0:
                with contextlib.suppress(TimeoutError):
                    await workflow.wait_condition(
                        lambda: bool(self._queue) or not self._open,
                        timeout=timedelta(seconds=remaining),
                    )
            # Decisions that arrived in time are applied even if applying them runs past the
            # deadline; leaving one queued would keep its Update (and this workflow) waiting.
            while self._queue:
                ticket, decision = self._queue.pop(0)
                await self._apply(turn, ticket, decision)
            if workflow.now() >= deadline:
                break
        if self._open:
            outcomes = await workflow.execute_activity_method(
                TurnActivities.expire_diffs,
                list(self._open),
                summary=f"expire {len(self._open)} undecided diff(s)",
                **activity_options(turn.activities.memory),
            )
            for outcome in outcomes:
                self._resolve(outcome)

    async def _apply(self, turn: TurnInput, ticket: int, decision: DiffDecision) -> None:
        if decision.diff_id not in self._open:
            outcome = self._outcomes.get(decision.diff_id)
            self._answer(
                ticket,
                outcome or f"diff {decision.diff_id} is not awaiting a decision in this turn",
            )
            return
        self._set_status(TurnStatus.COMMITTING)
        try:
            outcome = await workflow.execute_activity_method(
                TurnActivities.decide,
                decision,
                summary=f"{decision.decision} {decision.diff_id[:8]} by {decision.approver}",
                **activity_options(turn.activities.commit),
            )
        except ActivityError as error:
            self._set_status(TurnStatus.AWAITING_APPROVAL)
            cause = error.cause.message if isinstance(error.cause, ApplicationError) else str(error)
            self._answer(ticket, f"the decision on {decision.diff_id} was not applied: {cause}")
            return
        self._resolve(outcome)
        early = workflow.patched(ANSWER_BEFORE_ROTATION_CHECK)
        if early:
            self._answer(ticket, outcome)
        if outcome.status is DiffStatus.APPROVED and outcome.commit_sha and outcome.label:
            await self._maybe_rotate(turn, outcome.label)
        self._set_status(TurnStatus.AWAITING_APPROVAL)
        if not early:
            self._answer(ticket, outcome)

    def _answer(self, ticket: int, answer: DecisionOutcome | str) -> None:
        if ticket != SIGNAL_TICKET:  # an Update waits for it; a signal does not
            self._answers[ticket] = answer

    async def _maybe_rotate(self, turn: TurnInput, label: str) -> None:
        candidate = RotationCandidate(user_id=turn.user_id, label=label)
        needed = await workflow.execute_activity_method(
            TurnActivities.needs_rotation,
            candidate,
            summary=f"check rotation of {label}",
            **activity_options(turn.activities.memory),
        )
        if needed:
            await start_rotation(
                RotationInput(user_id=turn.user_id, label=label, activities=turn.activities)
            )

    def _resolve(self, outcome: DecisionOutcome) -> None:
        if outcome.status is not DiffStatus.PENDING:
            self._open.pop(outcome.diff_id, None)
            self._outcomes[outcome.diff_id] = outcome
        workflow.upsert_search_attributes([PENDING_DIFFS.value_set(len(self._open))])

    def _set_status(self, status: TurnStatus) -> None:
        self._status = status
        workflow.upsert_search_attributes(
            [TURN_STATUS.value_set(status.value), PENDING_DIFFS.value_set(len(self._open))]
        )

    # -- handlers --------------------------------------------------------------------------

    @workflow.update
    async def reply(self) -> TurnReply:
        """Returns the reply as soon as it exists (the caller's update-with-start)."""
        await workflow.wait_condition(lambda: self._reply is not None)
        assert self._reply is not None
        return self._reply

    def _check(self, decision: DiffDecision) -> None:
        if self._turn is None or decision.user_id != self._turn.user_id:
            raise ValueError(f"no diff {decision.diff_id} for user '{decision.user_id}'")
        if decision.diff_id not in self._open:
            done = self._outcomes.get(decision.diff_id)
            if done is not None:
                raise ValueError(f"diff {decision.diff_id} is already {done.status.value}")
            raise ValueError(f"diff {decision.diff_id} is not awaiting a decision in this turn")
        if any(queued.diff_id == decision.diff_id for _, queued in self._queue):
            raise ValueError(f"diff {decision.diff_id} is already being decided")
        try:  # the approver's name goes into a commit: refuse a bad one before history
            validate_author_name(decision.approver)
        except DurableMemoryError as error:
            raise ValueError(str(error)) from None

    @workflow.update
    async def decide(self, decision: DiffDecision) -> DecisionOutcome:
        self._tickets += 1
        ticket = self._tickets
        self._queue.append((ticket, decision))
        await workflow.wait_condition(lambda: ticket in self._answers)
        answer = self._answers.pop(ticket)
        if isinstance(answer, str):
            raise ApplicationError(answer, type="DecisionRefused", non_retryable=True)
        return answer

    @decide.validator
    def _validate_decide(self, decision: DiffDecision) -> None:
        self._check(decision)

    def _enqueue_signal(self, decision: DiffDecision) -> None:
        try:
            self._check(decision)
        except ValueError as error:
            workflow.logger.warning("ignored decision signal: %s", error)
            return
        self._queue.append((SIGNAL_TICKET, decision))

    @workflow.signal
    def approve(self, decision: DiffDecision) -> None:
        self._enqueue_signal(decision.model_copy(update={"decision": "approve"}))

    @workflow.signal
    def reject(self, decision: DiffDecision) -> None:
        self._enqueue_signal(decision.model_copy(update={"decision": "reject"}))

    @workflow.signal
    def superseded(self, diff_id: str) -> None:
        diff = self._open.get(diff_id)
        if diff is not None:
            self._resolve(
                DecisionOutcome(
                    diff_id=diff_id,
                    status=DiffStatus.SUPERSEDED,
                    label=diff.label,
                    message="superseded by a newer proposal",
                )
            )

    @workflow.query
    def open_diffs(self) -> list[str]:
        return list(self._open)

    @workflow.query
    def status(self) -> TurnStatus:
        return self._status
