"""Helpers for running turns through the real SDK against the scripted model server."""

import contextlib
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Engine

from durable_memory.memory.agent.context import MEMORY_UPDATE_START, TURN_NOTE_START
from durable_memory.memory.agent.llm import AnthropicModel
from durable_memory.memory.agent.steps import ChatModel, TurnSteps, turn_reply
from durable_memory.memory.agent.tools import MemoryTools
from durable_memory.memory.archive.protocol import ArchiveStore
from durable_memory.memory.core.profiles import parse_profile
from durable_memory.memory.store.summaries import SummaryStore
from durable_memory.memory.store.turns import TurnStore
from durable_memory.models.blocks import AgentProfile
from durable_memory.models.llm import TokenUsage
from durable_memory.models.turn import FinishInput, StepInput, TurnInput
from durable_memory.scripted_model import ScriptedModelServer
from tests.support.memory import MemoryRig

TEST_PROFILE = """
name = "tools-test"
[persona]
name = "Tester"
role = "test agent"
instructions = "You are a test agent with memory."
[model]
name = "claude-sonnet-4-6"
max_tokens = 512
context_window = 200000

[[blocks]]
label = "persona"
kind = "persona"
preset = "default"
description = "Who you are."
limit = 1500
read_only = true

[[blocks]]
label = "notes"
kind = "text"
description = "Free-form notes about the user."
limit = 200
[blocks.default]
value = "Likes tea\\nLives in Lyon\\nLikes tea with lemon"

[[blocks]]
label = "student"
kind = "fields"
description = "Who the student is."
limit = 500
[[blocks.fields]]
name = "name"
type = "str"
[[blocks.fields]]
name = "strengths"
type = "list[str]"
max_items = 2
[[blocks.fields]]
name = "stage"
type = "enum"
choices = ["exploring", "drafting"]
default = "exploring"
required = true

[[blocks]]
label = "human"
kind = "human"
description = "The user."
limit = 1500
"""


def agent_test_profile(**model: Any) -> AgentProfile:
    profile = parse_profile(TEST_PROFILE, "tests/support/agent_helpers.py")
    if model:
        return profile.model_copy(update={"model": profile.model.model_copy(update=model)})
    return profile


def tool_use(name: str, **arguments: Any) -> dict[str, Any]:
    return {"type": "tool_use", "name": name, "input": arguments}


@dataclass(frozen=True)
class TurnResult:
    reply: str
    diff_ids: list[str]
    steps: int
    stopped_at_step_limit: bool
    usage: list[TokenUsage]
    """Each model call's, in order."""


def run_turn_steps(steps: TurnSteps, turn: TurnInput, max_steps: int) -> TurnResult:
    """A turn without Temporal: the steps in the order TurnWorkflow runs them as activities,
    with the step limit its worker's settings would give it."""
    steps.prepare(turn)
    diff_ids: list[str] = []
    text, stopped, step = "", True, 0
    usage: list[TokenUsage] = []
    for step in range(1, max_steps + 1):
        where = StepInput(user_id=turn.user_id, turn_id=turn.turn_id, step=step)
        result = steps.call_model(where)
        text = result.text
        usage.append(result.usage)
        if result.tool_calls == 0:
            stopped = False
            break
        diff_ids.extend(steps.run_tools(where).diff_ids)
    steps.finish(
        FinishInput(
            user_id=turn.user_id,
            turn_id=turn.turn_id,
            diff_ids=diff_ids,
            stopped_at_step_limit=stopped,
            max_steps=max_steps,
        )
    )
    return TurnResult(turn_reply(text, stopped, max_steps), diff_ids, step, stopped, usage)


@contextlib.contextmanager
def scripted_steps(
    memory: MemoryRig,
    engine: Engine,
    script: list[dict[str, Any]],
    archive: ArchiveStore | None = None,
) -> Iterator[tuple[TurnSteps, ScriptedModelServer]]:
    """A turn's steps on `memory`, calling the real SDK against a server playing `script`."""
    with ScriptedModelServer(script) as server:
        model = AnthropicModel(base_url=server.url)
        try:
            yield turn_steps(memory, engine, model, archive), server
        finally:
            model.close()


def turn_steps(
    memory: MemoryRig, engine: Engine, model: ChatModel, archive: ArchiveStore | None = None
) -> TurnSteps:
    """A turn's steps on `memory`, calling `model`."""
    tools = MemoryTools(memory.blocks, memory.review, memory.recall, archive)
    sources = memory.sources(SummaryStore(engine))
    return TurnSteps(sources, archive, tools, model, TurnStore(engine))


def run_scripted_turn(
    memory: MemoryRig,
    engine: Engine,
    script: list[dict[str, Any]],
    message: str,
    *,
    user_id: str = "alice",
    turn_id: str = "t1",
    archive: ArchiveStore | None = None,
    max_steps: int = 8,
) -> tuple[TurnResult, list[dict[str, Any]]]:
    with scripted_steps(memory, engine, script, archive) as (steps, server):
        turn = TurnInput(user_id=user_id, turn_id=turn_id, message=message)
        return run_turn_steps(steps, turn, max_steps), server.requests


def said_texts(message: dict[str, Any]) -> list[str]:
    """The text blocks of a recorded request's message as its speaker wrote them: the memory
    update and the turn note the context compiler adds to the newest user turn left out."""
    content = message.get("content")
    blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content or []
    return [
        b["text"]
        for b in blocks
        if b.get("type") == "text"
        and not b["text"].startswith((TURN_NOTE_START, MEMORY_UPDATE_START))
    ]


def tool_results(request: dict[str, Any]) -> list[dict[str, Any]]:
    """The tool_result blocks of the last user message of a recorded request."""
    last = request["messages"][-1]
    assert last["role"] == "user"
    return [b for b in last["content"] if b["type"] == "tool_result"]


def edit_block(label: str, why: str = "r", **fields: Any) -> dict[str, Any]:
    """An edit_memory_block tool call (`field`, `operation`, `value` as keyword arguments)."""
    return tool_use("edit_memory_block", label=label, reasoning=why, **fields)


def git_status(repo: Path) -> str:
    """`git status --porcelain` of a user's repository: empty when the working tree is clean."""
    return subprocess.run(
        ["git", "-C", str(repo), "status", "--porcelain"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
