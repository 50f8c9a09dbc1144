"""A forget that begins while a turn's step runs leaves none of that turn's rows behind, on
SQLite and PostgreSQL. The forget empties the stores after its record opens; a step that ran
long (a summary while the context compiles, the model call) may write after that emptying.
Each step checks the erasure record after the turn's writes: a forget it sees has the step
delete the user's rows itself before it refuses (all but the user's row in `users` while
the forget is under way: the forget deletes that one last). Nothing is written after.

Driven here by the forget's own steps run from inside the step (record opened, rows emptied,
record completed or not), at the two places a step waits long: the compile and the model
call.

A turn that began before a forget stays out of the user's memory even once the user was
started afresh (a caller's `fresh_user`) while the turn's step still ran: every step compares
the erasure ledger with what the turn's first check saw, refuses, and deletes nothing, since
what the user has now is their new memory."""

from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine

import durable_memory.memory.agent.steps as steps_module
from durable_memory.memory.agent.steps import TurnSteps
from durable_memory.memory.archive.embedders import default_embedder
from durable_memory.memory.archive.protocol import ArchiveStore
from durable_memory.memory.archive.sqlite import SqliteArchive
from durable_memory.memory.core.errors import StoreBusy, UserBeingForgotten, UserForgotten
from durable_memory.memory.store.erasure import ErasureLedger
from durable_memory.memory.store.summaries import SummaryStore
from durable_memory.models.recall import MessageRole, NewMessage
from durable_memory.models.turn import StepInput, TurnInput
from tests.support.agent_helpers import (
    agent_test_profile,
    edit_block,
    run_turn_steps,
    scripted_steps,
    tool_use,
)
from tests.support.forgetting import EmbeddingAcrossAForget, forget_begins, rows_of
from tests.support.memory import MemoryRig, memory_rig

ARCHIVE = tool_use("archival_memory_insert", content="Alice drafts her essays at night.")


STAGES = ["opened", "emptied", "completed"]
"""How far the forget got while the step ran: its record opened; its stores emptied too (the
emptying a long step outlives); its record completed."""


def answering_then(steps: TurnSteps, meanwhile: Callable[[], None]) -> None:
    """The steps' model answers, then `meanwhile` runs before the step sees the answer (a
    model call or summary taking a minute, a forget's whole run)."""
    calling = steps.model.create

    def create(*args: Any, **kwargs: Any) -> Any:
        reply = calling(*args, **kwargs)
        meanwhile()
        return reply

    steps.model = type("AnsweringLate", (), {"create": staticmethod(create)})()


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
            stored = steps.run_tools_in_context(first).context
            assert stored is not None
            context = stored
            assert archive.count("alice") == 1
        answering_then(steps, forget_begins(engine, stage, archive))
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


def forgotten_and_started_afresh(
    steps: TurnSteps, engine: Engine, archive: ArchiveStore | None, afresh: dict[str, Any]
) -> Callable[[], None]:
    """The whole forget of alice, then a new turn of hers that starts her afresh, with the
    turn id her old turn had (a caller numbering turns again for a user begun anew): her new
    memory's rows go into `afresh`."""

    def forget_then_start_afresh() -> None:
        forget_begins(engine, "completed", archive)()
        fresh = TurnInput(user_id="alice", turn_id="t1", message="I am new", fresh_user=True)
        steps.prepare_context(fresh)
        afresh.update(rows_of(engine, "alice"))

    return forget_then_start_afresh


def assert_only_the_new_memory(
    memory: MemoryRig, engine: Engine, afresh: dict[str, Any], bob_before: dict[str, int]
) -> None:
    assert afresh
    assert rows_of(engine, "alice") == afresh
    recalled = memory.recall.turn("alice", "t1", 0)
    assert [m.content for m in recalled] == ["I am new"]
    assert rows_of(engine, "bob") == bob_before


@pytest.mark.usefixtures("earlier_turn")
@pytest.mark.parametrize("step", [1, 2])
def test_a_turn_begun_before_a_forget_writes_nothing_once_the_user_is_started_afresh(
    memory: MemoryRig, engine: Engine, step: int, tmp_path: Path
) -> None:
    """Alice's turn waits on the model while she is forgotten and a new turn of hers starts
    her afresh. The late reply is refused: not stored into her new memory, and her new
    memory not emptied by the old turn's cleanup (which a forget under way would have)."""
    bob = rows_of(engine, "bob")
    script: list[dict[str, Any]] = [{"content": [ARCHIVE]}, {"text": "Noted."}]
    archive = SqliteArchive(tmp_path / "archive.db", default_embedder())
    afresh: dict[str, Any] = {}
    with closing(archive), scripted_steps(memory, engine, script, archive) as (steps, server):
        turn = TurnInput(user_id="alice", turn_id="t1", message="I write essays")
        prepared, context = steps.prepare_context(turn)
        assert prepared.erasures_seen == 0
        where = StepInput(user_id="alice", turn_id="t1", step=1, erasures_seen=0)
        if step == 2:
            steps.call_model(where, context)
            tools = steps.run_tools_in_context(where)
            assert tools.context is not None
            assert tools.erasures_seen == 0
            context = tools.context
            where = StepInput(user_id="alice", turn_id="t1", step=2, erasures_seen=0)
        answering_then(steps, forgotten_and_started_afresh(steps, engine, archive, afresh))
        with pytest.raises(UserForgotten, match="started afresh since") as refused:
            steps.call_model(where, context)
        assert refused.value.started_afresh
        assert len(server.requests) == step
        assert archive.count("alice") == 0  # the forget took the passage; none came back
        # The same step run again (a retry) is refused the same way, and writes nothing.
        with pytest.raises(UserForgotten, match="started afresh since"):
            steps.call_model(where)
        with pytest.raises(UserForgotten, match="started afresh since"):
            steps.run_tools(where)
    assert_only_the_new_memory(memory, engine, afresh, bob)


def test_a_summary_made_before_a_forget_is_not_stored_once_the_user_is_started_afresh(
    engine: Engine, data_dir: Path
) -> None:
    """The context overflows, so prepare asks the model for a summary (up to a minute);
    meanwhile alice is forgotten and started afresh. The summary of her old conversation
    is not stored into her new memory, nor the old turn's context or prompt base."""
    memory = memory_rig(engine, data_dir, agent_test_profile(context_window=4000))
    words = "words " * 120  # 16 of them overflow 0.9 of the 4,000-token window
    for user in ("alice", "bob"):
        memory.blocks.ensure_user(user)
        for i in range(16):
            memory.recall.append(
                user, f"old{i}", [NewMessage(role=MessageRole.USER, content=words)]
            )
    bob = rows_of(engine, "bob")
    afresh: dict[str, Any] = {}
    script: list[dict[str, Any]] = [{"text": "Alice wrote many words."}]
    with scripted_steps(memory, engine, script) as (steps, server):
        answering_then(steps, forgotten_and_started_afresh(steps, engine, None, afresh))
        turn = TurnInput(user_id="alice", turn_id="t1", message="one more")
        with pytest.raises(UserForgotten, match="started afresh since"):
            steps.prepare_context(turn)
        assert len(server.requests) == 1  # the summary call
    assert SummaryStore(engine).latest("alice") is None
    assert_only_the_new_memory(memory, engine, afresh, bob)


def test_the_ledger_refuses_a_turn_begun_before_a_forget_even_after_a_fresh_start(
    engine: Engine,
) -> None:
    """`since` is the newest record the turn's first check saw: a forget begun after it
    refuses the turn, open, completed or completed and started afresh; the user's own new
    turns (which saw the newest record) pass, and so does a step without `since` (from a
    history before turns carried it) once the user was started afresh."""
    ledger = ErasureLedger(engine)
    assert ledger.refuse_if_forgotten("alice") == 0
    assert ledger.refuse_if_forgotten("alice", 0) == 0
    ledger.begin("alice", "dpo@school", "asked")
    with pytest.raises(UserBeingForgotten):
        ledger.refuse_if_forgotten("alice", 0)
    ledger.complete("alice")
    with pytest.raises(UserForgotten) as forgotten:
        ledger.refuse_if_forgotten("alice", 0)
    assert not forgotten.value.started_afresh
    ledger.readmit("alice")
    with pytest.raises(UserForgotten) as refused:
        ledger.refuse_if_forgotten("alice", 0)
    assert refused.value.started_afresh
    seen = ledger.refuse_if_forgotten("alice")
    assert seen > 0
    assert ledger.refuse_if_forgotten("alice", seen) == seen
    # Another user's forget is not alice's: her turn begun before it goes on.
    ledger.begin("bob", "dpo@school", "asked")
    ledger.complete("bob")
    assert ledger.refuse_if_forgotten("alice", seen) == seen
    # Forgotten again: her turn begun in the second memory is refused in the third.
    ledger.begin("alice", "dpo@school", "asked again")
    ledger.complete("alice")
    ledger.readmit("alice")
    with pytest.raises(UserForgotten, match="started afresh since"):
        ledger.refuse_if_forgotten("alice", seen)


@pytest.mark.usefixtures("earlier_turn")
def test_a_cleanup_spares_a_new_memory_begun_while_it_ran(
    memory: MemoryRig, engine: Engine, tmp_path: Path
) -> None:
    """The late step of alice's old turn finds her forgotten (not yet started afresh) and
    deletes what its turn wrote: while it empties the archive, a new turn of hers starts her
    afresh. The rows' deletion asks the ledger again in its own transaction, so her new
    memory stays whole; and a cleanup that begins after the fresh start empties nothing."""
    bob = rows_of(engine, "bob")
    archive = SqliteArchive(tmp_path / "archive.db", default_embedder())
    script: list[dict[str, Any]] = [{"text": "late"}]
    afresh: dict[str, Any] = {}
    with closing(archive), scripted_steps(memory, engine, script, archive) as (steps, _):
        turn = TurnInput(user_id="alice", turn_id="t1", message="I write essays")
        prepared, context = steps.prepare_context(turn)
        forget_user = archive.forget_user

        def started_afresh_meanwhile(user_id: str) -> int:
            deleted = forget_user(user_id)
            fresh = TurnInput(user_id="alice", turn_id="t1", message="I am new", fresh_user=True)
            steps.prepare_context(fresh)
            afresh.update(rows_of(engine, "alice"))
            return deleted

        def forgotten_during_the_call() -> None:
            forget_begins(engine, "completed", archive)()
            # The old step's cleanup empties the archive: alice is started afresh meanwhile.
            archive.forget_user = started_afresh_meanwhile  # type: ignore[method-assign]

        answering_then(steps, forgotten_during_the_call)
        where = StepInput(user_id="alice", turn_id="t1", step=1, erasures_seen=0)
        with pytest.raises(UserForgotten) as refused:
            steps.call_model(where, context)
        assert not refused.value.started_afresh  # decided before the fresh start
        assert prepared.erasures_seen == 0
    assert_only_the_new_memory(memory, engine, afresh, bob)


@pytest.mark.usefixtures("earlier_turn")
@pytest.mark.parametrize("afresh", [False, True], ids=["forgotten", "started-afresh"])
def test_a_forget_during_a_tools_insert_leaves_nothing_of_the_turn(
    memory: MemoryRig, engine: Engine, tmp_path: Path, afresh: bool
) -> None:
    """The model's archive insert embeds its passage while alice is forgotten (and, in the
    second case, started afresh by a new turn). The insert checks between its embedding
    and its write: the passage is not stored, the tool's result not recorded, the model
    not asked again; forgotten, her rows are deleted; started afresh, her new memory is
    exactly what the new turn wrote. The same for `run_tools` alone (the step-limit step),
    which has no model call after it to check."""
    bob = rows_of(engine, "bob")
    script: list[dict[str, Any]] = [{"content": [ARCHIVE]}, {"text": "Noted."}]
    archive = SqliteArchive(tmp_path / "archive.db", default_embedder())
    new_memory: dict[str, Any] = {}
    with closing(archive), scripted_steps(memory, engine, script, archive) as (steps, server):
        turn = TurnInput(user_id="alice", turn_id="t1", message="I write essays")
        _, context = steps.prepare_context(turn)
        where = StepInput(user_id="alice", turn_id="t1", step=1, erasures_seen=0)
        steps.call_model(where, context)
        forget = (
            forgotten_and_started_afresh(steps, engine, archive, new_memory)
            if afresh
            else forget_begins(engine, "completed", archive)
        )
        archive.embedder = EmbeddingAcrossAForget(archive.embedder, forget)
        with pytest.raises(UserForgotten) as refused:
            steps.run_tools(where)
        assert refused.value.started_afresh is afresh
        assert len(server.requests) == 1
        assert archive.count("alice") == 0
    if afresh:
        assert_only_the_new_memory(memory, engine, new_memory, bob)
    else:
        assert rows_of(engine, "alice") == {}
        assert rows_of(engine, "bob") == bob


@pytest.mark.usefixtures("earlier_turn")
def test_a_forget_during_a_tools_proposal_leaves_nothing_of_the_turn(
    memory: MemoryRig, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model's edit is proposed (a pending diff stored) while alice's forget runs its
    emptying: `run_tools` alone (the step-limit step) checks after its tools, so the
    proposal does not outlive the forget, and the tool's result is not recorded."""
    bob = rows_of(engine, "bob")
    edit = edit_block("student", field="name", operation="set", value="Vera")
    script: list[dict[str, Any]] = [{"content": [edit]}]
    with scripted_steps(memory, engine, script) as (steps, _):
        turn = TurnInput(user_id="alice", turn_id="t1", message="I build robots")
        _, context = steps.prepare_context(turn)
        where = StepInput(user_id="alice", turn_id="t1", step=1, erasures_seen=0)
        steps.call_model(where, context)
        propose = steps.tools.review.propose

        def proposing_during_the_forget(*args: Any, **kwargs: Any) -> Any:
            forget_begins(engine, "emptied")()  # the record opened, the rows emptied
            return propose(*args, **kwargs)

        monkeypatch.setattr(steps.tools.review, "propose", proposing_during_the_forget)
        with pytest.raises(UserBeingForgotten):
            steps.run_tools(where)
    assert_nothing_left(engine, "emptied", bob)
