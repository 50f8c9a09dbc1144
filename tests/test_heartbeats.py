"""A worker heartbeats its activities (durable_memory/workers/heartbeats.py): with the
deployment's long `start_to_close` timeouts (a model call's 120 s), an activity whose worker
was killed is taken over after its heartbeat timeout; a long activity on a live worker is
waited for on its first attempt; and a cancellation a heartbeat brings (the turn was ended)
never interrupts an activity mid-step."""

import asyncio
import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from temporalio.api.enums.v1 import TimeoutType
from temporalio.exceptions import CancelledError
from temporalio.testing import WorkflowEnvironment

from durable_memory.bootstrap import stack_from_settings
from durable_memory.client import MemoryClient, TurnFailed
from durable_memory.config import Settings
from durable_memory.faults import AFTER_MODEL_CALL, MID_COMMIT
from durable_memory.models.activity_settings import ActivitySettings, RetrySettings
from durable_memory.models.diffs import DiffStatus
from durable_memory.models.recall import MessageRole
from durable_memory.models.turn import turn_workflow_id
from durable_memory.scripted_model import ScriptedModelServer
from tests.support.git_checks import assert_fsck_clean
from tests.support.temporal_helpers import (
    activity_attempts,
    rig_settings,
    running_rig,
    turn_outcome,
)
from tests.support.worker_process import address as _address
from tests.support.worker_process import crash_settings, worker_process
from tests.test_crash import SCRIPT

HEARTBEAT_S = 2.0
LONG = ActivitySettings(
    start_to_close_s=120, heartbeat_s=HEARTBEAT_S, retry=RetrySettings(initial_interval_s=0.2)
)
"""A model call's default `start_to_close` (120 s), longer than the tests wait for anything,
with a short heartbeat timeout."""


def cancelled_start_turn(records: list[logging.LogRecord]) -> bool:
    """Whether the SDK logged `dmem.start_turn` ending with a cancellation."""
    return any(
        "dmem.start_turn" in record.getMessage()
        and (
            record.getMessage().startswith("Completing as cancelled")
            or (record.exc_info is not None and record.exc_info[0] is CancelledError)
        )
        for record in records
    )


def with_long_steps(settings: Settings, *kinds: str) -> Settings:
    activities = settings.activities.model_copy(update=dict.fromkeys(kinds, LONG))
    return settings.model_copy(update={"activities": activities})


@pytest.mark.parametrize(
    ("crash_at", "activity"), [(AFTER_MODEL_CALL, "dmem.start_turn"), (MID_COMMIT, "dmem.decide")]
)
async def test_a_killed_workers_activity_is_taken_over_after_its_heartbeat_timeout(
    temporal_env: WorkflowEnvironment, tmp_path: Path, crash_at: str, activity: str
) -> None:
    """Temporal learns that a worker died from a timeout only. With 120 s attempts and no
    heartbeat, a reply or an approval whose worker was killed waited that long; now the next
    worker takes the attempt over after `heartbeat_s`: the retry's started event says the
    first attempt ended by a heartbeat timeout, and everything ends within 60 s."""
    settings = with_long_steps(crash_settings(tmp_path), "model_call", "commit")
    settings.memory.data_dir.mkdir(parents=True)
    stack = stack_from_settings(settings)
    stack.blocks.ensure_user("hb")
    client = MemoryClient(temporal_env.client, settings, stack)
    address = _address(temporal_env)
    with ScriptedModelServer(SCRIPT) as model:
        with worker_process(settings, address, model.url, crash_at, tmp_path / "crashed") as first:
            sending = asyncio.create_task(client.send_message("hb", "Hi, I'm Alice", turn_id="h1"))
            approving = None
            if crash_at == MID_COMMIT:
                reply = await asyncio.wait_for(sending, 60)
                approving = asyncio.create_task(client.approve(reply.diffs[0].id, "ms-rivera"))
            assert await asyncio.to_thread(first.wait, 60) == -9  # SIGKILL at the crash point
        with worker_process(settings, address, model.url):
            if approving is None:
                reply = await asyncio.wait_for(sending, 60)
                approving = asyncio.create_task(client.approve(reply.diffs[0].id, "ms-rivera"))
            assert reply.reply == "Welcome, Alice."
            await asyncio.wait_for(approving, 60)
            outcome = await asyncio.wait_for(turn_outcome(client, "hb", "h1"), 60)
    assert [d.status for d in outcome.decisions] == [DiffStatus.APPROVED]
    history = await client.client.get_workflow_handle(turn_workflow_id("hb", "h1")).fetch_history()
    retried = [(name, n) for name, n in activity_attempts(history.events) if n > 1]
    assert retried == [(activity, 2)]  # regular and local steps: only the killed one again
    (retry,) = [
        e.activity_task_started_event_attributes
        for e in history.events
        if e.HasField("activity_task_started_event_attributes")
        and e.activity_task_started_event_attributes.attempt > 1
    ]
    assert retry.last_failure.timeout_failure_info.timeout_type == (
        TimeoutType.TIMEOUT_TYPE_HEARTBEAT
    )
    (options,) = [
        e.activity_task_scheduled_event_attributes
        for e in history.events
        if e.HasField("activity_task_scheduled_event_attributes")
        and e.activity_task_scheduled_event_attributes.activity_type.name == activity
    ]
    assert options.heartbeat_timeout.ToTimedelta().total_seconds() == HEARTBEAT_S
    assert_fsck_clean(stack.git.repo_path("hb"))
    stack.close()


async def test_an_activity_longer_than_its_heartbeat_timeout_lives_while_its_worker_does(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    """A model that takes three heartbeat timeouts to answer is waited for, on the first
    attempt (without the worker's heartbeats each attempt would time out after `heartbeat_s`
    and the turn fail after its last)."""
    settings = with_long_steps(rig_settings(tmp_path / "data"), "model_call")
    answers = iter(SCRIPT)

    def slow(_request: dict[str, Any]) -> dict[str, Any]:
        time.sleep(3 * HEARTBEAT_S)
        return next(answers)

    async with running_rig(temporal_env.client, settings, [], respond=slow) as rig:
        reply = await asyncio.wait_for(rig.client.send_message("slow", "Hi, I'm Alice"), 60)
        assert reply.reply == "Welcome, Alice."
        history = await rig.client.client.get_workflow_handle(
            turn_workflow_id("slow", reply.turn_id)
        ).fetch_history()
    attempts = dict(activity_attempts(history.events))
    assert attempts["dmem.start_turn"] == 1
    assert attempts["dmem.tools_then_model"] == 1
    assert len(rig.model_server.requests) == 2


async def test_a_cancellation_a_heartbeat_brings_never_interrupts_a_step(
    temporal_env: WorkflowEnvironment, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The turn is terminated while its first model call is held: the next heartbeat learns
    it and the SDK cancels the activity, which it would do by raising into the activity's
    thread at whatever line it runs (in a worker that goes on: a lock left held, a pool
    half-updated). Shielded, the step ends as it would have (the reply stored and in recall),
    the cancellation is raised after it (the SDK's log shows it reached the activity), and
    the worker serves the user's next turn."""
    caplog.set_level(logging.DEBUG, logger="temporalio.activity")
    settings = with_long_steps(rig_settings(tmp_path / "data"), "model_call")
    release = threading.Event()
    answers = iter(SCRIPT)

    def held(_request: dict[str, Any]) -> dict[str, Any]:
        if not release.is_set():
            release.wait(60)
        return next(answers)

    async with running_rig(temporal_env.client, settings, [], respond=held) as rig:
        sending = asyncio.create_task(rig.client.send_message("cut", "Hi", turn_id="c1"))
        for _ in range(600):  # the model call is under way
            if rig.model_server.requests:
                break
            await asyncio.sleep(0.05)
        assert rig.model_server.requests
        handle = rig.client.client.get_workflow_handle(turn_workflow_id("cut", "c1"))
        await handle.terminate("the test ends the turn mid model call")
        await asyncio.sleep(4 * HEARTBEAT_S)  # the next heartbeat brings the cancellation
        release.set()
        stored = None
        for _ in range(600):
            stored = rig.stack.turns.reply("cut", "c1", 1)
            if stored is not None:
                break
            await asyncio.sleep(0.05)
        assert stored is not None, "the held step was interrupted: its reply was never stored"
        roles = [m.role for m in rig.stack.recall.turn("cut", "c1")]
        assert roles == [MessageRole.USER, MessageRole.TOOL_CALL]
        with pytest.raises(TurnFailed):  # its caller is told the turn ended
            await asyncio.wait_for(sending, 30)
        for _ in range(600):  # the step's end is reported once it has returned
            if cancelled_start_turn(caplog.records):
                break
            await asyncio.sleep(0.05)
        assert cancelled_start_turn(caplog.records), "no cancellation reached the activity"
        answers = iter([{"text": "Hello again."}])
        again = await asyncio.wait_for(rig.client.send_message("cut", "Again", turn_id="c2"), 60)
        assert again.reply == "Hello again."
