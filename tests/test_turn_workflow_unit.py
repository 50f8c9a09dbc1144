"""TurnWorkflow on its own: its activities replaced by stand-ins registered under the real
activity names, on the time-skipping test server. The one place a mock is right: these tests
are about the orchestration (which step runs when, in what order decisions apply, how a
failing step or the step limit ends a turn), not about what the steps do; the end-to-end
tests (test_turn_workflow.py) run the real activities.
"""

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
from temporalio import activity
from temporalio.client import WorkflowFailureError, WorkflowHandle, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from durable_memory.config import Settings
from durable_memory.memory.agent.steps import step_limit_note
from durable_memory.models.diffs import DiffStatus
from durable_memory.models.turn import (
    DecisionOutcome,
    DiffDecision,
    FinishedTurn,
    FinishInput,
    ModelStepResult,
    PreparedTurn,
    ProposedDiff,
    RotationCandidate,
    StartedTurn,
    StepInput,
    ToolStepResult,
    ToolsThenModel,
    TurnInput,
    TurnOutcome,
    TurnReply,
    TurnStatus,
    WorkerTurnSettings,
    turn_workflow_id,
)
from durable_memory.workflows.turn import LEARN_ATTEMPTS, TurnWorkflow
from durable_memory.workflows.turn_boundary import TURN_WORKFLOW
from tests.support.temporal_helpers import local_activity_types, scheduled_activity_types

USER = "alice"


def _diff_id(n: int) -> str:
    return f"{n:032x}"


@dataclass
class StandInActivities:
    """What each step answers, and the log of the calls the workflow made, in order.

    `model_steps[i]` is the number of tool calls step i+1's model reply asks for; each
    `run_tools` of step i proposes diff i. `failing_step` makes that model call fail for good."""

    model_steps: list[int]
    failing_step: int | None = None
    failing_tools: int | None = None
    """The step whose tools fail for good (each time they run)."""
    settings: WorkerTurnSettings = field(default_factory=lambda: Settings().turn_settings())
    """What the worker's configuration says (the `dmem.turn_settings` local activity)."""
    calls: list[tuple[str, Any]] = field(default_factory=list)
    stored: set[int] = field(default_factory=set)
    """The steps whose tools ran to the end (their diff is in the store)."""
    lookup_fails: bool = False
    """Reading what a step's tools stored fails (retryably, as a database down would)."""
    erasures_seen: int | None = None
    """What prepare found in the erasure ledger (the `since` of the turn's later checks)."""
    seen_by: list[tuple[str, int | None]] = field(default_factory=list)
    """The `erasures_seen` each step's input carried, by activity."""

    @activity.defn(name="dmem.turn_settings")
    async def turn_settings(self) -> WorkerTurnSettings:
        return self.settings

    @activity.defn(name="dmem.prepare_turn")
    async def prepare_turn(self, turn: TurnInput) -> PreparedTurn:
        self.calls.append(("prepare_turn", turn.message))
        return PreparedTurn(total_tokens=100, share_used=0.1, erasures_seen=self.erasures_seen)

    @activity.defn(name="dmem.start_turn")
    async def start_turn(self, turn: TurnInput) -> StartedTurn:
        """Prepare and the first model call, as the real one does."""
        prepared = await self.prepare_turn(turn)
        first = await self.call_model(
            StepInput(
                user_id=turn.user_id,
                turn_id=turn.turn_id,
                step=1,
                erasures_seen=prepared.erasures_seen,
            )
        )
        return StartedTurn(settings=self.settings, prepared=prepared, first=first)

    @activity.defn(name="dmem.call_model")
    async def call_model(self, step: StepInput) -> ModelStepResult:
        self.calls.append(("call_model", step.step))
        self.seen_by.append(("call_model", step.erasures_seen))
        if step.step == self.failing_step:
            raise ApplicationError("the model is gone", type="ModelCallError", non_retryable=True)
        tool_calls = self.model_steps[step.step - 1]
        return ModelStepResult(text=f"reply {step.step}", tool_calls=tool_calls, stop_reason=None)

    @activity.defn(name="dmem.run_tools")
    async def run_tools(self, step: StepInput) -> ToolStepResult:
        self.calls.append(("run_tools", step.step))
        self.seen_by.append(("run_tools", step.erasures_seen))
        if step.step == self.failing_tools:
            raise ApplicationError("the store is gone", type="UnsafeFile", non_retryable=True)
        # Idempotent, as the real one: a step's tools propose the same diff when run again.
        self.stored.add(step.step)
        return ToolStepResult(diff_ids=[_diff_id(step.step)], superseded=[])

    @activity.defn(name="dmem.step_diffs")
    async def step_diffs(self, step: StepInput) -> ToolStepResult:
        """What the step's tools stored, running none (as the real one reads the store)."""
        self.calls.append(("step_diffs", step.step))
        if self.lookup_fails:
            raise ApplicationError("the database is down", type="StoreUnavailable")
        stored = [_diff_id(step.step)] if step.step in self.stored else []
        return ToolStepResult(diff_ids=stored, superseded=[])

    @activity.defn(name="dmem.tools_then_model")
    async def tools_then_model(self, step: StepInput) -> ToolsThenModel:
        """A step's tools and the next model call, as the real one does."""
        tools = await self.run_tools(step)
        following = step.model_copy(update={"step": step.step + 1})
        return ToolsThenModel(tools=tools, next=await self.call_model(following))

    @activity.defn(name="dmem.finish_turn")
    async def finish_turn(self, finish: FinishInput) -> FinishedTurn:
        self.calls.append(("finish_turn", (finish.diff_ids, finish.stopped_at_step_limit)))
        self.seen_by.append(("finish_turn", finish.erasures_seen))
        diffs = [
            ProposedDiff(id=d, label="student", summary="s", status=DiffStatus.PENDING)
            for d in finish.diff_ids
        ]
        return FinishedTurn(diffs=diffs)

    @activity.defn(name="dmem.decide")
    async def decide(self, decision: DiffDecision) -> DecisionOutcome:
        self.calls.append(("decide", (decision.decision, decision.diff_id)))
        approved = decision.decision == "approve"
        return DecisionOutcome(
            diff_id=decision.diff_id,
            status=DiffStatus.APPROVED if approved else DiffStatus.REJECTED,
            commit_sha="c0ffee" * 6 + "abcd" if approved else None,
            label="student",
            decided_by=decision.approver,
        )

    @activity.defn(name="dmem.expire_diffs")
    async def expire_diffs(self, diff_ids: list[str]) -> list[DecisionOutcome]:
        self.calls.append(("expire_diffs", diff_ids))
        return [
            DecisionOutcome(diff_id=d, status=DiffStatus.EXPIRED, label="student") for d in diff_ids
        ]

    @activity.defn(name="dmem.needs_rotation")
    async def needs_rotation(self, candidate: RotationCandidate) -> bool:
        self.calls.append(("needs_rotation", candidate.label))
        return False

    def all(self) -> list[Any]:
        return [
            self.turn_settings,
            self.prepare_turn,
            self.start_turn,
            self.call_model,
            self.run_tools,
            self.tools_then_model,
            self.step_diffs,
            self.finish_turn,
            self.decide,
            self.expire_diffs,
            self.needs_rotation,
        ]

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


@asynccontextmanager
async def started_turn(
    env: WorkflowEnvironment, stand_ins: StandInActivities, **turn: Any
) -> AsyncIterator[WorkflowHandle[Any, Any]]:
    """A worker with the stand-ins on a fresh task queue, and a turn started on it."""
    task_queue = f"unit-{uuid.uuid4().hex[:10]}"
    turn_input = TurnInput(user_id=USER, turn_id=task_queue, message="Hi", **turn)
    async with Worker(
        env.client, task_queue=task_queue, workflows=[TurnWorkflow], activities=stand_ins.all()
    ):
        handle = await env.client.start_workflow(
            TURN_WORKFLOW,  # by name, as a caller in any language: its input is taken raw
            turn_input,
            id=turn_workflow_id(USER, task_queue),
            task_queue=task_queue,
            result_type=TurnOutcome,
        )
        yield handle


def _decision(n: int, kind: str) -> DiffDecision:
    return DiffDecision(diff_id=_diff_id(n), user_id=USER, decision=kind, approver="ms-rivera")


async def test_a_turn_runs_its_steps_in_order_then_waits_for_decisions(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    stand_ins = StandInActivities(model_steps=[1, 2, 0])
    async with started_turn(time_skipping_env, stand_ins) as handle:
        reply: TurnReply = await handle.execute_update("reply", result_type=TurnReply)
        assert reply.reply == "reply 3"
        assert not reply.stopped_at_step_limit
        assert [d.id for d in reply.diffs] == [_diff_id(1), _diff_id(2)]
        assert stand_ins.calls == [
            ("prepare_turn", "Hi"),
            ("call_model", 1),
            ("run_tools", 1),
            ("call_model", 2),
            ("run_tools", 2),
            ("call_model", 3),
            ("finish_turn", ([_diff_id(1), _diff_id(2)], False)),
        ]
        assert await handle.query(TurnWorkflow.status) == TurnStatus.AWAITING_APPROVAL
        assert await handle.query(TurnWorkflow.open_diffs) == [_diff_id(1), _diff_id(2)]
        for n in (1, 2):
            await handle.signal("reject", _decision(n, "reject"))
        outcome: TurnOutcome = await handle.result()
        events = [e async for e in handle.fetch_history_events()]
    # Each step's tools and the next model call are one activity; only finishing is local.
    assert scheduled_activity_types(events) == [
        "dmem.start_turn",
        "dmem.tools_then_model",
        "dmem.tools_then_model",
        "dmem.decide",
        "dmem.decide",
    ]
    assert local_activity_types(events) == ["dmem.finish_turn"]
    assert outcome.status is TurnStatus.DONE
    assert [d.status for d in outcome.decisions] == [DiffStatus.REJECTED] * 2


@pytest.mark.parametrize("seen", [0, 7])
async def test_every_step_carries_what_the_turns_first_erasure_check_saw(
    time_skipping_env: WorkflowEnvironment, seen: int
) -> None:
    """The newest erasure record prepare saw reaches every later step's input, so a step
    that runs after a forget and a fresh start of the user refuses the turn instead of
    writing into the user's new memory (store/erasure.py `since`)."""
    stand_ins = StandInActivities(model_steps=[1, 1, 0], erasures_seen=seen)
    async with started_turn(time_skipping_env, stand_ins) as handle:
        await handle.execute_update("reply", result_type=TurnReply)
        for n in (1, 2):
            await handle.signal("reject", _decision(n, "reject"))
        await handle.result()
    assert stand_ins.seen_by == [
        ("call_model", seen),
        ("run_tools", seen),
        ("call_model", seen),
        ("run_tools", seen),
        ("call_model", seen),
        ("finish_turn", seen),
    ]


async def test_decisions_apply_one_at_a_time_in_arrival_order(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    stand_ins = StandInActivities(model_steps=[1, 1, 1, 0])
    async with started_turn(time_skipping_env, stand_ins) as handle:
        await handle.execute_update("reply", result_type=TurnReply)
        sent = [_decision(2, "reject"), _decision(1, "approve"), _decision(1, "reject")]
        for decision in sent:  # signals: each is in history before the next is sent
            await handle.signal(decision.decision, decision)
        approved: DecisionOutcome = await handle.execute_update(
            "decide",
            _decision(3, "approve"),
            result_type=DecisionOutcome,
        )
        assert approved.status is DiffStatus.APPROVED
        with pytest.raises(WorkflowUpdateFailedError) as lost:  # refused before history
            await handle.execute_update(
                "decide",
                _decision(3, "reject"),
                result_type=DecisionOutcome,
            )
        outcome: TurnOutcome = await handle.result()
        refused = await handle.query(TurnWorkflow.rejected_signals)
    assert isinstance(lost.value.cause, ApplicationError)
    assert lost.value.cause.type == "DiffAlreadyDecided"
    decided = [call for name, call in stand_ins.calls if name == "decide"]
    # The second decision on diff 1 lost to the first: answered, never applied.
    assert decided == [("reject", _diff_id(2)), ("approve", _diff_id(1)), ("approve", _diff_id(3))]
    assert refused.count == 1
    assert "already approved by ms-rivera" in refused.recent[0]
    assert stand_ins.names().count("needs_rotation") == 2  # after each approval
    assert {d.diff_id: d.status for d in outcome.decisions} == {
        _diff_id(1): DiffStatus.APPROVED,
        _diff_id(2): DiffStatus.REJECTED,
        _diff_id(3): DiffStatus.APPROVED,
    }


async def test_a_failing_step_ends_the_turn_naming_it_and_expires_its_diffs(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    stand_ins = StandInActivities(model_steps=[1, 0], failing_step=2)
    async with started_turn(time_skipping_env, stand_ins) as handle:
        with pytest.raises(WorkflowUpdateFailedError) as reply_error:
            await handle.execute_update("reply", result_type=TurnReply)
        with pytest.raises(WorkflowFailureError) as result_error:
            await handle.result()
        assert await handle.query(TurnWorkflow.status) == TurnStatus.FAILED
    for failure in (reply_error.value.cause, result_error.value.cause):
        assert isinstance(failure, ApplicationError)
        assert failure.type == "TurnFailed"
        # The second model call ran in the activity that ran the first step's tools.
        assert failure.message == "dmem.tools_then_model failed: the model is gone"
    assert stand_ins.calls == [
        ("prepare_turn", "Hi"),
        ("call_model", 1),
        ("run_tools", 1),
        ("call_model", 2),
        # The failed activity had run step 1's tools: the store names the diff they
        # proposed, so the turn expires it (nobody was shown it: it does not stay pending).
        ("step_diffs", 1),
        ("expire_diffs", [_diff_id(1)]),
    ]


@pytest.mark.parametrize("lookup_fails", [False, True])
async def test_failing_tools_end_the_turn_naming_the_step_they_ran_in(
    time_skipping_env: WorkflowEnvironment, lookup_fails: bool
) -> None:
    stand_ins = StandInActivities(model_steps=[1, 1, 0], failing_tools=2, lookup_fails=lookup_fails)
    async with started_turn(time_skipping_env, stand_ins) as handle:
        with pytest.raises(WorkflowUpdateFailedError) as reply_error:
            await handle.execute_update("reply", result_type=TurnReply)
        with pytest.raises(WorkflowFailureError):
            await handle.result()
        assert await handle.query(TurnWorkflow.status) == TurnStatus.FAILED
    failure = reply_error.value.cause
    assert isinstance(failure, ApplicationError)
    # The failure is the activity's own, not that of the attempt to learn its diffs.
    assert failure.message == "dmem.tools_then_model failed: the store is gone"
    assert stand_ins.calls == [
        ("prepare_turn", "Hi"),
        ("call_model", 1),
        ("run_tools", 1),
        ("call_model", 2),
        ("run_tools", 2),  # in tools_then_model: fails, the model is not called
        # What they stored, read (no tool runs again): nothing; a read that fails is tried
        # at most LEARN_ATTEMPTS times, then the turn's own failure is reported.
        *[("step_diffs", 2)] * (LEARN_ATTEMPTS if lookup_fails else 1),
        ("expire_diffs", [_diff_id(1)]),  # step 1's diff, which the turn had learnt
    ]


async def test_the_step_limit_ends_the_loop_and_says_so_in_the_reply(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    stand_ins = StandInActivities(model_steps=[1, 1, 1])
    async with started_turn(time_skipping_env, stand_ins, max_steps=2) as handle:
        reply: TurnReply = await handle.execute_update("reply", result_type=TurnReply)
        assert reply.stopped_at_step_limit
        assert reply.reply == f"reply 2\n\n{step_limit_note(2)}"
        assert stand_ins.names() == [
            "prepare_turn",
            "call_model",
            "run_tools",
            "call_model",
            "run_tools",
            "finish_turn",
        ]
        assert stand_ins.calls[-1] == ("finish_turn", ([_diff_id(1), _diff_id(2)], True))
        events = [e async for e in handle.fetch_history_events()]
        # No model call follows the tools of the step at the limit: they run alone, locally.
        assert scheduled_activity_types(events) == ["dmem.start_turn", "dmem.tools_then_model"]
        assert local_activity_types(events) == ["dmem.run_tools", "dmem.finish_turn"]
        for n in (1, 2):
            await handle.signal("approve", _decision(n, "approve"))
        await handle.result()


@pytest.mark.parametrize("asked", [None, 5])
async def test_the_workers_step_limit_applies_and_caps_the_callers(
    time_skipping_env: WorkflowEnvironment, asked: int | None
) -> None:
    two = Settings().turn_settings().model_copy(update={"max_steps": 2})
    stand_ins = StandInActivities(model_steps=[1] * 5, settings=two)
    asking = {} if asked is None else {"max_steps": asked}
    async with started_turn(time_skipping_env, stand_ins, **asking) as handle:
        reply: TurnReply = await handle.execute_update("reply", result_type=TurnReply)
        assert reply.reply == f"reply 2\n\n{step_limit_note(2)}"
        for n in (1, 2):  # the signal's name is the decision: the payload need not say it
            await handle.signal("reject", {"diff_id": _diff_id(n), "approver": "ms-rivera"})
        outcome: TurnOutcome = await handle.result()
    assert [d.status for d in outcome.decisions] == [DiffStatus.REJECTED] * 2


async def test_undecided_diffs_expire_when_the_approval_window_passes(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    month = Settings().turn_settings().model_copy(update={"approval_ttl_s": 30 * 24 * 3600})
    stand_ins = StandInActivities(model_steps=[1, 0], settings=month)
    async with started_turn(time_skipping_env, stand_ins) as handle:
        await handle.execute_update("reply", result_type=TurnReply)
        outcome: TurnOutcome = await handle.result()  # the test server skips the month
    assert stand_ins.calls[-1] == ("expire_diffs", [_diff_id(1)])
    assert outcome.status is TurnStatus.EXPIRED
    assert [d.status for d in outcome.decisions] == [DiffStatus.EXPIRED]
