"""A turn's SQL statements are built once and run with their values bound, not built anew by
every call: SQLAlchemy spends ~50 us building and keying a fresh statement for its compiled
cache, about twice what running it on SQLite costs, and a tool-using turn runs some 30
(store/sql.py `keyed`, docs/benchmarks.md). Measured without a clock: after a warm-up turn,
every statement a turn's steps execute must be an object some earlier turn executed too."""

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Engine, event

from durable_memory.memory.store.redaction.gate import RedactionGate
from durable_memory.models.diffs import DiffStatus
from durable_memory.models.recall import MessageRole
from durable_memory.models.turn import TurnInput
from tests.support.agent_helpers import run_turn_steps, scripted_steps, tool_use
from tests.support.memory import MemoryRig

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
    window, a listing by status and label) and the redaction gate's check, which the turns
    above do not reach in every shape: run for one user, then for another, the second runs
    only statements the first built."""
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
            gate.admit_turn(user_id, "t1")

        return run

    first = _executed(engine, reads("alice"))
    again = _executed(engine, reads("bob"))
    assert len(again) == len(first) >= 7
    built_before = {id(s) for s in first}
    fresh = [str(s).split("\n")[0] for s in again if id(s) not in built_before]
    assert fresh == [], f"built anew for the second user: {fresh}"
