"""The turn workflow's boundary, as a caller in any language meets it: workflow ids that
name one (user, turn), payloads validated by the workflow itself (a client with Temporal's
DEFAULT converter and plain dicts stands in for TypeScript or Go), search attributes the
workflow sets itself, and a failed step that ends the turn with a short, named error."""

import asyncio
import uuid
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import (
    WithStartWorkflowOperation,
    WorkflowFailureError,
    WorkflowUpdateFailedError,
)
from temporalio.common import SearchAttributePair, TypedSearchAttributes, WorkflowIDConflictPolicy
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment

from durable_memory.client import TurnFailed
from durable_memory.memory.store.diffs import DiffStore
from durable_memory.models.activity_settings import (
    ActivitiesSettings,
    ActivitySettings,
    RetrySettings,
)
from durable_memory.models.diffs import DiffStatus
from durable_memory.models.turn import (
    RejectedSignals,
    TurnInput,
    TurnOutcome,
    TurnReply,
    legacy_turn_workflow_id,
    rotation_workflow_id,
    turn_workflow_id,
)
from durable_memory.workflows.common import PENDING_DIFFS, TURN_STATUS, USER_ID
from durable_memory.workflows.turn_boundary import TURN_WORKFLOW
from tests.support.agent_helpers import edit_block
from tests.support.temporal_helpers import (
    default_converter_client,
    raw_turn_reply,
    rig_settings,
    running_rig,
    turn_outcome,
    upserted_search_attributes,
)


def _cause(error: BaseException) -> ApplicationError:
    cause = (
        error.cause if isinstance(error, WorkflowFailureError | WorkflowUpdateFailedError) else None
    )
    assert isinstance(cause, ApplicationError), error
    return cause


async def test_ids_with_dashes_never_share_a_workflow(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    script: list[dict[str, Any]] = [{"text": "reply to a-b"}, {"text": "reply to a"}]
    settings = rig_settings(tmp_path / "data")
    async with running_rig(temporal_env.client, settings, script) as rig:
        first = await rig.client.send_message("a-b", "hello from a-b", turn_id="c")
        second = await rig.client.send_message("a", "hello from a", turn_id="b-c")
        assert (first.user_id, first.reply) == ("a-b", "reply to a-b")
        assert (second.user_id, second.reply) == ("a", "reply to a")
        assert first.workflow_id != second.workflow_id
        assert rig.model_server.remaining == 0  # the model was called for each
        assert (await turn_outcome(rig.client, "a", "b-c")).reply == "reply to a"


async def test_a_turn_started_under_the_old_id_still_takes_decisions(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    """Upgrade safety: a turn that was started as `turn-<user>-<turn>` and still awaits a
    decision is found by the client under that id, and its diff is committed."""
    script: list[dict[str, Any]] = [
        {"content": [edit_block("student", field="name", operation="set", value="Olga")]},
        {"text": "Hi Olga."},
    ]
    settings = rig_settings(tmp_path / "data")
    async with running_rig(temporal_env.client, settings, script) as rig:
        old_id = legacy_turn_workflow_id("olga", "before")
        start: WithStartWorkflowOperation[Any, Any] = WithStartWorkflowOperation(
            TURN_WORKFLOW,
            TurnInput(user_id="olga", turn_id="before", message="I'm Olga"),
            id=old_id,
            task_queue=settings.temporal.task_queue,
            id_conflict_policy=WorkflowIDConflictPolicy.FAIL,
            search_attributes=TypedSearchAttributes([SearchAttributePair(USER_ID, "olga")]),
        )
        reply = await temporal_env.client.execute_update_with_start_workflow(
            "reply", start_workflow_operation=start, result_type=TurnReply
        )
        outcome = await rig.client.approve(reply.diffs[0].id, "ms-rivera")
        assert outcome is not None
        assert outcome.commit_sha is not None
        assert rig.stack.blocks.read_block("olga", "student").fields["name"] == "Olga"
        ended = await temporal_env.client.get_workflow_handle(
            old_id, result_type=TurnOutcome
        ).result()
        assert [d.status for d in ended.decisions] == [DiffStatus.APPROVED]


def test_workflow_ids_are_injective() -> None:
    pairs = [("a-b", "c"), ("a", "b-c"), ("a", "b.c"), ("a.b", "c"), ("a_b", "c")]
    assert len({turn_workflow_id(u, t) for u, t in pairs}) == len(pairs)
    blocks = [("a-b", "c"), ("a", "b_c"), ("a_b", "c"), ("a-b-c", "d")]
    assert len({rotation_workflow_id(u, label) for u, label in blocks}) == len(blocks)


BAD_INPUTS: list[tuple[dict[str, Any], str]] = [
    ({"user_id": "dora", "turn_id": "t", "message": "hi", "colour": "red"}, "colour"),
    ({"user_id": "dora", "turn_id": "t"}, "message"),
    ({"user_id": "dora", "turn_id": "t", "message": "hi", "max_steps": "8"}, "max_steps"),
    ({"user_id": "../dora", "turn_id": "t", "message": "hi"}, "invalid user id"),
]


@pytest.mark.parametrize(("turn", "named"), BAD_INPUTS, ids=lambda v: str(v)[:20])
async def test_a_bad_turn_input_fails_the_workflow_naming_the_field(
    temporal_env: WorkflowEnvironment, tmp_path: Path, turn: dict[str, Any], named: str
) -> None:
    settings = rig_settings(tmp_path / "data")
    foreign = await default_converter_client(temporal_env)
    async with running_rig(temporal_env.client, settings, []) as rig:
        handle = await foreign.start_workflow(
            TURN_WORKFLOW,
            turn,
            id=f"bad-{uuid.uuid4().hex}",
            task_queue=settings.temporal.task_queue,
        )
        with pytest.raises(WorkflowFailureError) as failed:
            await handle.result()
        cause = _cause(failed.value)
        assert cause.type == "InvalidInput"
        assert named in cause.message
        assert rig.model_server.remaining == 0


async def test_update_with_start_of_a_refused_user_gets_the_refusal(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    settings = rig_settings(tmp_path / "data")
    foreign = await default_converter_client(temporal_env)
    async with running_rig(temporal_env.client, settings, []):
        with pytest.raises(WorkflowUpdateFailedError) as refused:
            await raw_turn_reply(
                foreign,
                settings.temporal.task_queue,
                f"bad-{uuid.uuid4().hex}",
                {"user_id": "../etc", "turn_id": "t", "message": "hi"},
            )
        assert "invalid user id '../etc'" in _cause(refused.value).message


@pytest.mark.parametrize(
    "carried",
    [
        [],
        # Another user's id, a status the turn is not in, a count of nothing: all corrected.
        [
            SearchAttributePair(USER_ID, "mallory"),
            SearchAttributePair(TURN_STATUS, "awaiting_approval"),
            SearchAttributePair(PENDING_DIFFS, 7),
        ],
    ],
    ids=["none", "wrong"],
)
async def test_a_foreign_caller_gets_search_attributes_and_its_bad_decisions_refused(
    temporal_env: WorkflowEnvironment, tmp_path: Path, carried: list[SearchAttributePair[Any]]
) -> None:
    """A caller in another language that sets none of the turn's search attributes at the
    start, or sets them wrong, has them set right by the turn in its first workflow task (a
    turn trusts the start's only where they are what it would set: patch
    `turn-starter-attributes`)."""
    script: list[dict[str, Any]] = [
        {"content": [edit_block("student", field="name", operation="set", value="Dora")]},
        {"text": "Hi Dora."},
    ]
    settings = rig_settings(tmp_path / "data")
    foreign = await default_converter_client(temporal_env)
    async with running_rig(temporal_env.client, settings, script) as rig:
        turn_id = f"f{len(carried)}"
        workflow_id = turn_workflow_id("dora", turn_id)
        reply = await raw_turn_reply(
            foreign,
            settings.temporal.task_queue,
            workflow_id,
            {"user_id": "dora", "turn_id": turn_id, "message": "I'm Dora"},
            TypedSearchAttributes(carried),
        )
        assert reply["reply"] == "Hi Dora."
        diff_id = reply["diffs"][0]["id"]
        handle = foreign.get_workflow_handle(workflow_id)
        events = (await handle.fetch_history()).events
        first_upserts = upserted_search_attributes(events)[:2]  # the patch's, then the turn's
        assert first_upserts[1] == ["DmemPendingDiffs", "DmemTurnStatus", "DmemUserId"]
        attributes = (await handle.describe()).typed_search_attributes
        assert attributes.get(USER_ID) == "dora"
        assert attributes.get(TURN_STATUS) == "awaiting_approval"
        assert attributes.get(PENDING_DIFFS) == 1

        good = {"diff_id": diff_id, "user_id": "dora", "decision": "approve", "approver": "x"}
        for bad, named in [
            ({**good, "extra": 1}, "extra"),
            ({k: v for k, v in good.items() if k != "approver"}, "approver"),
            ({**good, "approver": 7}, "approver"),
        ]:
            with pytest.raises(WorkflowUpdateFailedError) as refused:
                await handle.execute_update("decide", bad)
            assert named in _cause(refused.value).message
            await handle.signal("approve", bad)
        rejected = await temporal_env.client.get_workflow_handle(workflow_id).query(
            "rejected_signals", result_type=RejectedSignals
        )
        assert rejected.count == 3
        assert "approver" in rejected.recent[-1]
        details = await handle.query("__temporal_workflow_metadata")
        assert "3 decision signal(s) refused" in details.current_details
        assert rig.stack.review.get(diff_id, "dora").status == "pending"
        outcome = await handle.execute_update(
            "decide", {**good, "decision": "reject", "reason": "no"}
        )
        assert outcome["status"] == "rejected"
        await turn_outcome(rig.client, "dora", turn_id)


def _quick(maximum_attempts: int) -> ActivitiesSettings:
    retry = RetrySettings(
        initial_interval_s=0.1, maximum_interval_s=0.2, maximum_attempts=maximum_attempts
    )
    step = ActivitySettings(start_to_close_s=10, retry=retry)
    return ActivitiesSettings(model_call=step, memory=step, commit=step, archive=step)


@pytest.mark.parametrize(
    ("script", "attempts"),
    [
        ([{"status": 400, "error_type": "invalid_request_error", "message": "é" * 5000}], 5),
        ([{"status": 529, "error_type": "overloaded_error"}] * 2, 2),
    ],
    ids=["non-retryable", "retries-exhausted"],
)
async def test_a_failed_step_ends_the_turn_with_a_short_named_error(
    temporal_env: WorkflowEnvironment,
    tmp_path: Path,
    script: list[dict[str, Any]],
    attempts: int,
) -> None:
    proposing = {"content": [edit_block("student", field="name", operation="set", value="Eve")]}
    settings = rig_settings(tmp_path / "data")
    settings = settings.model_copy(update={"activities": _quick(attempts)})
    async with running_rig(temporal_env.client, settings, [proposing, *script]) as rig:
        with pytest.raises(TurnFailed, match="tools_then_model failed") as failed:
            await rig.client.send_message("eve", "hi", turn_id="boom")
        assert len(str(failed.value).encode()) < 1024
        with pytest.raises(WorkflowFailureError) as result:
            await turn_outcome(rig.client, "eve", "boom")
        cause = _cause(result.value)
        assert cause.type == "TurnFailed"
        assert cause.message.startswith("dmem.tools_then_model failed: ModelCallError: ")
        assert cause.message.count("failed") == 1  # named once, not once per layer
        assert len(cause.message.encode()) < 1024
        # The diff the turn proposed before failing does not stay pending without a turn.
        assert [d.status for d in DiffStore(rig.stack.engine).list("eve")] == ["expired"]
        handle = temporal_env.client.get_workflow_handle(turn_workflow_id("eve", "boom"))
        attributes = (await handle.describe()).typed_search_attributes
        assert attributes.get(TURN_STATUS) == "failed"


async def test_a_turn_failing_after_its_tools_superseded_a_diff_ends_the_older_wait(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    """The newer turn's tools supersede the older turn's diff, then its next model call fails
    for good (in the same activity, so the turn never got the tools' result): the older turn
    is still told, and does not wait days for a diff nobody can decide."""
    script: list[dict[str, Any]] = [
        {"content": [edit_block("student", field="name", operation="set", value="Ally")]},
        {"text": "ok"},
        {"content": [edit_block("student", field="name", operation="set", value="Alice")]},
        {"status": 400, "error_type": "invalid_request_error", "message": "no"},
    ]
    settings = rig_settings(tmp_path / "data")
    settings = settings.model_copy(update={"activities": _quick(2)})
    async with running_rig(temporal_env.client, settings, script) as rig:
        first = await rig.client.send_message("ally", "call me Ally", turn_id="older")
        with pytest.raises(TurnFailed, match="tools_then_model failed"):
            await rig.client.send_message("ally", "actually Alice", turn_id="newer")
        # The reply is answered first; the failed turn then expires its diffs and ends.
        with pytest.raises(WorkflowFailureError):
            await asyncio.wait_for(turn_outcome(rig.client, "ally", "newer"), 60)
        older = await asyncio.wait_for(turn_outcome(rig.client, "ally", "older"), 60)
        assert [d.status for d in older.decisions] == [DiffStatus.SUPERSEDED]
        statuses = {d.id: d.status for d in DiffStore(rig.stack.engine).list("ally")}
        newer = next(d for d in statuses if d != first.diffs[0].id)
        assert statuses == {first.diffs[0].id: DiffStatus.SUPERSEDED, newer: DiffStatus.EXPIRED}
