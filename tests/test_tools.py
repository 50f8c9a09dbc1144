"""Each memory tool through the real SDK and the scripted server: success and every error the
model can cause. Edit tools never change memory; errors never fail the turn."""

import json
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine

from durable_memory.memory.agent.tool_specs import (
    LETTA_EDIT_TOOLS,
    MEMORY_TOOL_NAME,
    proposes_diffs,
    tool_definitions,
    tool_names,
)
from durable_memory.memory.archive.embedders import default_embedder
from durable_memory.memory.archive.sqlite import SqliteArchive
from durable_memory.models.blocks import ToolSet
from durable_memory.models.diffs import DiffStatus
from tests.support.agent_helpers import (
    agent_test_profile,
    run_scripted_turn,
    tool_results,
    tool_use,
)
from tests.support.memory import MemoryRig, memory_rig


@pytest.fixture
def svc(engine: Engine, data_dir: Path) -> MemoryRig:
    memory = memory_rig(engine, data_dir, agent_test_profile())
    memory.blocks.ensure_user("alice")
    return memory


def _one_call(svc: MemoryRig, engine: Engine, call: dict[str, Any]) -> dict[str, Any]:
    """Run a turn where the model makes one tool call then ends; return the tool result."""
    head = svc.git.head("alice")
    result, requests = run_scripted_turn(svc, engine, [{"content": [call]}, {"text": "ok"}], "hi")
    assert result.reply == "ok"
    assert len(requests) == 2
    assert svc.git.head("alice") == head  # no tool ever commits to memory
    (outcome,) = tool_results(requests[1])
    return outcome


SUCCESS = [
    (
        tool_use("core_memory_append", label="notes", content="Has a cat", reasoning="said so"),
        "notes",
        "Append to notes: Has a cat",
    ),
    (
        tool_use("core_memory_replace", label="notes", old_content="Lyon", new_content="Paris"),
        "notes",
        "Replace in notes: 'Lyon' -> 'Paris'",
    ),
    (
        tool_use("memory_insert", label="notes", new_string="First line", insert_line=0),
        "notes",
        "Insert into notes at line 0",
    ),
    (
        tool_use("memory_rethink", label="notes", new_memory="Tea drinker in Lyon"),
        "notes",
        "Rewrite notes",
    ),
    (
        tool_use(
            "edit_memory_block",
            label="student",
            field="name",
            operation="set",
            value="Alice",
            reasoning="introduced herself",
        ),
        "student",
        "Set student.name = Alice",
    ),
    (
        tool_use(
            "edit_memory_block",
            label="student",
            field="strengths",
            operation="add",
            value="Grit",
            reasoning="kept going",
        ),
        "student",
        "Add to student.strengths: Grit",
    ),
    (
        tool_use(
            "edit_memory_block",
            label="human",
            operation="set_task",
            value="Outline essay",
            reasoning="she asked",
        ),
        "human",
        "Set task in human: Outline essay",
    ),
    (
        tool_use(
            "edit_memory_block",
            label="human",
            operation="learn_preference",
            value="Short answers",
            reasoning="asked twice",
        ),
        "human",
        "Learn preference in human: Short answers",
    ),
]


@pytest.mark.parametrize(("call", "label", "summary"), SUCCESS)
def test_edit_tools_create_pending_diffs(
    svc: MemoryRig, engine: Engine, call: dict[str, Any], label: str, summary: str
) -> None:
    outcome = _one_call(svc, engine, call)
    assert outcome.get("is_error", False) is False
    (diff,) = svc.review.pending("alice")
    assert (diff.label, diff.summary, diff.proposed_by) == (label, summary, "turn:t1")
    assert f"Proposed edit {diff.id}" in outcome["content"]
    assert "awaits human approval" in outcome["content"]
    assert svc.review.approve(diff.id, "reviewer").status is DiffStatus.APPROVED


ERRORS = [
    (
        tool_use("core_memory_append", label="diary", content="x"),
        "no block 'diary' in profile 'tools-test'; its blocks are persona, notes, student, human",
    ),
    (tool_use("core_memory_append", label="../x", content="x"), "invalid block label '../x'"),
    (
        tool_use(
            "edit_memory_block",
            label="persona",
            field="tone",
            operation="set",
            value="cold",
            reasoning="r",
        ),
        "block 'persona' is read-only",
    ),
    (
        tool_use("core_memory_append", label="notes", content="y" * 200),
        "block 'notes' would be 245 characters, over its limit of 200",
    ),
    (
        tool_use("core_memory_replace", label="notes", old_content="Paris", new_content="x"),
        "old_content not found in block 'notes'",
    ),
    (
        tool_use("core_memory_replace", label="notes", old_content="Likes tea", new_content="x"),
        "old_content appears 2 times in block 'notes' (lines 1, 3)",
    ),
    (
        tool_use("memory_insert", label="notes", new_string="x", insert_line=9),
        "insert_line 9 is past the end of block 'notes' (3 lines)",
    ),
    (tool_use("core_memory_append", label="student", content="x"), "has typed fields"),
    (
        tool_use(
            "edit_memory_block",
            label="student",
            field="age",
            operation="set",
            value="17",
            reasoning="r",
        ),
        "block 'student' has no field 'age'",
    ),
    (
        tool_use(
            "edit_memory_block",
            label="student",
            field="name",
            operation="explode",
            value="x",
            reasoning="r",
        ),
        "invalid arguments for edit_memory_block: operation",
    ),
    (
        tool_use(
            "edit_memory_block",
            label="student",
            field="stage",
            operation="set",
            value="sleeping",
            reasoning="r",
        ),
        "field 'stage' must be one of exploring, drafting",
    ),
    (
        tool_use(
            "edit_memory_block",
            label="student",
            field="name",
            operation="add",
            value="x",
            reasoning="r",
        ),
        "field 'name' of block 'student' is str, not a list",
    ),
    (
        tool_use(
            "edit_memory_block",
            label="student",
            field="strengths",
            operation="remove",
            value="Charm",
            reasoning="r",
        ),
        "'Charm' is not in student.strengths",
    ),
    (
        tool_use("edit_memory_block", label="student", field="name", operation="set", value="x"),
        "invalid arguments for edit_memory_block: reasoning: Field required",
    ),
    (
        tool_use("edit_memory_block", label="human", operation="set_task", reasoning="r"),
        "operation 'set_task' needs a non-empty string value",
    ),
    (
        tool_use("core_memory_append", label="notes"),
        "invalid arguments for core_memory_append: content: Field required",
    ),
    (
        tool_use("core_memory_append", label="notes", content="x", mood="happy"),
        "mood: Extra inputs are not permitted",
    ),
    (tool_use("launch_rockets", target="moon"), "unknown tool 'launch_rockets'"),
    (tool_use("archival_memory_insert", content="x"), "archival memory is not configured"),
    (
        tool_use("conversation_search", query="x", limit=500),
        "limit: Input should be less than or equal to 50",
    ),
]


@pytest.mark.parametrize(("call", "message"), ERRORS)
def test_model_errors_come_back_as_error_results(
    svc: MemoryRig, engine: Engine, call: dict[str, Any], message: str
) -> None:
    outcome = _one_call(svc, engine, call)
    assert outcome["is_error"] is True
    assert message in outcome["content"]
    assert svc.review.pending("alice") == []


def test_max_items_limit_is_an_error_result(svc: MemoryRig, engine: Engine) -> None:
    svc.edits.edit_block(
        "alice", "student", {"strengths": ["A", "B"], "stage": "drafting"}, _alice()
    )
    outcome = _one_call(
        svc,
        engine,
        tool_use(
            "edit_memory_block",
            label="student",
            field="strengths",
            operation="add",
            value="C",
            reasoning="r",
        ),
    )
    assert outcome["is_error"] is True
    assert "field 'strengths' has 3 items, more than its maximum of 2" in outcome["content"]


def _alice() -> Any:
    from durable_memory.models.history import Author, AuthorKind

    return Author(name="alice", kind=AuthorKind.USER)


def test_conversation_search_finds_earlier_turns(svc: MemoryRig, engine: Engine) -> None:
    run_scripted_turn(svc, engine, [{"text": "Noted"}], "My dog is called Biscuit", turn_id="t0")
    outcome = _one_call(
        svc, engine, tool_use("conversation_search", query="Biscuit", roles=["user"])
    )
    assert outcome.get("is_error", False) is False
    assert '"total": 1' in outcome["content"]
    assert "My dog is called Biscuit" in outcome["content"]
    assert '"turn_id": "t0"' in outcome["content"]


def test_tools_offered_to_the_model(svc: MemoryRig, engine: Engine) -> None:
    _, requests = run_scripted_turn(svc, engine, [{"text": "hi"}], "hello")
    names = [t["name"] for t in requests[0]["tools"]]
    assert names == [
        "core_memory_append",
        "core_memory_replace",
        "memory_insert",
        "memory_rethink",
        "edit_memory_block",
        "archival_memory_insert",
        "archival_memory_search",
        "conversation_search",
    ]
    assert requests[0]["tools"] == tool_definitions()
    for tool in requests[0]["tools"]:
        assert tool["input_schema"]["type"] == "object"
        assert len(tool["description"]) > 80


def test_several_calls_in_one_step_and_the_step_loop(svc: MemoryRig, engine: Engine) -> None:
    script: list[dict[str, Any]] = [
        {
            "content": [
                {"type": "text", "text": "Let me note both."},
                tool_use("core_memory_append", label="notes", content="Has a cat"),
                tool_use("core_memory_append", label="diary", content="x"),
            ]
        },
        {
            "content": [
                tool_use(
                    "edit_memory_block",
                    label="human",
                    operation="learn_fact",
                    value="Has a cat",
                    reasoning="r",
                )
            ]
        },
        {"text": "Done."},
    ]
    result, requests = run_scripted_turn(svc, engine, script, "I have a cat")
    assert result.reply == "Done."
    assert result.steps == 3
    assert len(result.diff_ids) == 2
    first, second = tool_results(requests[1])
    assert first.get("is_error", False) is False
    assert second["is_error"] is True
    # The model saw its own previous turn, then the results, in API shape.
    assert [m["role"] for m in requests[2]["messages"]] == [
        "user",
        "assistant",
        "user",
        "assistant",
        "user",
    ]


def test_step_limit_ends_the_turn_and_says_so(svc: MemoryRig, engine: Engine) -> None:
    loop: dict[str, Any] = {"content": [tool_use("conversation_search", query="x")]}
    result, requests = run_scripted_turn(svc, engine, [loop] * 5, "hi", max_steps=3)
    assert result.stopped_at_step_limit
    assert len(requests) == 3
    assert "stopped after 3 model steps" in result.reply
    messages = svc.recall.recent("alice", 50)
    assert messages[-1].content.startswith("[stopped after 3 model steps")


@pytest.fixture
def archive(tmp_path: Path) -> SqliteArchive:
    return SqliteArchive(tmp_path / "archive.db", default_embedder())


def test_archival_insert_and_search(svc: MemoryRig, engine: Engine, archive: SqliteArchive) -> None:
    insert = tool_use(
        "archival_memory_insert", content="Alice's robot is named Bolt.", tags=["robots"]
    )
    _result, requests = run_scripted_turn(
        svc, engine, [{"content": [insert]}, {"text": "ok"}], "hi", archive=archive
    )
    (outcome,) = tool_results(requests[1])
    assert outcome.get("is_error", False) is False
    (passage,) = archive.page("alice")
    assert outcome["content"].startswith(f"Stored in archival memory as passage {passage.id}")
    assert (passage.source.value, passage.tags) == ("agent", ("robots",))
    search = tool_use(
        "archival_memory_search", query="what is the robot called", tags=["robots"], top_k=3
    )
    _, requests = run_scripted_turn(
        svc, engine, [{"content": [search]}, {"text": "ok"}], "q", turn_id="t2", archive=archive
    )
    (found,) = tool_results(requests[1])
    body = json.loads(found["content"])
    assert [r["id"] for r in body["results"]] == [passage.id]
    assert body["results"][0]["text"] == "Alice's robot is named Bolt."


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            tool_use("archival_memory_insert", content="word " * 8300),
            "over the archival limit of 8192; split it into several inserts",
        ),
        (
            tool_use("archival_memory_insert", content=""),
            "content: String should have at least 1 character",
        ),
        (tool_use("archival_memory_insert", content="x", tags=["\x00"]), "invalid tag"),
        (
            tool_use("archival_memory_search", query="x", tag_match_mode="some"),
            "tag_match_mode: Input should be 'any' or 'all'",
        ),
        (
            tool_use("archival_memory_search", query="x", start_datetime="yesterday"),
            "start_datetime: Input should be a valid datetime",
        ),
        (
            tool_use(
                "archival_memory_search",
                query="x",
                start_datetime="2026-02-01T00:00:00Z",
                end_datetime="2026-01-01T00:00:00Z",
            ),
            "start must be before end",
        ),
        (
            tool_use("archival_memory_search", query="x", top_k=0),
            "top_k: Input should be greater than or equal to 1",
        ),
    ],
)
def test_archival_errors_are_error_results(
    svc: MemoryRig, engine: Engine, archive: SqliteArchive, call: dict[str, Any], message: str
) -> None:
    _, requests = run_scripted_turn(
        svc, engine, [{"content": [call]}, {"text": "ok"}], "hi", archive=archive
    )
    (outcome,) = tool_results(requests[1])
    assert outcome["is_error"] is True
    assert message in outcome["content"]
    assert archive.count("alice") == 0


def test_only_the_edit_tools_and_claudes_memory_tool_propose_diffs() -> None:
    """What a step looks diffs up for (steps.py `_diffs_of`): a tool left out here would have
    its diffs go unreported, so the list is pinned, every tool of every tool set named."""
    every_tool = tool_names(tuple(ToolSet))
    proposing = {name for name in every_tool if proposes_diffs(name)}
    assert proposing == {*LETTA_EDIT_TOOLS, MEMORY_TOOL_NAME}  # the tools that edit a block
    assert set(every_tool) - proposing == {
        "archival_memory_insert",
        "archival_memory_search",
        "conversation_search",
    }
    assert not proposes_diffs("no_such_tool")
