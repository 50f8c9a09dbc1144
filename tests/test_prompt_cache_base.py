"""The prompt base: an approved edit comes as a memory update in the newest user turn, and
the cached system prompt and conversation stay as they were, until the base moves to HEAD
(the cache went cold, the update passed its bound, a new summary, the profile turns it off).

Through the real SDK against the scripted server, which accounts the cache by Anthropic's
documented rules; the base is read from the database, as every worker reads it.
"""

import subprocess
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine

from durable_memory.memory.agent.context import (
    MEMORY_UPDATE_START,
    TURN_NOTE_START,
    compile_context,
    model_request,
)
from durable_memory.memory.agent.steps import TurnSteps, turn_context
from durable_memory.memory.agent.tool_specs import tool_definitions
from durable_memory.memory.store.db import make_engine
from durable_memory.memory.store.summaries import SummaryStore
from durable_memory.memory.store.turns import PromptBaseStore
from durable_memory.models.context import PromptBase
from durable_memory.models.history import Author, AuthorKind
from durable_memory.models.llm import TokenUsage
from durable_memory.models.recall import MessageRole, NewMessage
from durable_memory.models.turn import TurnInput
from durable_memory.scripted_model import ScriptedModelServer, cache_blocks
from tests.support.agent_helpers import (
    TurnResult,
    agent_test_profile,
    run_turn_steps,
    scripted_steps,
    tool_use,
)
from tests.support.memory import MemoryRig, memory_rig


def create_engine_like(engine: Engine) -> Engine:
    """Another process's engine on the same database."""
    return make_engine(engine.url.render_as_string(hide_password=False))


NOTE_EDIT = tool_use("core_memory_append", label="notes", content="Has a cat")
ANN = Author(name="ann", kind=AuthorKind.USER)
ROOMY = {"memory_delta_max_share": 4.0}
"""The test profile's blocks are small: a bound the notes block's update stays under."""

Rig = tuple[MemoryRig, Engine, TurnSteps, ScriptedModelServer]


def _memory(data: Path, engine: Engine | None, **model: Any) -> tuple[MemoryRig, Engine]:
    engine = engine or make_engine(f"sqlite:///{data / 'm.db'}")
    memory = memory_rig(engine, data / "data", agent_test_profile(**model))
    memory.blocks.ensure_user("alice")
    return memory, engine


@pytest.fixture
def rig(tmp_path: Path, engine: Engine, request: pytest.FixtureRequest) -> Iterator[Rig]:
    """On SQLite and PostgreSQL (conftest's `engine`): the base and the reply times are rows."""
    memory, _ = _memory(tmp_path, engine, **getattr(request, "param", ROOMY))
    with scripted_steps(memory, engine, []) as (steps, server):
        yield memory, engine, steps, server


def _turn(
    steps: TurnSteps, server: ScriptedModelServer, n: int, *replies: dict[str, Any]
) -> TurnResult:
    server.extend(replies)
    return run_turn_steps(steps, TurnInput(user_id="alice", turn_id=f"t{n}", message=f"m{n}"), 8)


def _tail(request: dict[str, Any]) -> list[str]:
    """The texts after the newest user turn's own text: the memory update and the turn note."""
    return [b["text"] for b in request["messages"][-1]["content"][1:]]


def _approved_between_turns(
    memory: MemoryRig, steps: TurnSteps, server: ScriptedModelServer
) -> tuple[str, TokenUsage]:
    """Turn 1 proposes "Has a cat", turn 2 follows, a person approves it: the new HEAD, and
    turn 2's usage."""
    proposed = _turn(steps, server, 1, {"content": [NOTE_EDIT]}, {"text": "noted"})
    (usage,) = _turn(steps, server, 2, {"text": "ok"}).usage
    memory.review.approve(proposed.diff_ids[0], "ann", user_id="alice")
    head = memory.blocks.last_change("alice")
    assert head is not None
    return head.sha, usage


def test_an_approval_comes_as_a_memory_update_and_the_cached_conversation_is_read(
    rig: Rig,
) -> None:
    memory, engine, steps, server = rig
    head, before = _approved_between_turns(memory, steps, server)
    previous = server.requests[-1]
    (usage,) = _turn(steps, server, 3, {"text": "ok"}).usage
    request = server.requests[-1]
    # The system prompt is the one turn 2 sent, byte for byte; the update says what is current.
    assert request["system"] == previous["system"]
    assert "Has a cat" not in request["system"][1]["text"]
    update, note = _tail(request)
    assert update.startswith(MEMORY_UPDATE_START)
    assert note.startswith(TURN_NOTE_START)
    assert "it replaces what the system prompt's memory blocks show for them" in update
    assert "<notes>" in update
    assert "Has a cat" in update
    assert "<persona>" not in update
    # Everything turn 2 cached is read; only the update and the note are sent uncached.
    assert usage.cache_read_input_tokens == (
        before.cache_read_input_tokens + before.cache_creation_input_tokens
    )
    assert usage.input_tokens == sum(b.tokens for b in cache_blocks(request)[-2:])
    # The base stays where it was; the next turn carries the same update.
    base = PromptBaseStore(engine).get("alice")
    assert base is not None
    assert base.commit != head
    _turn(steps, server, 4, {"text": "ok"})
    assert _tail(server.requests[-1])[0] == update


def test_a_cold_cache_moves_the_base_to_head_and_the_update_goes(rig: Rig) -> None:
    memory, engine, steps, server = rig
    head, _ = _approved_between_turns(memory, steps, server)
    _turn(steps, server, 3, {"text": "ok"})
    assert len(_tail(server.requests[-1])) == 2
    ttl = timedelta(minutes=5)  # the profile's cache_ttl
    later = TurnSteps(
        steps.sources,
        steps.archive,
        steps.tools,
        steps.model,
        steps.turns,
        clock=lambda: datetime.now(UTC) + ttl + timedelta(seconds=30),
    )
    _turn(later, server, 4, {"text": "ok"})
    request = server.requests[-1]
    assert "Has a cat" in request["system"][1]["text"]
    assert [t[: len(TURN_NOTE_START)] for t in _tail(request)] == [TURN_NOTE_START]
    assert PromptBaseStore(engine).get("alice") == PromptBase(
        commit=head, summarized_through_message_id=0
    )
    # The next warm turn builds on the new base: the same system prompt, no update.
    _turn(steps, server, 5, {"text": "ok"})
    assert server.requests[-1]["system"] == request["system"]
    assert len(_tail(server.requests[-1])) == 1


@pytest.mark.parametrize(
    ("rig", "shown_as_update"),
    [
        (ROOMY, True),
        ({"memory_delta_max_share": 0.1}, False),  # the update passes the bound
        ({}, False),  # the default bound, 0.5, is less than the notes block's update here
        ({"memory_delta": False, **ROOMY}, False),
        ({"cache_ttl": "off", **ROOMY}, False),  # nothing cached: nothing to keep
    ],
    indirect=["rig"],
)
def test_the_profile_and_the_bound_decide_when_the_base_moves(
    rig: Rig, shown_as_update: bool
) -> None:
    memory, engine, steps, server = rig
    head, _ = _approved_between_turns(memory, steps, server)
    _turn(steps, server, 3, {"text": "ok"})
    request = server.requests[-1]
    assert ("Has a cat" in request["system"][1]["text"]) is not shown_as_update
    assert (len(_tail(request)) == 2) is shown_as_update
    base = PromptBaseStore(engine).get("alice")
    assert base is not None
    assert (base.commit == head) is not shown_as_update


def _conversation(memory: MemoryRig, turns: int) -> None:
    for i in range(turns):
        memory.recall.append(
            "alice",
            f"old{i}",
            [
                NewMessage(role=MessageRole.USER, content=f"turn {i}: " + "words " * 40),
                NewMessage(role=MessageRole.ASSISTANT, content=f"reply {i}"),
            ],
        )


@pytest.mark.parametrize("window", [200_000, 4000])
def test_a_new_summary_moves_the_base_in_the_same_turn(tmp_path: Path, window: int) -> None:
    memory, engine = _memory(tmp_path, None, context_window=window, **ROOMY)
    _conversation(memory, 24)
    base = memory.blocks.last_change("alice")
    assert base is not None
    memory.edits.edit_block("alice", "notes", {"value": "Has a cat"}, ANN)
    context = compile_context(
        memory.sources(SummaryStore(engine)),
        "alice",
        tool_definitions(),
        summarizer=lambda messages, _previous: f"Summary of {len(messages)} messages.",
        base=PromptBase(commit=base.sha, summarized_through_message_id=0),
    )
    summarised = context.overview.summarized_through_message_id > 0
    assert summarised is (window == 4000)
    # Summarised, the conversation's cached prefix is written again anyway: so are the blocks.
    assert ("Has a cat" in context.system) is summarised
    assert (context.memory_update == "") is summarised
    head = memory.blocks.last_change("alice")
    assert head is not None
    assert context.memory_base == (head.sha if summarised else base.sha)
    engine.dispose()


def test_two_workers_compile_the_same_request_from_the_same_state(
    tmp_path: Path, engine: Engine
) -> None:
    """Each worker opens its own engine and repository: the base comes from the database."""
    memory, _ = _memory(tmp_path, engine, **ROOMY)
    with scripted_steps(memory, engine, []) as (steps, server):
        _approved_between_turns(memory, steps, server)
    other, other_engine = _memory(tmp_path, create_engine_like(engine), **ROOMY)
    requests = [
        model_request(
            turn_context(
                rig.sources(SummaryStore(db)), None, "alice", base=PromptBaseStore(db).get("alice")
            ),
            [],
            "5m",
        ).model_dump_json()
        for rig, db in ((memory, engine), (other, other_engine))
    ]
    assert requests[0] == requests[1]
    assert MEMORY_UPDATE_START in requests[0]
    other_engine.dispose()


def test_a_crash_before_the_base_moved_is_repaired_by_the_retry(rig: Rig) -> None:
    """prepare stores the turn's context, then moves the base: a process that dies between
    the two leaves the old base, and the retried prepare moves it to the stored context's."""
    memory, engine, steps, server = rig
    _approved_between_turns(memory, steps, server)
    bases = PromptBaseStore(engine)
    before = bases.get("alice")
    assert before is not None
    # A cold turn 3 re-compiles at HEAD ...
    cold = TurnSteps(
        steps.sources,
        steps.archive,
        steps.tools,
        steps.model,
        steps.turns,
        clock=lambda: datetime.now(UTC) + timedelta(hours=2),
    )
    turn = TurnInput(user_id="alice", turn_id="t3", message="m3")
    cold.prepare(turn)
    moved = bases.get("alice")
    stored = steps.turns.context("alice", "t3")
    assert moved is not None
    assert moved.commit == stored.memory_base != before.commit
    # ... and the process dies before the base moved: the row still names the old base.
    bases.move("alice", before)
    # The retry (warm now: it would have kept the old base) gets the stored context back
    # and moves the base to it.
    steps.prepare(turn)
    assert steps.turns.context("alice", "t3") == stored
    assert bases.get("alice") == moved
    # Turn 3 and turn 4 show the same system prompt: turn 4 reads what turn 3 cached.
    server.extend([{"text": "ok"}])
    run_turn_steps(steps, turn, 8)
    _turn(steps, server, 4, {"text": "ok"})
    assert server.requests[-1]["system"] == server.requests[-2]["system"]
    assert len(_tail(server.requests[-1])) == 1


def test_a_base_that_left_the_history_is_dropped(rig: Rig) -> None:
    """A history rewrite (a redaction) leaves the old base commit in git's objects until gc:
    it must not be shown again, or the text rewritten away comes back in the system prompt."""
    memory, engine, steps, server = rig
    head, _ = _approved_between_turns(memory, steps, server)
    base = PromptBaseStore(engine).get("alice")
    assert base is not None
    assert base.commit != head
    repo = memory.git.repo_path("alice")

    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    # The same trees on a new chain of commits, as a rewrite makes them.
    parent: str | None = None
    for sha in git("rev-list", "--reverse", "HEAD").splitlines():
        args = ["commit-tree", f"{sha}^{{tree}}", "-m", f"rewritten {sha[:12]}"]
        parent = git(*args, *(["-p", parent] if parent else []))
    assert parent is not None
    git("update-ref", "refs/heads/main", parent)
    git("cat-file", "-e", base.commit)  # still an object, no longer in the history
    _turn(steps, server, 3, {"text": "ok"})
    request = server.requests[-1]
    assert "Has a cat" in request["system"][1]["text"]
    assert not _tail(request)[0].startswith(MEMORY_UPDATE_START)
    moved = PromptBaseStore(engine).get("alice")
    assert moved is not None
    assert moved.commit == parent
