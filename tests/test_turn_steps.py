"""The turn's steps driven directly, without Temporal: where each step puts its messages in
recall, and that a retried step (the activity run again after a crash) reuses what the first
attempt stored instead of calling the model again or adding rows or diffs."""

from typing import Any

from sqlalchemy import Engine

from durable_memory.memory.agent.steps import TurnPositions
from durable_memory.memory.store.turns import TurnStore
from durable_memory.models.recall import MessageRole
from durable_memory.models.turn import StepInput, TurnInput
from tests.support.agent_helpers import (
    edit_block,
    run_scripted_turn,
    scripted_steps,
    tool_use,
)
from tests.support.memory import MemoryRig

SEARCH = tool_use("conversation_search", query="essay")
PROPOSE = edit_block("human", operation="learn_preference", value="Socratic questions")


def _positions(memory: MemoryRig, turn_id: str) -> list[tuple[int, MessageRole]]:
    return [(m.seq, m.role) for m in memory.recall.turn("alice", turn_id)]


def test_each_step_writes_at_its_positions(memory: MemoryRig, engine: Engine) -> None:
    script: list[dict[str, Any]] = [
        {"content": [{"type": "text", "text": "Let me look."}, SEARCH]},
        {"text": "Found nothing."},
    ]
    result, _ = run_scripted_turn(memory, engine, script, "hello")
    assert (result.reply, result.steps) == ("Found nothing.", 2)
    assert _positions(memory, "t1") == [
        (TurnPositions.USER, MessageRole.USER),
        (1000, MessageRole.ASSISTANT),
        (1001, MessageRole.TOOL_CALL),
        (1500, MessageRole.TOOL_RESULT),
        (2000, MessageRole.ASSISTANT),
    ]
    assert (TurnPositions.reply_seq(2), TurnPositions.results_seq(1)) == (2000, 1500)


def test_a_step_limit_note_goes_after_every_step(memory: MemoryRig, engine: Engine) -> None:
    result, _ = run_scripted_turn(memory, engine, [{"content": [SEARCH]}], "hi", max_steps=1)
    assert result.stopped_at_step_limit
    assert result.reply.startswith("[stopped after 1 model steps")
    assert _positions(memory, "t1")[-1] == (TurnPositions.STEP_LIMIT_NOTE, MessageRole.ASSISTANT)
    assert TurnPositions.STEP_LIMIT_NOTE == 999_000


def test_retried_steps_reuse_what_the_first_attempt_stored(
    memory: MemoryRig, engine: Engine
) -> None:
    turn = TurnInput(user_id="alice", turn_id="t1", message="I write essays")
    step = StepInput(user_id="alice", turn_id="t1", step=1)
    with scripted_steps(memory, engine, [{"content": [PROPOSE]}]) as (steps, server):
        assert steps.prepare(turn) == steps.prepare(turn)
        context = TurnStore(engine).context("alice", "t1")
        first = steps.call_model(step)
        assert steps.call_model(step) == first
        assert len(server.requests) == 1  # the retry did not call the model again
        proposed = steps.run_tools(step)
        assert steps.run_tools(step) == proposed
        assert len(proposed.diff_ids) == 1
    assert TurnStore(engine).context("alice", "t1") == context
    assert len(memory.diffs.list("alice")) == 1
    assert _positions(memory, "t1") == [
        (0, MessageRole.USER),
        (1000, MessageRole.TOOL_CALL),
        (1500, MessageRole.TOOL_RESULT),
    ]
