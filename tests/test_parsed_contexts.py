"""A tool step reads its turn's stored context, and a process that stored that very text keeps
its value and does not parse it again (store/turns.py `_ParsedContexts`). What the step reads
is still the store's row: another text (another process's context, a rewrite) is parsed as
before, a user's entries are theirs only, the kept entries are bounded and go when the turn's
agent loop ends or the user is forgotten."""

from pathlib import Path
from typing import Any

from sqlalchemy import Engine, text

from durable_memory.bootstrap import open_stack
from durable_memory.memory.agent.context import model_request
from durable_memory.memory.store import turns as turn_store
from durable_memory.memory.store.turns import TurnStore
from durable_memory.models.turn import ForgetStore, StepInput, TurnInput
from tests.support.agent_helpers import scripted_steps, tool_use
from tests.support.memory import MemoryRig
from tests.test_isolation import _context

SEARCH = tool_use("conversation_search", query="essay")


def test_a_tool_step_reuses_the_context_its_turn_stored_and_sends_the_same_request(
    memory: MemoryRig, engine: Engine
) -> None:
    script: list[dict[str, Any]] = [
        {"content": [{"type": "text", "text": "Let me look."}, SEARCH]},
        {"text": "Found nothing."},
    ]
    turn = TurnInput(user_id="alice", turn_id="t1", message="hello")
    with scripted_steps(memory, engine, script) as (steps, server):
        _, context = steps.prepare_context(turn)
        steps.call_model(StepInput(user_id="alice", turn_id="t1", step=1), context, retried=False)
        run = steps.run_tools_in_context(StepInput(user_id="alice", turn_id="t1", step=1))
        assert run.context is context  # the value kept: not parsed again
        # A process that never saw it parses the row: the same value, the same request bytes.
        fresh = TurnStore(engine).stored_context("alice", "t1")
        assert fresh is not None
        assert fresh is not context
        assert fresh == context
        assert fresh.model_dump_json() == context.model_dump_json()
        for ttl in (None, "5m"):
            sent = model_request(context, [], ttl)
            assert model_request(fresh, [], ttl).model_dump_json() == sent.model_dump_json()
        assert len(steps.turns.parsed_contexts) == 1
        step_2 = StepInput(user_id="alice", turn_id="t1", step=2)
        assert steps.call_model(step_2, run.context, retried=False).text == "Found nothing."
        assert len(steps.turns.parsed_contexts) == 0  # the turn's last model call dropped it
        assert len(server.requests) == 2


def test_another_text_in_the_store_is_what_the_step_reads(engine: Engine) -> None:
    """The row rewritten after this process stored it (a redaction's rewrite, another
    process's retry that stored first): the store's text is parsed, not the kept value
    answered; and a row gone is gone."""
    store = TurnStore(engine)
    mine = store.save_context("alice", "t1", _context("alice's"))
    rewritten = _context("[redacted]")
    with engine.begin() as connection:
        connection.execute(
            text("UPDATE user_turn_contexts SET body = :body WHERE user_id = 'alice'"),
            {"body": rewritten.model_dump_json()},
        )
    assert store.stored_context("alice", "t1") == rewritten
    assert store.reply_and_context("alice", "t1", 1)[1] == rewritten
    assert store.stored_context("alice", "t1") != mine
    with engine.begin() as connection:
        connection.execute(text("DELETE FROM user_turn_contexts"))
    assert store.stored_context("alice", "t1") is None
    assert store.reply_and_context("alice", "t1", 1) == (None, None, [])


def test_users_sharing_a_turn_id_each_read_their_own(engine: Engine) -> None:
    store = TurnStore(engine)
    store.save_context("alice", "t1", _context("alice's"))
    store.save_context("bob", "t1", _context("bob's"))
    assert store.stored_context("alice", "t1").system == "alice's"  # type: ignore[union-attr]
    assert store.reply_and_context("bob", "t1", 1)[1].system == "bob's"  # type: ignore[union-attr]
    # A retry's save gets the context stored first back, for each user.
    assert store.save_context("bob", "t1", _context("bob again")).system == "bob's"


def test_the_kept_contexts_are_bounded(engine: Engine) -> None:
    store = TurnStore(engine)
    for i in range(turn_store.PARSED_CONTEXTS + 8):
        store.save_context("alice", f"t{i}", _context(f"context {i}"))
    assert len(store.parsed_contexts) == turn_store.PARSED_CONTEXTS
    # The oldest went first, and is parsed from the store again when read.
    kept = store.parsed_contexts.turns()
    assert kept[0] == ("alice", "t8")
    assert ("alice", "t0") not in kept
    oldest = store.stored_context("alice", "t0")
    assert oldest is not None
    assert oldest.system == "context 0"
    big = _context("x" * (turn_store.PARSED_CONTEXT_CHARS + 1))
    store.save_context("alice", "big", big)
    read = store.stored_context("alice", "big")
    assert read == big
    assert read is not big  # too long to keep
    assert len(store.parsed_contexts) <= turn_store.PARSED_CONTEXTS


def test_a_forget_drops_the_users_kept_contexts(tmp_path: Path) -> None:
    """The forget's deletion of the user's rows (`MemoryStack.forget_in`) drops this process's
    kept contexts of that user too: a forgotten user's text is not held until pushed out."""
    stack = open_stack(tmp_path / "data", profile="essay_coach")
    try:
        for user in ("alice", "alicia"):  # ids that share a prefix
            stack.turns.save_context(user, "t1", _context(f"{user}'s"))
        stack.forget_in("alice", ForgetStore.ROWS)
        assert stack.turns.stored_context("alice", "t1") is None
        assert [k[0] for k in stack.turns.parsed_contexts.turns()] == ["alicia"]
        assert stack.turns.stored_context("alicia", "t1").system == "alicia's"  # type: ignore[union-attr]
    finally:
        stack.close()
