"""Huge input through a real turn: a model reply or tool call far over every limit (only a
misbehaving server sends one) is bounded where it enters our stores and payloads, so the turn
completes with a labelled cut or a tool error the model can act on; nothing retries, the
worker lives, the user's memory is unchanged and the next turn succeeds.

Before this, a reply over recall's limit failed the recall write on every retry of the model
step, and the turn never answered."""

from pathlib import Path
from typing import Any

import pytest
from temporalio.testing import WorkflowEnvironment

from durable_memory.client import TurnFailed
from durable_memory.memory.agent.steps import TurnPositions
from durable_memory.models.limits import MAX_REPLY_TEXT_CHARS, MAX_TOOL_CALLS_PER_REPLY
from durable_memory.models.recall import MessageRole
from tests.support.agent_helpers import edit_block
from tests.support.snapshots import snapshot
from tests.support.temporal_helpers import rig_settings, running_rig, turn_outcome

HUGE = 2_000_000


async def test_a_reply_over_every_limit_is_cut_and_labelled(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    # 250k characters of é overflow the context window: the next turn summarises them first.
    script = [{"text": "é" * HUGE}, {"text": "a summary"}, {"text": "back to normal"}]
    async with running_rig(temporal_env.client, rig_settings(tmp_path / "data"), script) as rig:
        reply = await rig.client.send_message("alice", "write a lot", turn_id="t1")
        assert len(reply.reply) < MAX_REPLY_TEXT_CHARS + 100
        assert reply.reply.endswith(
            f"[... cut: {HUGE - MAX_REPLY_TEXT_CHARS} more characters not shown]"
        )
        stored = rig.stack.recall.turn("alice", "t1", 0)
        assert [m.content for m in stored if m.role is MessageRole.ASSISTANT] == [reply.reply]
        assert len(rig.model_server.requests) == 1  # not retried
        again = await rig.client.send_message("alice", "and now?", turn_id="t2")
        assert again.reply == "back to normal"


async def test_a_tool_call_over_every_limit_gets_a_tool_error(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    huge_edit: dict[str, Any] = {
        "content": [
            {
                "type": "tool_use",
                "name": "archival_memory_insert",
                "input": {"content": "x" * HUGE, "tags": ["y" * HUGE]},
            }
        ]
    }
    script = [huge_edit, {"text": "sorry, that was too long"}, {"text": "fine"}]
    async with running_rig(temporal_env.client, rig_settings(tmp_path / "data"), script) as rig:
        rig.stack.blocks.ensure_user("alice")
        before = snapshot(rig.stack)["repos"]
        reply = await rig.client.send_message("alice", "remember this", turn_id="t1")
        assert reply.reply == "sorry, that was too long"
        assert reply.diffs == []
        stored = rig.stack.recall.turn("alice", "t1", 0)
        call = next(m for m in stored if m.role is MessageRole.TOOL_CALL)
        result = next(m for m in stored if m.role is MessageRole.TOOL_RESULT)
        assert "refused_input" in call.content
        assert len(call.content) < 1_000
        assert result.is_error
        assert "over the limit" in result.content
        # The second model call saw the error as the tool's result, not the huge input.
        second = rig.model_server.requests[1]
        assert "over the limit" in str(second["messages"][-1])
        assert len(str(second)) < HUGE
        assert rig.stack.archive.count("alice") == 0
        assert snapshot(rig.stack)["repos"] == before
        outcome = await turn_outcome(rig.client, "alice", "t1")
        assert outcome.reply == "sorry, that was too long"
        again = await rig.client.send_message("alice", "ok?", turn_id="t2")
        assert again.reply == "fine"


async def test_a_reply_with_more_tool_calls_than_recall_holds_fails_its_step(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    """A reply's tool calls and their results have fixed places in recall; one asking for more
    would write results over the next step's rows. The step fails with one clear error, nothing
    of the reply is stored, no retry pays for the call again, and the next turn is whole."""
    assert MAX_TOOL_CALLS_PER_REPLY < TurnPositions.RESULT_OFFSET
    call = {"type": "tool_use", "name": "conversation_search", "input": {"query": "x"}}
    flood = {"content": [call] * (MAX_TOOL_CALLS_PER_REPLY + 1)}
    script: list[dict[str, Any]] = [flood, {"text": "fine"}]
    async with running_rig(temporal_env.client, rig_settings(tmp_path / "data"), script) as rig:
        rig.stack.blocks.ensure_user("alice")
        before = snapshot(rig.stack)["repos"]
        with pytest.raises(TurnFailed, match="tool calls in one reply") as failed:
            await rig.client.send_message("alice", "search a lot", turn_id="t1")
        assert "dmem.start_turn" in str(failed.value)  # the first model call's step
        stored = rig.stack.recall.turn("alice", "t1", 0)
        assert [m.role for m in stored] == [MessageRole.USER]
        assert len(rig.model_server.requests) == 1
        again = await rig.client.send_message("alice", "and now?", turn_id="t2")
        assert again.reply == "fine"
        assert snapshot(rig.stack)["repos"] == before


@pytest.mark.parametrize(
    "ids", [["", "toolu_b"], ["toolu_a", "toolu_a"]], ids=["empty", "repeated"]
)
async def test_a_reply_whose_tool_call_ids_are_empty_or_repeated_fails_its_step(
    temporal_env: WorkflowEnvironment, tmp_path: Path, ids: list[str]
) -> None:
    """A diff's id derives from its tool call's id, and a step reports the diffs found under
    those ids: a call without an id, or two calls sharing one, would leave a proposal no turn
    reports or waits for. The step fails with one clear error, nothing of the reply stored."""
    edit = edit_block("student", field="name", operation="set", value="Eve")
    calls = [{**edit, "id": ids[0]}, {**edit, "id": ids[1]}]
    script: list[dict[str, Any]] = [{"content": calls}, {"text": "fine"}]
    async with running_rig(temporal_env.client, rig_settings(tmp_path / "data"), script) as rig:
        rig.stack.blocks.ensure_user("alice")
        before = snapshot(rig.stack)
        with pytest.raises(TurnFailed, match="id is empty or repeats another's"):
            await rig.client.send_message("alice", "I'm Eve", turn_id="t1")
        assert [m.role for m in rig.stack.recall.turn("alice", "t1", 0)] == [MessageRole.USER]
        assert rig.stack.review.pending("alice") == []
        assert len(rig.model_server.requests) == 1  # refused, not asked again
        again = await rig.client.send_message("alice", "and now?", turn_id="t2")
        assert again.reply == "fine"
        assert snapshot(rig.stack)["repos"] == before["repos"]


async def test_a_tool_call_id_an_earlier_step_used_fails_its_step(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    """A second step's edit reusing the first step's call id would be taken for that call's
    diff (proposing again under an id returns the diff stored under it): the edit silently
    lost. The step fails instead, its reply not stored, and nothing is proposed."""
    search = {"type": "tool_use", "id": "toolu_a", "name": "conversation_search"}
    edit = edit_block("student", field="name", operation="set", value="Eve")
    script: list[dict[str, Any]] = [
        {"content": [{**search, "input": {"query": "x"}}]},
        {"content": [{**edit, "id": "toolu_a"}]},
        {"text": "fine"},
    ]
    async with running_rig(temporal_env.client, rig_settings(tmp_path / "data"), script) as rig:
        rig.stack.blocks.ensure_user("alice")
        with pytest.raises(TurnFailed, match=r"dmem\.tools_then_model failed: .*repeats another's"):
            await rig.client.send_message("alice", "I'm Eve", turn_id="t1")
        stored = [m.seq for m in rig.stack.recall.turn("alice", "t1", 0)]
        assert stored == [0, 1000, 1500]  # the message, step 1's call and its result
        assert rig.stack.review.pending("alice") == []
        again = await rig.client.send_message("alice", "and now?", turn_id="t2")
        assert again.reply == "fine"
