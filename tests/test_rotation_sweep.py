"""The rotation sweep and its Schedule on many hosts: the sweep lists users from the database
(not one worker's disk), the Schedule is created once whoever starts first, and rotations run
with the worker's activity settings, not the starter's. A user being forgotten or forgotten
stalls no sweep, with payload encryption on or off."""

import asyncio
import dataclasses
import logging
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Literal

import pytest
from sqlalchemy import text
from temporalio.service import RPCError, RPCStatusCode
from temporalio.testing import ActivityEnvironment, WorkflowEnvironment

from durable_memory.activities.rotation import SweepActivities
from durable_memory.bootstrap import MemoryStack, stack_from_settings
from durable_memory.client import MemoryClient, connect_temporal
from durable_memory.config import Settings
from durable_memory.memory.store.users import PayloadKeyStore, UserDirectory
from durable_memory.models.activity_settings import (
    ActivitiesSettings,
    ActivitySettings,
    RetrySettings,
)
from durable_memory.models.history import Author, AuthorKind
from durable_memory.models.turn import (
    RotationCandidate,
    RotationOutcome,
    SweepInput,
    rotation_workflow_id,
)
from durable_memory.workflows.rotation import RotationSweepWorkflow
from tests.support.memory import MemoryRig
from tests.support.temporal_helpers import (
    Rig,
    default_converter_client,
    rig_settings,
    running_rig,
    workflow_result,
)
from tests.test_payload_codec import encrypted_settings

BACKEND = Author(name="tutor-backend", kind=AuthorKind.SERVICE)
UNUSUAL_STEP = ActivitySettings(
    start_to_close_s=19, retry=RetrySettings(initial_interval_s=0.7, maximum_attempts=6)
)
"""Activity options no default has, so the history shows whose options a rotation ran with."""


def _own_schedule(settings: Settings) -> Settings:
    """The settings with a schedule of the test's own (the dev server is the session's)."""
    rotation = settings.rotation.model_copy(update={"schedule_id": f"sweep-{uuid.uuid4().hex}"})
    return settings.model_copy(update={"rotation": rotation})


def _new_user_over_threshold(stack: MemoryStack, user_id: str) -> None:
    stack.blocks.ensure_user(user_id)
    for i in range(3):  # the human block goes over its 80% threshold
        stack.edits.add_context(user_id, f"note {i} " + "z" * 420, BACKEND)


def test_users_are_listed_once_their_memory_is_ensured(memory: MemoryRig) -> None:
    memory.blocks.ensure_user("ann")
    memory.blocks.ensure_user("ann")  # idempotent
    memory.blocks.ensure_user("ben")
    assert memory.blocks.users() == ["ann", "ben"]
    with memory.diffs.engine.begin() as conn:  # ben as a deployment from before the list has him
        conn.execute(text("DELETE FROM users WHERE user_id = 'ben'"))
    assert memory.blocks.users() == ["ann"]
    memory.blocks.ensure_user("ben")  # his next turn registers him
    assert memory.blocks.users() == ["ann", "ben"]
    with memory.diffs.engine.begin() as conn:
        conn.execute(text("DELETE FROM users"))
    assert memory.blocks.register_local_users() == 2  # what a worker does when it starts
    assert memory.blocks.users() == ["ann", "ben"]


async def test_the_sweep_lists_users_from_the_database(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    settings = rig_settings(tmp_path / "data")
    tag = uuid.uuid4().hex[:8]
    listed, disk_only, elsewhere = f"listed{tag}", f"disk{tag}", f"elsewhere{tag}"
    async with running_rig(temporal_env.client, settings, []) as rig:
        for user in (listed, disk_only):
            _new_user_over_threshold(rig.stack, user)
        with rig.stack.engine.begin() as conn:  # on this disk from before the list
            conn.execute(text("DELETE FROM users WHERE user_id = :u"), {"u": disk_only})
        # Registered by a worker on another host; its repository is not on this disk.
        UserDirectory(rig.stack.engine).register([elsewhere])
        rig.stack.blocks.register_local_users()  # the worker's start
        assert rig.stack.blocks.users() == sorted([listed, disk_only, elsewhere])
        started = await rig.client.client.execute_workflow(
            RotationSweepWorkflow.run,
            SweepInput(),
            id=f"sweep-{tag}",
            task_queue=settings.temporal.task_queue,
        )
        assert started == 2  # the user elsewhere is skipped, and fails nothing
        for user in (listed, disk_only):
            outcome = await workflow_result(rig.client, f"rotation-{user}-human", RotationOutcome)
            assert outcome.rotated
            assert rig.stack.archive.count(user) > 0
        assert not rig.stack.git.exists(elsewhere)  # the sweep created nothing for them


async def test_two_workers_starting_at_once_leave_one_schedule(
    temporal_env: WorkflowEnvironment, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = _own_schedule(rig_settings(tmp_path / "data"))
    workers = [
        MemoryClient(temporal_env.client, settings, stack_from_settings(settings)) for _ in range(2)
    ]
    try:
        ids = await asyncio.gather(*(w.ensure_rotation_schedule() for w in workers))
        assert ids == [settings.rotation.schedule_id] * 2  # neither failed
        schedule_ids = [s.id async for s in await temporal_env.client.list_schedules()]
        assert schedule_ids.count(settings.rotation.schedule_id) == 1
        handle = temporal_env.client.get_schedule_handle(settings.rotation.schedule_id)
        before = (await handle.describe()).info.last_updated_at

        with caplog.at_level(logging.WARNING, logger="durable_memory.client"):
            await workers[0].ensure_rotation_schedule()  # a restart, same configuration
        after = await handle.describe()
        assert after.info.last_updated_at == before  # not rewritten
        assert not caplog.records

        rotation = settings.rotation.model_copy(update={"interval_s": 120})
        changed = settings.model_copy(update={"rotation": rotation})
        with caplog.at_level(logging.WARNING, logger="durable_memory.client"):
            await MemoryClient(
                temporal_env.client, changed, workers[0].stack
            ).ensure_rotation_schedule()
        updated = await handle.describe()
        assert updated.schedule.spec.intervals[0].every == timedelta(seconds=120)
        assert updated.info.last_updated_at != before
        assert "differs from the configuration" in caplog.text  # a deliberate, logged update
        await handle.delete()
    finally:
        for worker in workers:
            worker.close()


async def test_a_rotation_with_a_minimal_input_runs_with_the_workers_settings(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    settings = rig_settings(tmp_path / "data")
    unusual = ActivitiesSettings(memory=UNUSUAL_STEP, archive=UNUSUAL_STEP, commit=UNUSUAL_STEP)
    settings = settings.model_copy(update={"activities": unusual})
    user = f"min{uuid.uuid4().hex[:8]}"
    foreign = await default_converter_client(temporal_env)
    async with running_rig(temporal_env.client, settings, []) as rig:
        _new_user_over_threshold(rig.stack, user)
        workflow_id = f"rotation-{user}-human"
        first = await foreign.start_workflow(  # a caller in another language
            "RotationWorkflow",
            {"user_id": user, "label": "human"},
            id=workflow_id,
            task_queue=settings.temporal.task_queue,
        )
        assert (await first.result())["rotated"] is True
        _new_user_over_threshold(rig.stack, user)  # over again, for our own client's rotation
        (outcome,) = await rig.client.rotate_now(user, "human")
        assert outcome.rotated
    for run_id in (first.result_run_id, None):  # the foreign caller's run, then our client's
        history = await temporal_env.client.get_workflow_handle(
            workflow_id, run_id=run_id
        ).fetch_history()
        scheduled = [
            e.activity_task_scheduled_event_attributes
            for e in history.events
            if e.HasField("activity_task_scheduled_event_attributes")
        ]
        assert {a.activity_type.name for a in scheduled} >= {"dmem.plan_rotation"}
        for activity in scheduled:
            assert activity.start_to_close_timeout.ToTimedelta() == timedelta(seconds=19)
            assert activity.retry_policy.maximum_attempts == 6


def _settings_on(env: WorkflowEnvironment, settings: Settings) -> Settings:
    """The settings with the session's dev server as the Temporal address."""
    address = env.client.service_client.config.target_host
    return settings.model_copy(
        update={"temporal": settings.temporal.model_copy(update={"address": address})}
    )


def _closed_users(rig: Rig, tag: str) -> tuple[str, str]:
    """Two users over their threshold, listed, and closed to memory: one whose forget is under
    way (killed before it deleted their rows), one forgotten. Neither has a payload key: none
    may be made for them again."""
    going, gone = f"going{tag}", f"gone{tag}"
    for user in (going, gone):
        _new_user_over_threshold(rig.stack, user)
        rig.stack.erasures.begin(user, "dpo@school.example", "erasure request")
    rig.stack.erasures.complete(gone)
    return going, gone


async def _not_found(rig: Rig, workflow_id: str) -> bool:
    try:
        await rig.client.client.get_workflow_handle(workflow_id).describe()
    except RPCError as error:
        return error.status == RPCStatusCode.NOT_FOUND
    return False


@pytest.mark.parametrize("encryption", ["per_user", "off"])
async def test_the_sweep_leaves_out_users_being_forgotten_or_forgotten(
    temporal_env: WorkflowEnvironment, tmp_path: Path, encryption: Literal["per_user", "off"]
) -> None:
    """With encryption on, a rotation started for such a user was refused as its input was
    encrypted, in the sweep's workflow task, retried until the forget completed and then
    for ever: no other user's block was rotated."""
    settings = _settings_on(temporal_env, encrypted_settings(tmp_path, encryption))
    client = await connect_temporal(settings)  # with the codec, as `dmem worker` connects
    tag = uuid.uuid4().hex[:8]
    kept = f"kept{tag}"
    async with running_rig(client, settings, []) as rig:
        _new_user_over_threshold(rig.stack, kept)
        going, gone = _closed_users(rig, tag)
        assert rig.stack.blocks.users() == [kept]
        started = await client.execute_workflow(
            RotationSweepWorkflow.run,
            SweepInput(),
            id=f"sweep-{tag}",
            task_queue=settings.temporal.task_queue,
            execution_timeout=timedelta(seconds=60),  # a stalled sweep fails the test
        )
        assert started == 1
        outcome = await workflow_result(
            rig.client, rotation_workflow_id(kept, "human"), RotationOutcome
        )
        assert outcome.rotated
        keys = PayloadKeyStore(rig.stack.engine)
        for user in (going, gone):
            assert await _not_found(rig, rotation_workflow_id(user, "human"))
            assert keys.for_user(user) is None
        assert (keys.for_user(kept) is not None) == (encryption == "per_user")


async def test_a_user_forgotten_after_the_listing_is_skipped_and_the_others_start(
    temporal_env: WorkflowEnvironment, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The race the listing cannot close: the user's forget begins (or completes) between the
    listing and the start. Encrypting their rotation's input is refused; the sweep's start
    skips them, logs it, and starts the other users' rotations."""
    settings = _settings_on(temporal_env, encrypted_settings(tmp_path))
    client = await connect_temporal(settings)
    tag = uuid.uuid4().hex[:8]
    kept = f"kept{tag}"
    async with running_rig(client, settings, []) as rig:
        _new_user_over_threshold(rig.stack, kept)
        going, gone = _closed_users(rig, tag)
        listed = [RotationCandidate(user_id=user, label="human") for user in (going, kept, gone)]
        env = ActivityEnvironment()
        env.info = dataclasses.replace(env.info, task_queue=settings.temporal.task_queue)
        with caplog.at_level(logging.WARNING, logger="durable_memory.activities.rotation"):
            started = await env.run(SweepActivities(client).start_rotations, listed)
        assert started == 1
        assert f"skipped {going}" in caplog.text
        assert f"skipped {gone}" in caplog.text
        outcome = await workflow_result(
            rig.client, rotation_workflow_id(kept, "human"), RotationOutcome
        )
        assert outcome.rotated
        for user in (going, gone):
            assert await _not_found(rig, rotation_workflow_id(user, "human"))
            assert PayloadKeyStore(rig.stack.engine).for_user(user) is None
