"""A forget that begins while a turn's step runs leaves none of that turn's rows behind, on
SQLite and PostgreSQL. The forget empties the stores after its record opens; a step that ran
long (a summary while the context compiles, the model call) may write after that emptying.
Each step checks the erasure record after the turn's writes: a forget it sees has the step
delete the user's rows itself before it refuses (all but the user's row in `users` while
the forget is under way: the forget deletes that one last). Nothing is written after.

Driven here by the forget's own steps run from inside the step (record opened, rows emptied,
record completed or not), at the two places a step waits long: the compile and the model
call."""

from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, text

import durable_memory.memory.agent.steps as steps_module
from durable_memory.memory.archive.embedders import default_embedder
from durable_memory.memory.archive.protocol import ArchiveStore
from durable_memory.memory.archive.sqlite import SqliteArchive
from durable_memory.memory.core.errors import StoreBusy, UserBeingForgotten, UserForgotten
from durable_memory.memory.store.erasure import USER_TABLES, ErasureLedger, erase_user_rows
from durable_memory.models.turn import StepInput, TurnInput
from tests.support.agent_helpers import run_turn_steps, scripted_steps, tool_use
from tests.support.memory import MemoryRig

ARCHIVE = tool_use("archival_memory_insert", content="Alice drafts her essays at night.")


def rows_of(engine: Engine, user_id: str) -> dict[str, int]:
    """How many rows of the user each table keyed by user holds (the tables with any)."""
    counts = {}
    with engine.connect() as connection:
        for table in USER_TABLES:
            query = text(f"SELECT count(*) FROM {table} WHERE user_id = :user")
            counts[table] = connection.execute(query, {"user": user_id}).scalar_one()
    return {table: n for table, n in counts.items() if n}


STAGES = ["opened", "emptied", "completed"]
"""How far the forget got while the step ran: its record opened; its stores emptied too (the
emptying a long step outlives); its record completed."""


def forget_begins(
    engine: Engine, stage: str, archive: ArchiveStore | None = None
) -> Callable[[], None]:
    """The forget's steps, at once, up to `stage`."""

    def forget() -> None:
        ledger = ErasureLedger(engine)
        ledger.begin("alice", "dpo@school", "asked")
        if stage != "opened":
            erase_user_rows(engine, "alice")
            if archive is not None:
                archive.forget_user("alice")
        if stage == "completed":
            ledger.complete("alice")

    return forget


@pytest.fixture(params=STAGES)
def stage(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def earlier_turn(memory: MemoryRig, engine: Engine) -> None:
    """Alice has memory and a turn behind her (rows in most tables), Bob a turn too."""
    script: list[dict[str, Any]] = [{"text": "Hello Alice."}, {"text": "Hello Bob."}]
    with scripted_steps(memory, engine, script) as (steps, _):
        for user in ("alice", "bob"):
            run_turn_steps(steps, TurnInput(user_id=user, turn_id="t0", message="hi"), 8)


def refused_as(stage: str) -> type[Exception]:
    return UserForgotten if stage == "completed" else UserBeingForgotten


def assert_nothing_left(engine: Engine, stage: str, bob_before: dict[str, int]) -> None:
    left = rows_of(engine, "alice")
    # The step keeps her row in `users` while the forget is under way: it deletes that last.
    assert left == ({"users": 1} if stage == "opened" else {})
    assert rows_of(engine, "bob") == bob_before  # nobody else's rows


@pytest.mark.usefixtures("earlier_turn")
def test_a_forget_that_begins_while_the_context_compiles_leaves_no_row(
    memory: MemoryRig, engine: Engine, stage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """prepare ensures the user (the first check), records the message, compiles (where a
    summary can take a minute), stores the context and moves the prompt base: the forget
    begins during the compile, and its emptying passes before those writes."""
    bob = rows_of(engine, "bob")
    compile_context = steps_module.turn_context

    def compiling(*args: Any, **kwargs: Any) -> Any:
        compiled = compile_context(*args, **kwargs)
        forget_begins(engine, stage)()
        return compiled

    monkeypatch.setattr(steps_module, "turn_context", compiling)
    with scripted_steps(memory, engine, [{"text": "never asked"}]) as (steps, server):
        turn = TurnInput(user_id="alice", turn_id="t1", message="I write essays")
        with pytest.raises(refused_as(stage)):
            steps.prepare_context(turn)
        assert server.requests == []
    assert_nothing_left(engine, stage, bob)


@pytest.mark.usefixtures("earlier_turn")
@pytest.mark.parametrize("step", [1, 2])
def test_a_forget_that_begins_during_a_model_call_leaves_no_row(
    memory: MemoryRig, engine: Engine, stage: str, step: int, tmp_path: Path
) -> None:
    """The model answers after the forget began and its emptying passed: the reply is not
    stored, and the turn's rows (its message, context, and for step 2 the first step's
    reply, its tool's result and the passage it archived) are gone."""
    bob = rows_of(engine, "bob")
    script: list[dict[str, Any]] = [{"content": [ARCHIVE]}, {"text": "Noted."}]
    archive = SqliteArchive(tmp_path / "archive.db", default_embedder())
    with closing(archive), scripted_steps(memory, engine, script, archive) as (steps, server):
        turn = TurnInput(user_id="alice", turn_id="t1", message="I write essays")
        _, context = steps.prepare_context(turn)
        first = StepInput(user_id="alice", turn_id="t1", step=1)
        if step == 2:
            steps.call_model(first, context)
            _, stored = steps.run_tools_in_context(first)
            assert stored is not None
            context = stored
            assert archive.count("alice") == 1
        model = steps.model
        calling = model.create

        def answering_after_the_forget(*args: Any, **kwargs: Any) -> Any:
            reply = calling(*args, **kwargs)
            forget_begins(engine, stage, archive)()
            return reply

        steps.model = type(
            "ForgottenDuringTheCall", (), {"create": staticmethod(answering_after_the_forget)}
        )()
        where = StepInput(user_id="alice", turn_id="t1", step=step)
        with pytest.raises(refused_as(stage)):
            steps.call_model(where, context)
        assert len(server.requests) == step  # the model was asked, its answer not kept
        assert archive.count("alice") == 0
    assert_nothing_left(engine, stage, bob)


@pytest.mark.usefixtures("earlier_turn")
def test_a_cleanup_that_fails_leaves_the_refusal_and_does_the_rest(
    memory: MemoryRig,
    engine: Engine,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The rows' deletion failing (SQLite's WAL kept by a reader: StoreBusy, a store down)
    neither replaces the refusal, which is the answer (nothing retries a turn the forget
    ended), nor keeps the archived passage from being deleted; it is logged, for `dmem
    forget` run again."""
    script: list[dict[str, Any]] = [{"content": [ARCHIVE]}, {"text": "Noted."}]
    archive = SqliteArchive(tmp_path / "archive.db", default_embedder())

    def busy(*_: Any, **__: Any) -> int:
        raise StoreBusy("a reader kept the SQLite WAL from being emptied; the step is retried")

    with closing(archive), scripted_steps(memory, engine, script, archive) as (steps, _):
        turn = TurnInput(user_id="alice", turn_id="t1", message="I write essays")
        _, context = steps.prepare_context(turn)
        first = StepInput(user_id="alice", turn_id="t1", step=1)
        steps.call_model(first, context)
        steps.run_tools_in_context(first)
        assert archive.count("alice") == 1
        forget_begins(engine, "opened")()
        monkeypatch.setattr(steps_module, "erase_user_rows", busy)
        with pytest.raises(UserBeingForgotten):
            steps.call_model(StepInput(user_id="alice", turn_id="t1", step=2))
        assert archive.count("alice") == 0
    assert "`dmem forget` run again deletes it" in caplog.text
    assert "StoreBusy" in caplog.text
