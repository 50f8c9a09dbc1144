"""A turn's first activity prepares it and makes the first model call (patch
`one-activity-start`), and its other cheap steps run as local activities (patch
`local-turn-steps`): a plain reply runs one activity and no local one; a tool-using turn runs
the model calls as regular activities and the tools and the finish locally; a turn with
nothing to finish skips finish_turn; and what the steps store is all there (recall holds the
message, the tool results and the replies). Crashes inside them: tests/test_faults.py (a
SIGKILL at `before:`/`after:` each step and between prepare and the first model call),
tests/test_kill_campaign.py."""

from pathlib import Path
from typing import Any

from temporalio.testing import WorkflowEnvironment

from durable_memory.workflows.common import PENDING_DIFFS, USER_ID
from durable_memory.workflows.turn import STARTER_ATTRIBUTES
from tests.support.agent_helpers import edit_block
from tests.support.temporal_helpers import (
    local_activity_types,
    patch_ids,
    rig_settings,
    running_rig,
    scheduled_activity_types,
    upserted_search_attributes,
)

SEARCH: dict[str, Any] = {
    "content": [{"type": "tool_use", "name": "conversation_search", "input": {"query": "robots"}}]
}


async def _history_types(env: WorkflowEnvironment, workflow_id: str) -> tuple[list[str], ...]:
    history = await env.client.get_workflow_handle(workflow_id).fetch_history()
    return scheduled_activity_types(history.events), local_activity_types(history.events)


async def test_a_plain_reply_runs_one_activity_and_no_local_one(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    async with running_rig(
        temporal_env.client, rig_settings(tmp_path / "data"), [{"text": "Hello, Ada."}]
    ) as rig:
        reply = await rig.client.send_message("ada", "I like robots", turn_id="p1")
        assert reply.reply == "Hello, Ada."
        assert reply.diffs == []
        scheduled, local = await _history_types(temporal_env, reply.workflow_id)
        # Nothing proposed, no step limit: nothing to finish.
        assert scheduled == ["dmem.start_turn"]
        assert local == []
        found = rig.stack.recall.search("ada", "robots")
        assert found.total >= 1  # start_turn recorded the message
        assert rig.stack.recall.turn("ada", "p1")[-1].content == "Hello, Ada."


async def test_a_tool_turn_runs_the_tools_with_the_next_model_call_and_the_finish_locally(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    script = [
        SEARCH,
        {"content": [edit_block("student", field="name", operation="set", value="Ada")]},
        {"text": "Noted, Ada."},
    ]
    async with running_rig(temporal_env.client, rig_settings(tmp_path / "data"), script) as rig:
        reply = await rig.client.send_message("ada", "I'm Ada; robots again", turn_id="t1")
        assert reply.reply == "Noted, Ada."
        assert len(reply.diffs) == 1
        scheduled, local = await _history_types(temporal_env, reply.workflow_id)
        # Each step's tools run in the activity of the next model call (patch
        # tools-in-model-step); only finishing is local.
        assert scheduled == ["dmem.start_turn", "dmem.tools_then_model", "dmem.tools_then_model"]
        assert local == ["dmem.finish_turn"]
        # Each model call after a tool step saw that step's results (stored by run_tools).
        requests = rig.model_server.requests
        assert [m["role"] for m in requests[2]["messages"][-4:]] == [
            "assistant",
            "user",
            "assistant",
            "user",
        ]


async def test_a_turn_records_one_patch_marker_from_its_start_to_its_last_decision(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    """Under `turn-starter-attributes` a turn asks one patch, once: a plain turn, a
    tool-using turn and the decisions that close it add no other marker, nor the
    `TemporalChangeVersion` upsert the SDK adds to each patch (each an event the server
    writes on the reply's path); the search attributes operators read are all set, the
    profile goes with another upsert, never in one of its own, and the user, status and
    pending count the client set at the start are not upserted again in the first task."""
    script = [
        {"text": "Hello, Ada."},
        SEARCH,
        {"content": [edit_block("student", field="name", operation="set", value="Ada")]},
        {"text": "Noted, Ada."},
    ]
    async with running_rig(temporal_env.client, rig_settings(tmp_path / "data"), script) as rig:
        plain = await rig.client.send_message("ada", "hello", turn_id="p1")
        tools = await rig.client.send_message("ada", "I'm Ada; robots again", turn_id="t1")
        (diff,) = tools.diffs
        await rig.client.approve(diff.id, "ms-rivera")
        await temporal_env.client.get_workflow_handle(tools.workflow_id).result()
        for reply in (plain, tools):
            handle = temporal_env.client.get_workflow_handle(reply.workflow_id)
            events = (await handle.fetch_history()).events
            assert patch_ids(events) == [STARTER_ATTRIBUTES]
            upserts = upserted_search_attributes(events)
            assert upserts[0] == ["TemporalChangeVersion"]  # the first task's only upsert
            assert all("DmemUserId" not in u for u in upserts)  # set by the start alone
            attributes = (await handle.describe()).typed_search_attributes
            assert attributes.get(USER_ID) == "ada"
            assert attributes.get(PENDING_DIFFS) == 0  # the tool turn's diff: approved
            with_profile = [u for u in upserts if "DmemProfile" in u]
            assert len(with_profile) == 1
            assert with_profile[0] != ["DmemProfile"]  # it rode along with another upsert
            assert [u for u in upserts if "TemporalChangeVersion" in u] == [
                ["TemporalChangeVersion"]
            ]
            assert {a for u in upserts for a in u} >= {
                "DmemTurnStatus",
                "DmemPendingDiffs",
                "DmemProfile",
            }
        assert "DmemDiffIds" in {a for u in upserted_search_attributes(events) for a in u}
