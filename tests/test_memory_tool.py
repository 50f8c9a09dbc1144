"""Claude's memory tool (`memory_20250818`) through the real SDK and the scripted server: every
command, each write a pending diff carrying its turn, the agent's proposals and decisions shown
on `view`, the profile's choice of tools, and an edit waiting in the turn workflow on a real
Temporal dev server for a person's approval. The hostile inputs: tests/test_memory_tool_hostile.py.
"""

import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine
from temporalio.testing import WorkflowEnvironment

from durable_memory.memory.agent.tool_specs import tool_definitions
from durable_memory.memory.agent.tools import MemoryTools
from durable_memory.memory.core.errors import ProfileError
from durable_memory.memory.core.profiles import parse_profile
from durable_memory.models.blocks import ToolSet
from durable_memory.models.diffs import DiffStatus
from tests.support.agent_helpers import (
    TEST_PROFILE,
    agent_test_profile,
    run_scripted_turn,
    tool_results,
    tool_use,
)
from tests.support.memory import MemoryRig, memory_rig
from tests.support.temporal_helpers import rig_settings, running_rig

NOTES = "/memories/notes.md"
NOTES_MARKDOWN = (
    "---\nblock: notes\n---\n\n## Value\nLikes tea\nLives in Lyon\nLikes tea with lemon\n"
)


def claude_profile(*tools: ToolSet) -> Any:
    return agent_test_profile().model_copy(update={"tools": tools or (ToolSet.CLAUDE_MEMORY,)})


@pytest.fixture
def svc(engine: Engine, data_dir: Path) -> MemoryRig:
    memory = memory_rig(engine, data_dir, claude_profile())
    memory.blocks.ensure_user("alice")
    return memory


def memory_call(**arguments: Any) -> dict[str, Any]:
    return tool_use("memory", **arguments)


def run_calls(
    svc: MemoryRig, engine: Engine, *calls: dict[str, Any], turn_id: str | None = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A turn (`turn_id`, else a new one) whose model makes `calls` in one reply, then ends:
    (tool results, requests). No call ever commits to memory."""
    turn_id = turn_id or f"turn-{uuid.uuid4().hex}"
    head = svc.git.head("alice")
    script: list[dict[str, Any]] = [{"content": list(calls)}, {"text": "ok"}]
    result, requests = run_scripted_turn(svc, engine, script, "hi", turn_id=turn_id)
    assert result.reply == "ok"
    assert svc.git.head("alice") == head
    return tool_results(requests[1]), requests


def one_call(svc: MemoryRig, engine: Engine, turn_id: str | None = None, **arguments: Any) -> Any:
    (outcome,), _ = run_calls(svc, engine, memory_call(**arguments), turn_id=turn_id)
    return outcome


# -- the profile chooses the tools ---------------------------------------------------------


def test_a_claude_memory_profile_offers_the_memory_tool_and_not_the_letta_edit_tools(
    svc: MemoryRig, engine: Engine
) -> None:
    _, requests = run_calls(svc, engine, memory_call(command="view", path="/memories"))
    tools = requests[0]["tools"]
    assert tools[0] == {"type": "memory_20250818", "name": "memory"}
    assert [t["name"] for t in tools] == [
        "memory",
        "archival_memory_insert",
        "archival_memory_search",
        "conversation_search",
    ]


def test_both_tool_sets_in_a_fixed_order_and_the_default_is_todays() -> None:
    both = claude_profile(ToolSet.CLAUDE_MEMORY, ToolSet.LETTA)
    names = [t["name"] for t in tool_definitions(both.tools)]
    assert names[:6] == [
        "core_memory_append",
        "core_memory_replace",
        "memory_insert",
        "memory_rethink",
        "edit_memory_block",
        "memory",
    ]
    assert tool_definitions(both.tools) == tool_definitions([ToolSet.LETTA, ToolSet.CLAUDE_MEMORY])
    assert agent_test_profile().tools == (ToolSet.LETTA,)
    assert tool_definitions() == tool_definitions([ToolSet.LETTA])
    assert "memory" not in [t["name"] for t in tool_definitions()]


def test_a_profile_file_declares_its_tools() -> None:
    text = 'tools = ["claude_memory", "letta"]\n' + TEST_PROFILE
    assert parse_profile(text, "p.toml").tools == (ToolSet.CLAUDE_MEMORY, ToolSet.LETTA)
    for bad in ("[]", '["letta", "letta"]', '["mcp"]', '"letta"'):
        with pytest.raises(ProfileError, match=r"p\.toml: tools"):
            parse_profile(f"tools = {bad}\n" + TEST_PROFILE, "p.toml")


def test_a_tool_the_profile_does_not_offer_is_unknown(
    svc: MemoryRig, engine: Engine, data_dir: Path
) -> None:
    (outcome,), _ = run_calls(
        svc, engine, tool_use("core_memory_append", label="notes", content="Has a cat")
    )
    assert outcome["is_error"]
    assert outcome["content"].startswith("unknown tool 'core_memory_append'; the tools are memory,")
    letta = memory_rig(engine, data_dir / "letta", agent_test_profile())
    letta.blocks.ensure_user("alice")
    outcome = one_call(letta, engine, turn_id="t2", command="view", path="/memories")
    assert outcome["is_error"]
    assert "unknown tool 'memory'" in outcome["content"]
    assert svc.review.pending("alice") == []


# -- view ----------------------------------------------------------------------------------


def test_view_of_the_directory_lists_each_block_with_chars_used_and_limit(
    svc: MemoryRig, engine: Engine
) -> None:
    outcome = one_call(svc, engine, command="view", path="/memories")
    assert not outcome["is_error"]
    lines = outcome["content"].split("\n")
    assert lines[0].startswith("Here're the files in /memories, one per memory block")
    listed = {line.split("\t")[0]: line.split("\t")[1:] for line in lines[1:]}
    assert list(listed) == [
        f"/memories/{label}.md" for label in ("persona", "notes", "student", "human")
    ]
    used = len("Likes tea\nLives in Lyon\nLikes tea with lemon")
    assert listed[NOTES] == [f"{used}/200 chars", "Free-form notes about the user."]
    assert listed["/memories/persona.md"][0].endswith("/1500 chars, read-only")
    assert one_call(svc, engine, command="view", path="/memories/")["content"] == outcome["content"]


def test_view_of_a_file_shows_its_markdown_with_line_numbers(
    svc: MemoryRig, engine: Engine
) -> None:
    content = one_call(svc, engine, command="view", path=NOTES)["content"]
    numbered = "\n".join(
        f"{n:>6}\t{line}" for n, line in enumerate(NOTES_MARKDOWN.rstrip("\n").split("\n"), 1)
    )
    assert content.startswith(f"Here's the content of {NOTES} with line numbers:\n{numbered}\n")
    assert "[notes: 44 of 200 characters used." in content
    assert "pending" not in content
    ranged = one_call(svc, engine, command="view", path=NOTES, view_range=[6, -1])["content"]
    assert "     6\tLikes tea\n     7\tLives in Lyon\n     8\tLikes tea with lemon\n" in ranged
    assert "     5\t" not in ranged
    bad = one_call(svc, engine, command="view", path=NOTES, view_range=[0, 3])
    assert bad["is_error"]
    assert "the file has 8 lines" in bad["content"]


# -- edits are proposals -------------------------------------------------------------------


EDITS = [
    (
        {"command": "str_replace", "path": NOTES, "old_str": "Lyon", "new_str": "Paris"},
        "Likes tea\nLives in Paris\nLikes tea with lemon",
    ),
    (
        {"command": "insert", "path": NOTES, "insert_line": 5, "insert_text": "Has a cat"},
        "Has a cat\nLikes tea\nLives in Lyon\nLikes tea with lemon",
    ),
    (
        {"command": "create", "path": NOTES, "file_text": NOTES_MARKDOWN.replace("tea", "coffee")},
        "Likes coffee\nLives in Lyon\nLikes coffee with lemon",
    ),
]


@pytest.mark.parametrize(("call", "approved_value"), EDITS, ids=lambda v: str(v)[:30])
def test_an_edit_is_a_pending_diff_of_its_turn_that_a_person_approves(
    svc: MemoryRig, engine: Engine, call: dict[str, Any], approved_value: str
) -> None:
    outcome = one_call(svc, engine, turn_id="t7", **call)
    assert not outcome["is_error"], outcome["content"]
    (diff,) = svc.review.pending("alice")
    assert outcome["content"].startswith(f'Proposed edit {diff.id} to {NOTES}: "Rewrite notes".')
    assert "awaits a person's approval and is not in memory yet" in outcome["content"]
    assert diff.proposer.turn_id == "t7"
    assert diff.label == "notes"
    assert svc.blocks.read_block("alice", "notes").fields["value"] != approved_value
    svc.review.approve(diff.id, "bob", user_id="alice")
    assert svc.blocks.read_block("alice", "notes").fields["value"] == approved_value


def test_a_pending_proposal_shows_on_view_and_a_newer_edit_supersedes_it(
    svc: MemoryRig, engine: Engine
) -> None:
    one_call(
        svc, engine, turn_id="t1", command="str_replace", path=NOTES, old_str="Lyon", new_str="x"
    )
    (first,) = svc.review.pending("alice")
    view = one_call(svc, engine, turn_id="t2", command="view", path=NOTES)["content"]
    assert f'- diff {first.id} (turn t1) "Rewrite notes", awaiting a person\'s decision' in view
    assert "    -Lives in Lyon\n    +Lives in x" in view
    listing = one_call(svc, engine, turn_id="t3", command="view", path="/memories")["content"]
    assert "200 chars, 1 pending proposal of yours\t" in listing
    one_call(
        svc, engine, turn_id="t4", command="insert", path=NOTES, insert_line=8, insert_text="x"
    )
    (second,) = svc.review.pending("alice")
    assert second.id != first.id
    assert svc.review.get(first.id, "alice").status is DiffStatus.SUPERSEDED


def test_a_rejected_proposal_shows_as_rejected_on_the_next_view(
    svc: MemoryRig, engine: Engine
) -> None:
    one_call(
        svc, engine, turn_id="t1", command="str_replace", path=NOTES, old_str="Lyon", new_str="Mars"
    )
    (diff,) = svc.review.pending("alice")
    svc.review.reject(diff.id, "bob", "she lives in Lyon", user_id="alice")
    view = one_call(svc, engine, turn_id="t2", command="view", path=NOTES)["content"]
    assert "Your latest proposals for this file that were not applied:" in view
    assert (
        f'- diff {diff.id} (turn t1) "Rewrite notes", rejected by bob: "she lives in Lyon"' in view
    )
    assert "awaiting" not in view


def test_a_retried_call_proposes_nothing_new(svc: MemoryRig) -> None:
    arguments = {"command": "str_replace", "path": NOTES, "old_str": "Lyon", "new_str": "Nice"}
    tools = MemoryTools(svc.blocks, svc.review, svc.recall)
    first = tools.execute("alice", "t1", "memory", arguments, call_id="toolu_1")
    again = tools.execute("alice", "t1", "memory", arguments, call_id="toolu_1")
    assert first.diff_id is not None
    assert again.diff_id == first.diff_id
    assert len(svc.review.pending("alice")) == 1


# -- errors the model can act on -----------------------------------------------------------

ERRORS: list[tuple[dict[str, Any], str]] = [
    (
        {"command": "create", "path": "/memories/hobbies.md", "file_text": "x"},
        "there is no such memory file. /memories holds one file per memory block: "
        "/memories/persona.md, /memories/notes.md, /memories/student.md, /memories/human.md. "
        "New blocks are added by a person",
    ),
    (
        {"command": "str_replace", "path": NOTES, "old_str": "Berlin", "new_str": "x"},
        "old_str did not appear verbatim in /memories/notes.md",
    ),
    (
        {"command": "str_replace", "path": NOTES, "old_str": "Likes tea", "new_str": "x"},
        "old_str appears 2 times in /memories/notes.md (lines 6, 8)",
    ),
    ({"command": "str_replace", "path": NOTES, "old_str": "", "new_str": "x"}, "old_str is empty"),
    (
        {"command": "insert", "path": NOTES, "insert_line": 9, "insert_text": "x"},
        "Invalid insert_line 9: /memories/notes.md has 8 lines",
    ),
    (
        {"command": "insert", "path": NOTES, "insert_line": 0, "insert_text": "x"},
        "line 1: expected '---' opening the front matter",
    ),
    (
        {"command": "create", "path": NOTES, "file_text": "just text"},
        "create on /memories/notes.md failed, nothing proposed",
    ),
    (
        {"command": "insert", "path": NOTES, "insert_line": 8, "insert_text": "y" * 300},
        "block 'notes' would be 345 characters, over its limit of 200",
    ),
    (
        {"command": "create", "path": NOTES, "file_text": NOTES_MARKDOWN},
        "changes nothing in the block; nothing proposed",
    ),
    (
        {
            "command": "str_replace",
            "path": "/memories/persona.md",
            "old_str": "You",
            "new_str": "I",
        },
        "/memories/persona.md is read-only: the profile does not let you propose edits",
    ),
    ({"command": "delete", "path": NOTES}, "memory is human-controlled"),
    ({"command": "delete", "path": "/memories"}, "memory is human-controlled"),
    (
        {"command": "rename", "old_path": NOTES, "new_path": "/memories/facts.md"},
        "memory is human-controlled",
    ),
    ({"command": "view", "path": "/memories/notes"}, "there is no such memory file"),
    ({"command": "create", "path": "/memories", "file_text": "x"}, "/memories is a directory"),
    ({"command": "format", "path": NOTES}, "does not match any of the expected tags"),
    (
        {"command": "insert", "path": NOTES, "insert_text": "x"},
        "insert.insert_line: Field required",
    ),
]


def test_every_mistake_is_one_tool_error_and_nothing_is_proposed(
    svc: MemoryRig, engine: Engine
) -> None:
    outcomes, _ = run_calls(svc, engine, *(memory_call(**call) for call, _ in ERRORS))
    for outcome, (call, expected) in zip(outcomes, ERRORS, strict=True):
        assert outcome["is_error"], call
        assert outcome["content"].startswith("Error: "), outcome["content"]
        assert expected in outcome["content"], (call, outcome["content"])
    assert svc.review.pending("alice") == []


# -- through the turn workflow ---------------------------------------------------------------


async def test_a_memory_tool_edit_waits_in_the_turn_workflow_for_a_person(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    profile = tmp_path / "claude.toml"
    profile.write_text('tools = ["claude_memory"]\n' + TEST_PROFILE, encoding="utf-8")
    settings = rig_settings(tmp_path / "data", profile=str(profile))
    edit = memory_call(command="str_replace", path=NOTES, old_str="Lyon", new_str="Paris")
    script: list[dict[str, Any]] = [{"content": [edit]}, {"text": "Noted."}]
    async with running_rig(temporal_env.client, settings, script) as rig:
        reply = await rig.client.send_message("alice", "I moved to Paris", turn_id="t1")
        assert reply.reply == "Noted."
        (diff,) = reply.diffs
        assert diff.status is DiffStatus.PENDING
        notes = rig.stack.blocks.read_block("alice", "notes")
        assert "Lyon" in str(notes.fields["value"])
        assert rig.model_server.requests[0]["tools"][0] == {
            "type": "memory_20250818",
            "name": "memory",
        }
        approved = await rig.client.approve(diff.id, "bob")
        assert approved is not None
        assert approved.status is DiffStatus.APPROVED
        notes = rig.stack.blocks.read_block("alice", "notes")
        assert notes.fields["value"] == "Likes tea\nLives in Paris\nLikes tea with lemon"
        (commit, *_) = rig.stack.history.history("alice", "notes", 1)
        assert commit.trailers["Proposed-By"] == "turn:t1"
        assert commit.trailers["Approved-By"] == "bob"
