"""A turn's SQL statements are built once and run with their values bound, not built anew by
every call: SQLAlchemy spends ~50 us building and keying a fresh statement for its compiled
cache, about twice what running it on SQLite costs, and a tool-using turn runs some 30
(store/sql `keyed`, docs/benchmarks.md). Measured without a clock: after a warm-up turn,
every statement a turn's steps execute must be an object some earlier turn executed too."""

import traceback
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.pq import TransactionStatus
from sqlalchemy import Engine, event
from temporalio.testing import ActivityEnvironment

from durable_memory.activities.turn import TurnActivities
from durable_memory.bootstrap import open_stack
from durable_memory.config import Settings
from durable_memory.memory.agent.llm import AnthropicModel
from durable_memory.memory.archive.embedders import default_embedder
from durable_memory.memory.archive.postgres import PostgresArchive
from durable_memory.memory.store.redaction.gate import RedactionGate
from durable_memory.models.archive import NewPassage, PassageSource
from durable_memory.models.diffs import DiffStatus
from durable_memory.models.recall import MessageRole
from durable_memory.models.turn import StepInput, TurnInput
from durable_memory.scripted_model import ScriptedModelServer
from tests.support.agent_helpers import edit_block, run_turn_steps, scripted_steps, tool_use
from tests.support.memory import MemoryRig, round_trips
from tests.support.postgres import fresh_schema_url

SEARCH = tool_use("conversation_search", query="essay")
TURNS = 4
"""Each a tool-using turn (model, search, model) then a plain one."""


def test_a_warm_turn_runs_only_statements_built_before(memory: MemoryRig, engine: Engine) -> None:
    script: list[dict[str, Any]] = [
        {"content": [{"type": "text", "text": "Let me look."}, SEARCH]},
        {"text": "Found nothing."},
        {"text": "Hello."},
    ] * TURNS
    # The statement objects themselves, kept alive: no statement built later can take the id
    # of one freed.
    executed: list[list[Any]] = []
    with scripted_steps(memory, engine, script) as (steps, _):
        for i in range(TURNS):

            def both_turns(i: int = i) -> None:
                for say in ("search", "hello"):
                    turn = TurnInput(user_id="alice", turn_id=f"t{i}-{say}", message=say)
                    assert run_turn_steps(steps, turn, 8).reply

            executed.append(_executed(engine, both_turns))

    assert len(executed[-1]) >= 40  # the two turns' steps really ran their statements
    built_before = {id(s) for turn in executed[:-1] for s in turn}
    fresh = [str(s).split("\n")[0] for s in executed[-1] if id(s) not in built_before]
    assert fresh == [], f"built anew by the last turn: {fresh}"


def _executed(engine: Engine, call: Callable[[], object]) -> list[Any]:
    """The statement objects `call` executes on `engine`."""
    executed: list[Any] = []

    def record(_conn: Any, clauseelement: Any, *_: Any) -> None:
        executed.append(clauseelement)

    event.listen(engine, "before_execute", record)
    try:
        call()
    finally:
        event.remove(engine, "before_execute", record)
    return executed


def test_each_shape_of_a_filtered_read_is_built_once(memory: MemoryRig, engine: Engine) -> None:
    """The reads whose statement depends on the filters given (a search with roles and a time
    window, a listing by status and label) and the redaction gate's own check (a decision's
    and a rotation's), which the turns above do not reach in every shape: run for one user,
    then for another, the second runs only statements the first built."""
    gate = RedactionGate(engine)
    now = datetime.now(UTC)

    def reads(user_id: str) -> Callable[[], object]:
        def run() -> None:
            memory.recall.search(
                user_id,
                "essay",
                roles=[MessageRole.USER],
                start=now - timedelta(days=1),
                end=now + timedelta(days=1),
            )
            memory.recall.search(user_id, "", roles=[MessageRole.ASSISTANT], offset=1)
            memory.diffs.list(user_id, [DiffStatus.PENDING], label="human")
            memory.diffs.list(user_id, limit=5)
            gate.refuse_if_open(user_id)

        return run

    first = _executed(engine, reads("alice"))
    again = _executed(engine, reads("bob"))
    assert len(again) == len(first) >= 7
    built_before = {id(s) for s in first}
    fresh = [str(s).split("\n")[0] for s in again if id(s) not in built_before]
    assert fresh == [], f"built anew for the second user: {fresh}"


@pytest.mark.postgres
@pytest.mark.parametrize("engine", ["postgres"], indirect=True)
def test_a_turn_on_postgresql_wraps_no_lone_statement_in_a_transaction(
    memory: MemoryRig, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On PostgreSQL a statement that runs alone needs no transaction: BEGIN before it and
    COMMIT after cost two more round trips (~0.15 ms each on loopback, more across hosts),
    for nothing (one statement is atomic and sees one snapshot). So a turn's transactions
    each hold two or more statements that must agree; each lone read or write runs in
    autocommit (store/sql `reading`, `writing_once`). Seen at the driver: a statement run
    outside autocommit on an idle connection is the one that makes psycopg send BEGIN.
    Tool-using turns (a recall search, an archive search, a memory edit, then its approval)
    and plain ones. PostgreSQL only: SQLite's transactions are in-process, no round trip."""
    archive = PostgresArchive(engine.url.render_as_string(hide_password=False), default_embedder())
    tides = "The essay on tides was archived."
    archive.insert(NewPassage(user_id="alice", text=tides, source=PassageSource.AGENT))
    script: list[dict[str, Any]] = []
    for likes in ("Socratic questions", "worked examples"):
        edit = edit_block("human", operation="learn_preference", value=likes)
        script += [
            {"content": [{"type": "text", "text": "Let me look."}, SEARCH]},
            {"content": [tool_use("archival_memory_search", query="tides")]},
            {"content": [edit]},
            {"text": "Found it."},
            {"text": "Hello."},
        ]
    transactions: list[list[str]] = []
    open_on: dict[int, list[str]] = {}
    """The statements of the transaction open on each driver connection."""
    execute = psycopg.Cursor.execute

    def recording(cursor: psycopg.Cursor[Any], query: Any, *args: Any, **kwargs: Any) -> Any:
        driver = cursor.connection
        if not driver.autocommit:
            if driver.info.transaction_status == TransactionStatus.IDLE:
                open_on[id(driver)] = []  # psycopg sends BEGIN before this statement
                transactions.append(open_on[id(driver)])
            open_on[id(driver)].append(str(query).split("\n")[0][:80] + where_called())
        return execute(cursor, query, *args, **kwargs)

    monkeypatch.setattr(psycopg.Cursor, "execute", recording)
    try:
        with scripted_steps(memory, engine, script, archive) as (steps, _):
            for i in range(2):
                for say in ("search", "hello"):
                    turn = TurnInput(user_id="alice", turn_id=f"t{i}-{say}", message=say)
                    result = run_turn_steps(steps, turn, 8)
                    assert result.reply
                    for diff_id in result.diff_ids:  # and its approval, which commits
                        memory.review.approve(diff_id, "reviewer", user_id="alice")
    finally:
        archive.close()
    preferences = memory.blocks.read_block("alice", "human").fields["preferences"]
    assert preferences == ["Socratic questions", "worked examples"]
    lone = [t[0] for t in transactions if len(t) == 1]
    assert lone == [], f"a transaction around one statement: {lone}"


def where_called() -> str:
    """` @ file:line` of the innermost frame of ours that ran a statement."""
    for frame in reversed(traceback.extract_stack()):
        if "/durable_memory/" in frame.filename:
            return f" @ {Path(frame.filename).name}:{frame.lineno} {frame.name}"
    return ""


STATEMENT_BUDGET = {
    "plain": {"dmem.start_turn": 11},
    "tool": {"dmem.start_turn": 10, "dmem.tools_then_model": 11},
}
"""The statements each activity of a warm turn sends to the memory database (its user's
memory made by an earlier turn), BEGIN and COMMIT aside, on SQLite and PostgreSQL alike: each
is a round trip on the reply's path (~0.3 ms on SQLite, ~0.7 ms on PostgreSQL under load;
docs/benchmarks.md, the twelfth pass, which took them from 18, and 17 + 13 for a tool-using
turn whose tool is a recall search; the thirteenth took `tools_then_model` from 12: a step of
searches looks up no diff; the fourteenth took `start_turn` from 16 and 15: the redaction
gate, the erasure ledger and the user's listing read in one statement where a turn's
admission asks them together; the sixteenth took it to 11 and 10: the newest summary read with
the prompt base, and the approvals left uncommitted read only when the admission read says
there are some). A change that adds one says so here, and why."""


ROUND_TRIP_BUDGET = {
    "plain": {"dmem.start_turn": 8},
    "tool": {"dmem.start_turn": 8, "dmem.tools_then_model": 8},
}
"""The round trips to PostgreSQL those statements take (docs/benchmarks.md, the seventeenth
pass), where statements are sent together (`run_together`): a model step's reply, its
messages in recall and (the turn's last step) the dropped context (`TurnStore.save_new_reply`),
one round trip where they took three; the turn's message and the prompt base's read
(`PromptBaseStore.with_last_reply`'s `after`), one where they took two; and a tool step's
erasure check with its reply and context (`TurnStore.reply_and_context`), one where they
took two."""


@pytest.mark.parametrize(
    "database", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def test_a_warm_turns_activities_send_the_statements_budgeted(
    database: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    url = (
        None if database == "sqlite" else fresh_schema_url(request.getfixturevalue("postgres_url"))
    )
    stack = open_stack(tmp_path / "data", url, "essay_coach")
    script: list[dict[str, Any]] = [
        {"text": "Hello."},
        {"content": [{"type": "text", "text": "Let me look."}, SEARCH]},
        {"text": "Found nothing."},
        {"text": "Hello again."},
    ]
    with ScriptedModelServer(script) as server:
        model = AnthropicModel(base_url=server.url)
        activities = TurnActivities(stack, stack.turn_steps(model), Settings().turn_settings())
        env = ActivityEnvironment()
        try:
            env.run(activities.start_turn, TurnInput(user_id="alice", turn_id="t0", message="hi"))
            turn = TurnInput(user_id="alice", turn_id="t1", message="search")
            with round_trips(stack.engine) as tool:
                started = env.run(activities.start_turn, turn)
            step = StepInput(
                user_id="alice",
                turn_id="t1",
                step=1,
                erasures_seen=started.prepared.erasures_seen,
            )
            with round_trips(stack.engine) as merged:
                assert env.run(activities.tools_then_model, step).next.text == "Found nothing."
            with round_trips(stack.engine) as plain:
                again = TurnInput(user_id="alice", turn_id="t2", message="hello")
                assert env.run(activities.start_turn, again).first.text == "Hello again."
        finally:
            model.close()
            stack.close()
    sent = {
        "plain": {"dmem.start_turn": sum(map(len, plain))},
        "tool": {
            "dmem.start_turn": sum(map(len, tool)),
            "dmem.tools_then_model": sum(map(len, merged)),
        },
    }
    trips = {
        "plain": {"dmem.start_turn": len(plain)},
        "tool": {"dmem.start_turn": len(tool), "dmem.tools_then_model": len(merged)},
    }
    shown = [
        " + ".join(" ".join(s.split())[:100] for s in trip)
        for trip in [*plain, ["--"], *tool, ["--"], *merged]
    ]
    assert sent == STATEMENT_BUDGET, "\n".join(shown)
    # SQLite is in the process: no round trips to save, no statements sent together.
    assert trips == (ROUND_TRIP_BUDGET if database == "postgres" else sent), "\n".join(shown)
