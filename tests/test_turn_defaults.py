"""Defaults from the worker: a turn started with only what the caller decides (user, turn id,
message) runs with the deployment's step limit, approval TTL and activity options, read from
the worker's settings; decisions need no field the turn already knows; the payload shapes
older callers send still work; and a payload that is wrong gets one named refusal.

Callers in other languages are played by a client with Temporal's DEFAULT converter and
plain dicts; what our own client sends is read back from the turn's history."""

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment

from durable_memory.models.activity_settings import (
    ActivitiesSettings,
    ActivitySettings,
    RetrySettings,
)
from durable_memory.models.diffs import DiffStatus
from durable_memory.models.turn import RejectedSignals, TurnOutcome, TurnStatus, turn_workflow_id
from durable_memory.workflows.common import activity_options, local_activity_options
from durable_memory.workflows.turn_boundary import INVALID_INPUT
from tests.support.agent_helpers import edit_block
from tests.support.temporal_helpers import (
    default_converter_client,
    local_activity_types,
    raw_turn_reply,
    rig_settings,
    running_rig,
    scheduled_activity_types,
    turn_outcome,
)

UNUSUAL_STEP = ActivitySettings(
    start_to_close_s=17,
    retry=RetrySettings(initial_interval_s=0.3, maximum_attempts=4),
    heartbeat_s=7,
)
"""Activity options no default has, so the history shows whose options a turn ran with."""


def _payload_keys(data: bytes) -> set[str]:
    decoded = json.loads(data)
    assert isinstance(decoded, dict)
    return set(decoded)


async def _events(env: WorkflowEnvironment, workflow_id: str) -> list[HistoryEvent]:
    history = await env.client.get_workflow_handle(workflow_id).fetch_history()
    return list(history.events)


async def test_a_turn_with_only_the_callers_fields_runs_with_the_workers_settings(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    settings = rig_settings(tmp_path / "data", ttl_s=2)
    settings = settings.model_copy(
        update={
            "memory": settings.memory.model_copy(update={"max_steps": 2}),
            "activities": ActivitiesSettings(
                model_call=UNUSUAL_STEP, memory=UNUSUAL_STEP, commit=UNUSUAL_STEP
            ),
        }
    )
    script: list[dict[str, Any]] = [  # the model would go on: the worker's limit stops it
        {"content": [edit_block("student", field="name", operation="set", value="Fay")]},
        {"content": [edit_block("journey", field="stage", operation="set", value="drafting")]},
        {"content": [edit_block("student", field="name", operation="set", value="never")]},
    ]
    foreign = await default_converter_client(temporal_env)
    workflow_id = turn_workflow_id("fay", "d1")
    async with running_rig(temporal_env.client, settings, script) as rig:
        reply = await raw_turn_reply(
            foreign,
            settings.temporal.task_queue,
            workflow_id,
            {"user_id": "fay", "turn_id": "d1", "message": "I'm Fay"},
        )
        assert reply["stopped_at_step_limit"] is True
        assert len(reply["diffs"]) == 2
        assert rig.model_server.remaining == 1  # two model calls: the worker's max_steps
        outcome = await turn_outcome(rig.client, "fay", "d1")  # undecided: the TTL expires them
        assert outcome.status is TurnStatus.EXPIRED

    events = await _events(temporal_env, workflow_id)
    scheduled = [
        e.activity_task_scheduled_event_attributes
        for e in events
        if e.HasField("activity_task_scheduled_event_attributes")
    ]
    # The first activity (patch one-activity-start) prepares and makes the first model call,
    # and the second runs the first step's tools with the second model call (patch
    # tools-in-model-step), each with a model call's options, those the worker offered; the
    # tools at the step limit and the finish run as local activities (patch local-turn-steps):
    # markers, whose options the history does not record; they take the `memory` options.
    kinds = {"dmem.start_turn", "dmem.tools_then_model", "dmem.expire_diffs"}
    assert set(scheduled_activity_types(events)) == kinds
    assert set(local_activity_types(events)) == {"dmem.run_tools", "dmem.finish_turn"}
    for activity in scheduled:  # every regular step took the worker's options
        assert activity.start_to_close_timeout.ToTimedelta() == timedelta(seconds=17)
        assert activity.heartbeat_timeout.ToTimedelta() == timedelta(seconds=7)
        assert activity.retry_policy.maximum_attempts == 4
        assert activity.retry_policy.initial_interval.ToTimedelta() == timedelta(seconds=0.3)
    (timer,) = [
        e.timer_started_event_attributes.start_to_fire_timeout.ToTimedelta()
        for e in events
        if e.HasField("timer_started_event_attributes")
    ]
    assert timedelta(0) < timer <= timedelta(seconds=2)  # the worker's approval TTL


async def test_a_caller_may_lower_the_limits_but_not_raise_them(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    """An older client's full input (the fields it used to send) still starts a turn; what
    it asks beyond the worker's limits is capped, what it asks below them is kept."""
    settings = rig_settings(tmp_path / "data")
    settings = settings.model_copy(
        update={"memory": settings.memory.model_copy(update={"max_steps": 3})}
    )
    script: list[dict[str, Any]] = [
        {"content": [edit_block("student", field="name", operation="set", value="Hal")]},
        {"content": [edit_block("journey", field="stage", operation="set", value="drafting")]},
    ]
    old_input = {
        "user_id": "hal",
        "turn_id": "d2",
        "message": "I'm Hal",
        "max_steps": 1,
        "approval_ttl_s": 30 * 24 * 3600.0,
        "activities": ActivitiesSettings().model_dump(mode="json"),
    }
    foreign = await default_converter_client(temporal_env)
    workflow_id = turn_workflow_id("hal", "d2")
    async with running_rig(temporal_env.client, settings, script) as rig:
        reply = await raw_turn_reply(foreign, settings.temporal.task_queue, workflow_id, old_input)
        assert reply["stopped_at_step_limit"] is True
        assert rig.model_server.remaining == 1  # the caller's 1 step, under the worker's 3
        diff_id = reply["diffs"][0]["id"]
        await rig.client.reject(diff_id, "ms-rivera", "not yet")
        await turn_outcome(rig.client, "hal", "d2")
    events = await _events(temporal_env, workflow_id)
    (timer,) = [
        e.timer_started_event_attributes.start_to_fire_timeout.ToTimedelta()
        for e in events
        if e.HasField("timer_started_event_attributes")
    ]
    assert timer <= timedelta(seconds=settings.turn.approval_ttl_s)  # not the caller's month


async def test_decisions_need_no_redundant_fields_and_old_shapes_still_work(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    script: list[dict[str, Any]] = [
        {
            "content": [
                edit_block("student", field="name", operation="set", value="Gus"),
                edit_block("journey", field="stage", operation="set", value="drafting"),
                edit_block("engagement_strategy", field="approach", operation="set", value="Q"),
            ]
        },
        {"text": "Hi Gus."},
    ]
    settings = rig_settings(tmp_path / "data")
    foreign = await default_converter_client(temporal_env)
    async with running_rig(temporal_env.client, settings, script) as rig:
        reply = await rig.client.send_message("gus", "I'm Gus", turn_id="d3")
        old_shape, by_signal, by_update = (d.id for d in reply.diffs)
        handle = foreign.get_workflow_handle(reply.workflow_id)

        # A contradiction (the approve signal saying reject) is refused: logged, counted,
        # shown, and nothing decided.
        contradiction = {"diff_id": old_shape, "decision": "reject", "approver": "x"}
        await handle.signal("approve", contradiction)
        refused = await temporal_env.client.get_workflow_handle(reply.workflow_id).query(
            "rejected_signals", result_type=RejectedSignals
        )
        assert refused.count == 1
        assert "the approve signal carries decision 'reject'" in refused.recent[-1]
        assert rig.stack.review.get(old_shape, "gus").status is DiffStatus.PENDING

        # The Update must say which decision it is: one named refusal, before history.
        with pytest.raises(WorkflowUpdateFailedError) as missing:
            await handle.execute_update("decide", {"diff_id": old_shape, "approver": "x"})
        cause = missing.value.cause
        assert isinstance(cause, ApplicationError)
        assert cause.type == INVALID_INPUT
        assert "decision: Field required" in cause.message

        # The shape every caller sent before: user and decision spelled out.
        old = {"diff_id": old_shape, "user_id": "gus", "decision": "approve", "approver": "x"}
        await handle.signal("approve", old)
        # Our client: a signal whose name is the decision, an Update without the user.
        await rig.client.reject(by_signal, "ms-rivera", "too early", wait=False)
        approved = await rig.client.approve(by_update, "ms-rivera")
        assert approved is not None
        assert approved.status is DiffStatus.APPROVED
        outcome: TurnOutcome = await turn_outcome(rig.client, "gus", "d3")
    assert {d.diff_id: d.status for d in outcome.decisions} == {
        old_shape: DiffStatus.APPROVED,
        by_signal: DiffStatus.REJECTED,
        by_update: DiffStatus.APPROVED,
    }

    events = await _events(temporal_env, reply.workflow_id)
    started = events[0].workflow_execution_started_event_attributes
    assert _payload_keys(started.input.payloads[0].data) == {"user_id", "turn_id", "message"}
    signals = [
        e.workflow_execution_signaled_event_attributes
        for e in events
        if e.HasField("workflow_execution_signaled_event_attributes")
    ]
    assert signals[-1].signal_name == "reject"
    assert _payload_keys(signals[-1].input.payloads[0].data) == {"diff_id", "approver", "reason"}
    (update,) = [
        e.workflow_execution_update_accepted_event_attributes.accepted_request.input
        for e in events
        if e.HasField("workflow_execution_update_accepted_event_attributes")
        and e.workflow_execution_update_accepted_event_attributes.accepted_request.input.name
        == "decide"
    ]
    assert _payload_keys(update.args.payloads[0].data) == {"diff_id", "approver", "decision"}


def test_an_activity_has_a_heartbeat_timeout_only_where_it_is_shorter_than_an_attempt() -> None:
    """A regular activity gets `heartbeat_s` (its worker heartbeats it: workers/heartbeats.py)
    unless that is None or no shorter than `start_to_close_s` (the kill tests' 4 s attempts);
    a local activity never does (the SDK takes none)."""
    long = ActivitySettings(start_to_close_s=120)
    assert activity_options(long)["heartbeat_timeout"] == timedelta(seconds=10)
    for settings in (
        ActivitySettings(start_to_close_s=4),
        ActivitySettings(start_to_close_s=120, heartbeat_s=None),
        ActivitySettings(start_to_close_s=10, heartbeat_s=10),
    ):
        assert "heartbeat_timeout" not in activity_options(settings)
    assert "heartbeat_timeout" not in local_activity_options(long)
    assert local_activity_options(long).keys() == activity_options(long).keys() - {
        "heartbeat_timeout"
    }
