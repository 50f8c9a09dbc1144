"""A turn's tool calls are answered by the tools the turn offered the model (its stored
context's), not by the user's profile as it is when the tools run: a profile changed meanwhile
(its tools, or a deploy's) applies from the next turn, as its model settings do. So the model
cannot call a tool its turn was not offered, a tool it was offered still answers, and a tool
step that reads no block opens no git transaction (in the distributed mode each is a round
trip to the git server, the tip check included). Two rigs on one database and one data dir
play the two sides of the change: the same profile name, other tools."""

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine

from durable_memory.memory.agent.llm import AnthropicModel
from durable_memory.memory.agent.steps import TurnSteps
from durable_memory.models.blocks import ToolSet
from durable_memory.models.diffs import DiffStatus
from durable_memory.models.recall import MessageRole
from durable_memory.models.turn import StepInput, TurnInput
from durable_memory.scripted_model import ScriptedModelServer
from tests.support.agent_helpers import tool_use, turn_steps
from tests.support.memory import MemoryRig, memory_rig
from tests.test_memory_tool import claude_profile

APPEND = tool_use("core_memory_append", label="notes", content="Likes tea")
SEARCH = tool_use("conversation_search", query="tea")


@contextmanager
def _sides(
    engine: Engine, data_dir: Path, script: list[dict[str, Any]], before: Any, after: Any
) -> Iterator[tuple[tuple[MemoryRig, TurnSteps], tuple[MemoryRig, TurnSteps], list[Any]]]:
    """Steps on a rig whose profile is `before` and on one whose profile (same name) is
    `after`, one scripted model behind both; and the requests the model got."""
    with ScriptedModelServer(script) as server:
        model = AnthropicModel(base_url=server.url)
        try:
            rigs = [memory_rig(engine, data_dir, profile) for profile in (before, after)]
            old, new = ((rig, turn_steps(rig, engine, model)) for rig in rigs)
            yield old, new, server.requests
        finally:
            model.close()


def _first_step(steps: TurnSteps, turn_id: str) -> StepInput:
    """Prepare a turn of alice's and make its first model call (it asks for tools)."""
    steps.prepare(TurnInput(user_id="alice", turn_id=turn_id, message="hi"))
    step = StepInput(user_id="alice", turn_id=turn_id, step=1)
    assert steps.call_model(step).tool_calls == 1
    return step


def _result(memory: MemoryRig, turn_id: str) -> tuple[str, bool]:
    (result,) = [
        m for m in memory.recall.turn("alice", turn_id) if m.role is MessageRole.TOOL_RESULT
    ]
    return result.content, result.is_error


def test_a_tool_the_turn_was_not_offered_is_refused_though_the_profile_now_offers_it(
    engine: Engine, data_dir: Path
) -> None:
    script: list[dict[str, Any]] = [{"content": [APPEND]}]
    only_memory, with_letta = claude_profile(), claude_profile(ToolSet.LETTA)
    with _sides(engine, data_dir, script, only_memory, with_letta) as (old, new, requests):
        step = _first_step(old[1], "t1")
        head = new[0].git.head("alice")
        assert new[1].run_tools(step).diff_ids == []

    offered = [tool.get("name") for tool in requests[0]["tools"]]
    assert "core_memory_append" not in offered
    content, is_error = _result(new[0], "t1")
    assert is_error
    assert content.startswith("unknown tool 'core_memory_append'")
    assert new[0].diffs.list("alice") == []
    assert new[0].git.head("alice") == head


def test_a_tool_the_turn_was_offered_answers_though_the_profile_no_longer_offers_it(
    engine: Engine, data_dir: Path
) -> None:
    script: list[dict[str, Any]] = [{"content": [APPEND]}, {"text": "Noted."}, {"text": "Hi."}]
    with_letta, only_memory = claude_profile(ToolSet.LETTA), claude_profile()
    with _sides(engine, data_dir, script, with_letta, only_memory) as (old, new, requests):
        step = _first_step(old[1], "t1")
        (diff_id,) = new[1].run_tools(step).diff_ids
        after = StepInput(user_id="alice", turn_id="t1", step=2)
        assert new[1].call_model(after).text == "Noted."
        # The next turn is offered what the profile offers now.
        new[1].prepare(TurnInput(user_id="alice", turn_id="t2", message="hello"))
        new[1].call_model(StepInput(user_id="alice", turn_id="t2", step=1))

    content, is_error = _result(new[0], "t1")
    assert not is_error
    assert diff_id in content
    assert new[0].diffs.get(diff_id, "alice").status is DiffStatus.PENDING
    offered = [[tool.get("name") for tool in request["tools"]] for request in requests]
    assert offered[0] == offered[1]
    assert "core_memory_append" in offered[0]
    assert "core_memory_append" not in offered[2]
    assert "memory" in offered[2]


@pytest.mark.parametrize(
    ("call", "transactions"),
    [(SEARCH, 0), (tool_use("memory", command="view", path="/memories"), 1)],
    ids=["search", "memory-view"],
)
def test_a_tool_step_opens_git_only_for_the_blocks_its_tools_read(
    engine: Engine,
    data_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    call: dict[str, Any],
    transactions: int,
) -> None:
    script: list[dict[str, Any]] = [{"content": [call]}]
    profile = claude_profile(ToolSet.CLAUDE_MEMORY, ToolSet.LETTA)
    with _sides(engine, data_dir, script, profile, profile) as ((memory, steps), _, _requests):
        step = _first_step(steps, "t1")
        opened = _count_calls(monkeypatch, memory.git, "transaction")
        steps.run_tools(step)
    assert _result(memory, "t1")[1] is False
    assert opened() == transactions


def _count_calls(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> Callable[[], int]:
    """Count the calls of `owner.name` from now on (it still runs)."""
    calls: list[None] = []
    method = getattr(owner, name)

    def counted(*args: Any, **kwargs: Any) -> AbstractContextManager[Any]:
        calls.append(None)
        found: AbstractContextManager[Any] = method(*args, **kwargs)
        return found

    monkeypatch.setattr(owner, name, counted)
    return lambda: len(calls)
