"""Tenant isolation: every record that a caller-chosen id names is keyed by user as well.
Two users who both send turn `t1`, or who name each other's diffs, never see, reuse or change
each other's context, replies, diffs or blocks (on SQLite and PostgreSQL, then end to end)."""

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, inspect, text
from temporalio.testing import WorkflowEnvironment

from durable_memory.memory.core.errors import UnknownDiff
from durable_memory.memory.store.db import make_engine
from durable_memory.memory.store.turns import TurnStore
from durable_memory.models.context import CompiledContext, ContextWindowOverview
from durable_memory.models.diffs import DiffStatus, Proposer
from durable_memory.models.llm import ModelReply, TextBlock
from durable_memory.models.operations import AddItem, LearnPreference
from tests.support.agent_helpers import edit_block
from tests.support.memory import MemoryRig
from tests.support.temporal_helpers import rig_settings, running_rig

TURN = Proposer.turn("t1")


def _context(system: str) -> CompiledContext:
    counts = dict.fromkeys(ContextWindowOverview.model_fields, 0)
    overview = ContextWindowOverview.model_validate({**counts, "context_window": 100})
    return CompiledContext(
        system=system, messages=[], tools=[], overview=overview, last_message_id=0
    )


def _reply(text: str) -> ModelReply:
    return ModelReply(content=[TextBlock(text=text)], stop_reason="end_turn", model="m")


def test_turn_store_keeps_each_users_turn_apart(engine: Engine) -> None:
    turns = TurnStore(engine)
    assert turns.save_context("alice", "t1", _context("alice's")).system == "alice's"
    # Bob's turn t1 gets its own context, not the one stored first under t1.
    assert turns.save_context("bob", "t1", _context("bob's")).system == "bob's"
    assert turns.context("alice", "t1").system == "alice's"
    assert turns.context("bob", "t1").system == "bob's"

    turns.save_reply("alice", "t1", 1, _reply("for alice"))
    assert turns.reply("bob", "t1", 1) is None  # bob's step 1 calls the model
    assert turns.save_reply("bob", "t1", 1, _reply("for bob")).text == "for bob"
    assert turns.reply("alice", "t1", 1) == _reply("for alice")
    # A retry of either step still gets that user's first reply back.
    assert turns.save_reply("alice", "t1", 1, _reply("again")).text == "for alice"
    with pytest.raises(LookupError):
        turns.context("carol", "t1")
    # Alice's turn t1 ends its loop: only her context is dropped, and dropping again is a no-op.
    turns.drop_context("alice", "t1")
    turns.drop_context("alice", "t1")
    with pytest.raises(LookupError):
        turns.context("alice", "t1")
    assert turns.context("bob", "t1").system == "bob's"
    assert turns.reply("alice", "t1", 1) == _reply("for alice")  # replies are kept


def test_old_turn_tables_are_migrated_on_open(engine: Engine) -> None:
    """A database from before: turn bookkeeping keyed by turn id alone. Opening it copies the
    rows (each carries its user) into the tables keyed by user, and drops the old tables."""
    at = datetime(2026, 1, 1, tzinfo=UTC)
    with engine.begin() as conn:
        conn.execute(text("DROP TABLE user_turn_contexts"))
        conn.execute(text("DROP TABLE user_turn_steps"))
        conn.execute(
            text(
                "CREATE TABLE turn_contexts (turn_id VARCHAR(64) PRIMARY KEY, "
                "user_id VARCHAR(64) NOT NULL, body TEXT NOT NULL, created_at TIMESTAMP NOT NULL)"
            )
        )
        conn.execute(
            text(
                "CREATE TABLE turn_steps (turn_id VARCHAR(64), step INTEGER, "
                "user_id VARCHAR(64) NOT NULL, reply TEXT NOT NULL, created_at TIMESTAMP "
                "NOT NULL, PRIMARY KEY (turn_id, step))"
            )
        )
        conn.execute(
            text("INSERT INTO turn_contexts VALUES ('t1', 'alice', :body, :at)"),
            {"body": _context("alice's").model_dump_json(), "at": at},
        )
        conn.execute(
            text("INSERT INTO turn_steps VALUES ('t1', 1, 'alice', :reply, :at)"),
            {"reply": _reply("for alice").model_dump_json(), "at": at},
        )
    reopened = make_engine(engine.url.render_as_string(hide_password=False))
    try:
        tables = set(inspect(reopened).get_table_names())
        assert {"user_turn_contexts", "user_turn_steps"} <= tables
        assert not {"turn_contexts", "turn_steps"} & tables
        turns = TurnStore(reopened)
        assert turns.context("alice", "t1").system == "alice's"
        assert turns.reply("alice", "t1", 1) == _reply("for alice")
        assert turns.reply("bob", "t1", 1) is None
        make_engine(engine.url.render_as_string(hide_password=False)).dispose()  # idempotent
        assert TurnStore(reopened).context("alice", "t1").system == "alice's"
    finally:
        reopened.dispose()


def test_a_diff_of_another_user_is_indistinguishable_from_a_missing_one(
    memory: MemoryRig,
) -> None:
    memory.blocks.ensure_user("alice")
    memory.blocks.ensure_user("bob")
    diff = memory.review.propose(
        "alice", "student", AddItem(field="strengths", value="Grit"), "r", TURN
    )
    newer = memory.review.propose(
        "alice", "student", AddItem(field="strengths", value="Wit"), "r", TURN
    )
    missing = "f" * 32
    before = (memory.diffs.list("alice"), memory.git.head("alice"), memory.git.head("bob"))

    def refusal(diff_id: str, call: Any) -> str:
        with pytest.raises(UnknownDiff) as caught:
            call(diff_id)
        return str(caught.value).replace(diff_id, "<id>")

    attempts = [
        lambda d: memory.diffs.get(d, "bob"),
        lambda d: memory.review.approve(d, "bob", user_id="bob"),
        lambda d: memory.review.reject(d, "bob", "no", user_id="bob"),
        lambda d: memory.review.expire(d, "bob"),
        lambda d: memory.review.commit_approved(d, "bob"),
        lambda d: memory.review.preview(d, "bob"),
    ]
    for attempt in attempts:
        assert refusal(newer.id, attempt) == refusal(missing, attempt)
    assert memory.diffs.find(newer.id, "bob") is None
    assert memory.diffs.superseded_by("bob", [newer.id]) == []
    assert (memory.diffs.list("alice"), memory.git.head("alice"), memory.git.head("bob")) == (
        before
    )

    assert memory.diffs.find(newer.id, "alice") == newer
    assert [d.id for d in memory.diffs.superseded_by("alice", [newer.id])] == [diff.id]


def test_same_tool_call_in_two_users_turns_proposes_two_diffs(memory: MemoryRig) -> None:
    """Tool diff ids derive from (user, turn, call): the same ids in bob's turn are his."""
    memory.blocks.ensure_user("alice")
    memory.blocks.ensure_user("bob")
    op = LearnPreference(preference="Socratic")
    alice = memory.review.propose("alice", "human", op, "r", TURN, diff_id="a" * 32)
    # Proposing again under the same id returns the stored diff only to its own user.
    assert memory.review.propose("alice", "human", op, "r", TURN, diff_id="a" * 32) == alice
    assert memory.diffs.find("a" * 32, "bob") is None
    assert memory.review.pending("bob") == []


async def test_two_users_sending_the_same_turn_id_get_their_own_turns(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    script: list[dict[str, Any]] = [
        {"content": [edit_block("student", field="name", operation="set", value="Alice")]},
        {"text": "Welcome, Alice."},
        {"content": [edit_block("student", field="name", operation="set", value="Bob")]},
        {"text": "Welcome, Bob."},
    ]
    settings = rig_settings(tmp_path / "data")
    async with running_rig(temporal_env.client, settings, script) as rig:
        alice = await rig.client.send_message("alice", "Hi, I'm Alice", turn_id="t1")
        bob = await rig.client.send_message("bob", "Hi, I'm Bob", turn_id="t1")
        assert (alice.reply, bob.reply) == ("Welcome, Alice.", "Welcome, Bob.")
        # The model was called for both turns, each time with that user's own message.
        requests = rig.model_server.requests
        assert len(requests) == 4
        asked = [str(r["messages"][0]["content"]) for r in requests]
        assert ["Hi, I'm Alice" in a for a in asked] == [True, True, False, False]
        assert ["Hi, I'm Bob" in a for a in asked] == [False, False, True, True]

        stack = rig.stack
        [alice_diff], [bob_diff] = alice.diffs, bob.diffs
        assert alice_diff.id != bob_diff.id
        assert stack.review.get(alice_diff.id, "alice").effective_operation.model_dump()[
            "value"
        ] == ("Alice")
        assert stack.review.get(bob_diff.id, "bob").effective_operation.model_dump()["value"] == (
            "Bob"
        )
        assert stack.recall.turn("bob", "t1")[0].content == "Hi, I'm Bob"
        with pytest.raises(UnknownDiff):
            await rig.client.approve(alice_diff.id, "bob", user_id="bob")

        approved = await rig.client.approve(bob_diff.id, "ms-rivera", user_id="bob")
        assert approved is not None
        assert approved.status is DiffStatus.APPROVED
        assert stack.blocks.read_block("bob", "student").fields["name"] == "Bob"
        assert stack.blocks.read_block("alice", "student").fields["name"] is None
        assert stack.review.get(alice_diff.id, "alice").status is DiffStatus.PENDING
        await rig.client.reject(alice_diff.id, "ms-rivera", "not now", user_id="alice")
