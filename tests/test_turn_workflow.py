"""The turn workflow end to end on a real Temporal dev server, with the real SDK talking to
the scripted model server: reply in the starting call, approve, reject, edit-then-approve,
expiry, supersede, and the rotation a commit triggers."""

import asyncio
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import WorkflowExecutionStatus, WorkflowUpdateFailedError
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment

from durable_memory.memory.core.errors import DiffAlreadyDecided
from durable_memory.models.diffs import DiffStatus
from durable_memory.models.turn import (
    DiffDecision,
    RotationOutcome,
)
from durable_memory.workflows.common import PENDING_DIFFS
from durable_memory.workflows.turn import TurnWorkflow
from tests.support.agent_helpers import edit_block
from tests.support.temporal_helpers import (
    current_details,
    listed_workflow_ids,
    rig_settings,
    running_rig,
    time_skipping,
    turn_outcome,
    workflow_result,
)

THREE_EDITS: list[dict[str, Any]] = [
    {
        "content": [
            {"type": "text", "text": "Noting."},
            edit_block("student", field="name", operation="set", value="Alice"),
            edit_block("journey", field="stage", operation="set", value="drafting"),
            {
                "type": "tool_use",
                "name": "edit_memory_block",
                "input": {
                    "label": "human",
                    "operation": "set_task",
                    "value": "Outline",
                    "reasoning": "r",
                },
            },
        ]
    },
    {"text": "Welcome, Alice."},
]


async def test_reply_then_approve_reject_and_edited_approval(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    settings = rig_settings(tmp_path / "data")
    async with running_rig(temporal_env.client, settings, THREE_EDITS) as rig:
        reply = await rig.client.send_message("alice", "Hi, I'm Alice", turn_id="t1")
        assert reply.reply == "Welcome, Alice."
        assert [d.status for d in reply.diffs] == [DiffStatus.PENDING] * 3
        name, stage, task = reply.diffs
        # The reply came back before anything was decided: memory is untouched.
        assert rig.stack.blocks.read_block("alice", "student").fields["name"] is None

        handle = temporal_env.client.get_workflow_handle(reply.workflow_id)
        assert await handle.query(TurnWorkflow.status) == "awaiting_approval"
        approved = await rig.client.approve(name.id, "ms-rivera")
        assert approved is not None
        assert approved.status is DiffStatus.APPROVED
        assert rig.stack.blocks.read_block("alice", "student").fields["name"] == "Alice"
        rejected = await rig.client.reject(stage.id, "ms-rivera", "too early")
        assert rejected is not None
        assert rejected.status is DiffStatus.REJECTED
        with pytest.raises(DiffAlreadyDecided, match="already rejected"):
            await rig.client.approve(stage.id, "bob")
        markdown = rig.stack.blocks.render("alice", "human", "markdown").replace(
            "## Current Task\n", "## Current Task\nOutline the robot essay"
        )
        edited = await rig.client.approve(task.id, "alice", edited_markdown=markdown)
        assert edited is not None
        assert edited.status is DiffStatus.APPROVED
        assert rig.stack.blocks.read_block("alice", "human").fields["current_task"] == (
            "Outline the robot essay"
        )
        outcome = await turn_outcome(rig.client, "alice", "t1")
        assert outcome.status == "done"
        assert {d.diff_id: d.status for d in outcome.decisions} == {
            name.id: DiffStatus.APPROVED,
            stage.id: DiffStatus.REJECTED,
            task.id: DiffStatus.APPROVED,
        }
        commits = rig.stack.history.history("alice", "student", 10)
        assert commits[0].trailers["Diff-Id"] == name.id
        # The same turn id again returns the same turn, not a new one.
        again = await rig.client.send_message("alice", "Hi, I'm Alice", turn_id="t1")
        assert again.reply == reply.reply


async def test_signals_and_expiry(time_skipping_env: WorkflowEnvironment, tmp_path: Path) -> None:
    """On the time-skipping test server: the week-long approval window passes as soon as
    nothing else is in flight, with no real wait."""
    settings = rig_settings(tmp_path / "data", ttl_s=7 * 24 * 3600)
    async with running_rig(time_skipping_env.client, settings, THREE_EDITS) as rig:
        reply = await rig.client.send_message("alice", "Hi", turn_id="t2")
        first = reply.diffs[0]
        assert await rig.client.approve(first.id, "ms-rivera", wait=False) is None  # a signal
        async with time_skipping(time_skipping_env):
            outcome = await turn_outcome(rig.client, "alice", "t2")
        statuses = {d.diff_id: d.status for d in outcome.decisions}
        assert statuses[first.id] is DiffStatus.APPROVED
        assert [statuses[d.id] for d in reply.diffs[1:]] == [DiffStatus.EXPIRED] * 2
        assert outcome.status == "expired"
        assert rig.stack.review.get(reply.diffs[1].id, "alice").status is DiffStatus.EXPIRED


async def test_newer_turn_supersedes_and_ends_the_older_wait(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    script: list[dict[str, Any]] = [
        {"content": [edit_block("student", field="name", operation="set", value="Ally")]},
        {"text": "ok 1"},
        {"content": [edit_block("student", field="name", operation="set", value="Alice")]},
        {"text": "ok 2"},
    ]
    settings = rig_settings(tmp_path / "data")
    async with running_rig(temporal_env.client, settings, script) as rig:
        first = await rig.client.send_message("alice", "call me Ally", turn_id="older")
        second = await rig.client.send_message("alice", "actually Alice", turn_id="newer")
        older = await turn_outcome(rig.client, "alice", "older")
        assert [d.status for d in older.decisions] == [DiffStatus.SUPERSEDED]
        assert rig.stack.review.get(first.diffs[0].id, "alice").superseded_by == second.diffs[0].id
        await rig.client.approve(second.diffs[0].id, "ms-rivera")
        assert (await turn_outcome(rig.client, "alice", "newer")).status == "done"


async def test_approval_that_crosses_the_threshold_starts_a_rotation(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    long_note = "Discussed the robotics competition at length " + "x" * 420
    script: list[dict[str, Any]] = [
        {
            "content": [
                {
                    "type": "tool_use",
                    "name": "edit_memory_block",
                    "input": {
                        "label": "human",
                        "operation": "add_context",
                        "value": long_note,
                        "reasoning": "r",
                    },
                }
            ]
        },
        {"text": "Noted."},
    ]
    settings = rig_settings(tmp_path / "data")
    async with running_rig(temporal_env.client, settings, script) as rig:
        from durable_memory.models.history import Author, AuthorKind

        backend = Author(name="tutor-backend", kind=AuthorKind.SERVICE)
        rig.stack.blocks.ensure_user("rosa")
        for i in range(2):
            rig.stack.edits.add_context("rosa", f"note {i} " + "y" * 420, backend)
        reply = await rig.client.send_message("rosa", "we talked a lot", turn_id="t3")
        approved_at = datetime.now(UTC)
        await rig.client.approve(reply.diffs[0].id, "ms-rivera")  # answered once committed
        result = await workflow_result(
            rig.client, "rotation-rosa-human", RotationOutcome, started_after=approved_at
        )
        handle = temporal_env.client.get_workflow_handle("rotation-rosa-human")
        assert result.rotated
        passages = rig.stack.archive.page("rosa")
        assert [p.id for p in passages] == result.passage_ids
        assert "Discussed the robotics competition" in passages[0].text
        desc = await handle.describe()
        assert desc.status == WorkflowExecutionStatus.COMPLETED


async def test_the_schedule_sweeps_blocks_over_threshold(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    settings = rig_settings(tmp_path / "data")
    settings = settings.model_copy(
        update={
            "rotation": settings.rotation.model_copy(
                update={"schedule_id": f"sweep-{settings.temporal.task_queue}"}
            )
        }
    )
    async with running_rig(temporal_env.client, settings, []) as rig:
        from durable_memory.models.history import Author, AuthorKind

        backend = Author(name="tutor-backend", kind=AuthorKind.SERVICE)
        for user in ("carol", "bob"):
            rig.stack.blocks.ensure_user(user)
        for i in range(3):  # carol's human block goes over its 80% threshold
            rig.stack.edits.add_context("carol", f"note {i} " + "z" * 420, backend)
        schedule_id = await rig.client.ensure_rotation_schedule()
        assert schedule_id == await rig.client.ensure_rotation_schedule()  # idempotent
        schedule = temporal_env.client.get_schedule_handle(schedule_id)
        await schedule.trigger()
        rotation = temporal_env.client.get_workflow_handle(
            "rotation-carol-human", result_type=RotationOutcome
        )
        for _ in range(100):  # the sweep starts the rotation as an abandoned child
            try:
                result = await rotation.result()
                break
            except RPCError:
                await asyncio.sleep(0.1)
        assert result.rotated
        passages = rig.stack.archive.page("carol")
        assert sorted(p.id for p in passages) == sorted(result.passage_ids)  # chunks of one text
        assert {(p.source.value, p.label) for p in passages} == {("rotation", "human")}
        assert rig.stack.archive.count("bob") == 0
        description = await schedule.describe()
        assert description.schedule.spec.intervals[0].every.total_seconds() == 3600
        await schedule.delete()


async def test_operators_find_turns_awaiting_approval_with_one_query(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    settings = rig_settings(tmp_path / "data")
    async with running_rig(temporal_env.client, settings, THREE_EDITS) as rig:
        reply = await rig.client.send_message("dora", "Hi, I'm Dora", turn_id="v1")
        query = "DmemUserId = 'dora' AND DmemTurnStatus = 'awaiting_approval'"
        assert await listed_workflow_ids(temporal_env.client, query) == [reply.workflow_id]
        description = await temporal_env.client.get_workflow_handle(reply.workflow_id).describe()
        assert description.typed_search_attributes.get(PENDING_DIFFS) == 3
        assert await description.static_summary() == "Turn of dora: Hi, I'm Dora"
        details = await current_details(temporal_env.client.get_workflow_handle(reply.workflow_id))
        assert "### Proposed memory edits" in details
        assert "+Alice" in details
        for diff in reply.diffs:
            await rig.client.reject(diff.id, "ms-rivera", "not now")
        await turn_outcome(rig.client, "dora", "v1")


async def test_the_update_validator_refuses_before_history(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    settings = rig_settings(tmp_path / "data")
    async with running_rig(temporal_env.client, settings, THREE_EDITS) as rig:
        reply = await rig.client.send_message("erin", "Hi, I'm Erin", turn_id="u1")
        handle = temporal_env.client.get_workflow_handle(reply.workflow_id)
        before = len((await handle.fetch_history()).events)
        real = reply.diffs[0].id
        attempts = [
            DiffDecision(diff_id=real, user_id="mallory", decision="approve", approver="m"),
            DiffDecision(diff_id="0" * 32, user_id="erin", decision="approve", approver="m"),
        ]
        for decision in attempts:
            with pytest.raises(WorkflowUpdateFailedError):
                await handle.execute_update("decide", decision)
        await rig.client.reject(real, "ms-rivera", "no")
        with pytest.raises(WorkflowUpdateFailedError):
            await handle.execute_update(
                "decide",
                DiffDecision(diff_id=real, user_id="erin", decision="approve", approver="m"),
            )
        events = (await handle.fetch_history()).events
        accepted = [
            e.workflow_execution_update_accepted_event_attributes.accepted_request.input.name
            for e in events
            if e.HasField("workflow_execution_update_accepted_event_attributes")
        ]
        assert accepted == ["reply", "decide"]  # of the decisions, only the valid one
        assert len(events) > before
        for diff in reply.diffs[1:]:
            await rig.client.reject(diff.id, "ms-rivera", "no")
        await turn_outcome(rig.client, "erin", "u1")
