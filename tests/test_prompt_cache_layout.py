"""The request layout pays for itself with Anthropic's prompt cache: through the real SDK
against the scripted server, which accounts usage by the documented caching rules.

Breakpoints sit after the instructions (tools before them), after the memory blocks, after
the turn's user message and at the end of the conversation so far; the turn note (what
changes every turn) comes after the last one. So a later step of a turn and the next turn
read everything the previous request cached, and re-compiled blocks (an approval with
per-turn blocks, or the prompt base moving: test_prompt_cache_base.py) invalidate from the
blocks on only, once.
"""

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine

from durable_memory.memory.agent.context import TURN_NOTE_START, compile_context, model_request
from durable_memory.memory.agent.steps import TurnSteps
from durable_memory.memory.agent.tool_specs import tool_definitions
from durable_memory.memory.store.db import make_engine
from durable_memory.memory.store.summaries import SummaryStore
from durable_memory.models.llm import MAX_CACHE_BREAKPOINTS
from durable_memory.models.turn import StepInput, TurnInput
from durable_memory.scripted_model import ScriptedModelServer, cache_blocks
from tests.support.agent_helpers import (
    TurnResult,
    agent_test_profile,
    run_turn_steps,
    scripted_steps,
    tool_use,
)
from tests.support.memory import MemoryRig, memory_rig

NOTE_EDIT = tool_use("core_memory_append", label="notes", content="Has a cat")
SEARCH = tool_use("conversation_search", query="tea")


def _memory(tmp_path: Path, **model: Any) -> tuple[MemoryRig, Engine]:
    engine = make_engine(f"sqlite:///{tmp_path / 'm.db'}")
    memory = memory_rig(engine, tmp_path / "data", agent_test_profile(**model))
    memory.blocks.ensure_user("alice")
    return memory, engine


Rig = tuple[MemoryRig, Engine, TurnSteps, ScriptedModelServer]


@pytest.fixture
def rig(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Rig]:
    memory, engine = _memory(tmp_path, **getattr(request, "param", {}))
    with scripted_steps(memory, engine, []) as (steps, server):
        yield memory, engine, steps, server
    engine.dispose()


def _turn(
    steps: TurnSteps, server: ScriptedModelServer, n: int, *replies: dict[str, Any]
) -> TurnResult:
    server.extend(replies)
    turn = TurnInput(user_id="alice", turn_id=f"t{n}", message=f"message {n}")
    return run_turn_steps(steps, turn, max_steps=8)


def _markers(request: dict[str, Any]) -> list[tuple[str, int, int]]:
    """Where a recorded request's breakpoints are: (part, message or block index, block)."""
    found = [("system", i, 0) for i, b in enumerate(request["system"]) if "cache_control" in b]
    for m, message in enumerate(request["messages"]):
        found += [
            ("messages", m, b)
            for b, block in enumerate(message["content"])
            if "cache_control" in block
        ]
    return found


def _through(request: dict[str, Any], count: int) -> int:
    """Tokens of a request's first `count` blocks (tools, system, messages), as the server counts."""
    return sum(b.tokens for b in cache_blocks(request)[:count])


def test_breakpoints_sit_where_they_pay_and_the_turn_note_comes_last(
    rig: Rig,
) -> None:
    _, _, steps, server = rig
    _turn(steps, server, 1, {"content": [SEARCH]}, {"text": "done"})
    first, second = server.requests
    user = len(first["messages"]) - 1
    assert _markers(first) == [("system", 0, 0), ("system", 1, 0), ("messages", user, 0)]
    assert [b["text"].startswith(TURN_NOTE_START) for b in first["messages"][user]["content"]] == [
        False,
        True,
    ]
    # The next step: the turn's user message keeps its breakpoint, the tool result gets the
    # conversation's; the note moves to the end of the newest user turn.
    last = len(second["messages"]) - 1
    assert _markers(second) == [
        ("system", 0, 0),
        ("system", 1, 0),
        ("messages", user, 0),
        ("messages", last, 0),
    ]
    assert len(_markers(second)) <= MAX_CACHE_BREAKPOINTS
    assert second["messages"][user]["content"] == first["messages"][user]["content"][:1]
    assert second["messages"][last]["content"][-1]["text"].startswith(TURN_NOTE_START)
    assert first["system"][0]["cache_control"] == {"type": "ephemeral", "ttl": "5m"}
    assert all(TURN_NOTE_START not in b["text"] for b in first["system"])


def test_a_later_step_and_the_next_turn_read_everything_the_previous_request_cached(
    rig: Rig,
) -> None:
    _, _, steps, server = rig
    usage = [
        *_turn(steps, server, 1, {"content": [SEARCH]}, {"text": "done"}).usage,
        *_turn(steps, server, 2, {"text": "hello again"}).usage,
        *_turn(steps, server, 3, {"content": [SEARCH]}, {"text": "found it"}).usage,
    ]
    assert len(usage) == len(server.requests) == 5
    assert usage[0].cache_read_input_tokens == 0
    for before, after, request in zip(usage[:-1], usage[1:], server.requests[1:], strict=True):
        assert after.cache_read_input_tokens == (
            before.cache_read_input_tokens + before.cache_creation_input_tokens
        )
        # Uncached: only the turn note, after the last breakpoint.
        assert after.input_tokens == cache_blocks(request)[-1].tokens
    # The system prompt, tools and instructions are byte-identical across all of them.
    assert len({repr((r["tools"], r["system"])) for r in server.requests}) == 1


@pytest.mark.parametrize("rig", [{"memory_delta": False}], indirect=True)
def test_when_the_blocks_are_recompiled_an_approval_invalidates_from_them_on_once(
    rig: Rig,
) -> None:
    """With per-turn blocks (and whenever the prompt base moves: test_prompt_cache_base.py)."""
    memory, _, steps, server = rig
    proposed = _turn(steps, server, 1, {"content": [NOTE_EDIT]}, {"text": "noted"})
    _turn(steps, server, 2, {"text": "ok"})
    memory.review.approve(proposed.diff_ids[0], "ann", user_id="alice")
    after_approval = _turn(steps, server, 3, {"text": "ok"}).usage[0]
    request = server.requests[-1]
    tools_and_instructions = _through(request, len(request["tools"]) + 1)
    assert after_approval.cache_read_input_tokens == tools_and_instructions
    assert "Has a cat" in request["system"][1]["text"]
    # Paid once: the next turn reads the new blocks again.
    following = _turn(steps, server, 4, {"text": "ok"}).usage[0]
    assert following.cache_read_input_tokens == (
        after_approval.cache_read_input_tokens + after_approval.cache_creation_input_tokens
    )


def test_a_decision_during_a_turn_takes_effect_from_the_next_turn(
    rig: Rig,
) -> None:
    memory, engine, steps, server = rig
    server.extend([{"content": [NOTE_EDIT]}, {"text": "noted"}])
    turn = TurnInput(user_id="alice", turn_id="t1", message="I have a cat")
    steps.prepare(turn)
    step1 = StepInput(user_id="alice", turn_id="t1", step=1)
    steps.call_model(step1)
    diff_id = steps.run_tools(step1).diff_ids[0]
    memory.review.approve(diff_id, "ann", user_id="alice")
    second = steps.call_model(StepInput(user_id="alice", turn_id="t1", step=2))
    first_request, second_request = server.requests
    assert second_request["system"] == first_request["system"]
    assert "Has a cat" not in second_request["system"][1]["text"]
    assert second.usage.cache_read_input_tokens > 0
    context = compile_context(memory.sources(SummaryStore(engine)), "alice", tool_definitions())
    assert "Has a cat" in context.system


def test_the_layout_is_the_same_bytes_for_the_same_state(tmp_path: Path) -> None:
    memory, engine = _memory(tmp_path)
    sources = memory.sources(SummaryStore(engine))
    one = model_request(compile_context(sources, "alice", tool_definitions()), [], "5m")
    two = model_request(compile_context(sources, "alice", tool_definitions()), [], "5m")
    assert one.model_dump_json() == two.model_dump_json()


@pytest.mark.parametrize(
    ("ttl", "expected"), [("1h", {"type": "ephemeral", "ttl": "1h"}), ("off", None)]
)
def test_the_profile_chooses_the_ttl_or_no_caching(
    tmp_path: Path, ttl: str, expected: dict[str, str] | None
) -> None:
    memory, engine = _memory(tmp_path, cache_ttl=ttl)
    with scripted_steps(memory, engine, [{"text": "hi"}, {"text": "hi"}]) as (steps, server):
        for n in (1, 2):
            run_turn_steps(steps, TurnInput(user_id="alice", turn_id=f"t{n}", message="hi"), 8)
        requests = server.requests
    engine.dispose()
    markers = [
        block["cache_control"]
        for request in requests
        for block in [*request["system"], *(b for m in request["messages"] for b in m["content"])]
        if "cache_control" in block
    ]
    if expected is None:
        assert markers == []
    else:
        assert markers
        assert all(m == expected for m in markers)
