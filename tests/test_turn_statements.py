"""A turn's SQL statements are built once and run with their values bound, not built anew by
every call: SQLAlchemy spends ~50 us building and keying a fresh statement for its compiled
cache, about twice what running it on SQLite costs, and a tool-using turn runs some 30
(store/sql.py `keyed`, docs/benchmarks.md). Measured without a clock: after a warm-up turn,
every statement a turn's steps execute must be an object some earlier turn executed too."""

from typing import Any

from sqlalchemy import Engine, event

from durable_memory.models.turn import TurnInput
from tests.support.agent_helpers import run_turn_steps, scripted_steps, tool_use
from tests.support.memory import MemoryRig

SEARCH = tool_use("conversation_search", query="essay")
TURNS = 4
"""Each a tool-using turn (model, search, model) then a plain one."""


def test_a_warm_turn_runs_only_statements_built_before(memory: MemoryRig, engine: Engine) -> None:
    executed: list[list[Any]] = []  # the statement objects themselves: kept alive, so no
    # statement built later can take the id of one freed

    def record(_conn: Any, clauseelement: Any, *_: Any) -> None:
        if executed:
            executed[-1].append(clauseelement)

    script: list[dict[str, Any]] = [
        {"content": [{"type": "text", "text": "Let me look."}, SEARCH]},
        {"text": "Found nothing."},
        {"text": "Hello."},
    ] * TURNS
    event.listen(engine, "before_execute", record)
    try:
        with scripted_steps(memory, engine, script) as (steps, _):
            for i in range(TURNS):
                executed.append([])
                for say in ("search", "hello"):
                    turn = TurnInput(user_id="alice", turn_id=f"t{i}-{say}", message=say)
                    assert run_turn_steps(steps, turn, 8).reply
    finally:
        event.remove(engine, "before_execute", record)

    assert len(executed[-1]) >= 40  # the two turns' steps really ran their statements
    built_before = {id(s) for turn in executed[:-1] for s in turn}
    fresh = [str(s).split("\n")[0] for s in executed[-1] if id(s) not in built_before]
    assert fresh == [], f"built anew by the last turn: {fresh}"
