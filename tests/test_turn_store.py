"""The turn store keeps the first context and the first reply stored for a step, whoever
stores it: attempts of one step running at once (a retry beside a zombie attempt) all get the
same one back, on SQLite and PostgreSQL; a context dropped between attempts is stored again."""

from concurrent.futures import ThreadPoolExecutor

from sqlalchemy import Engine, func, select

from durable_memory.memory.store.turns import TurnStepRow, TurnStore
from tests.test_isolation import _context, _reply

ATTEMPTS = 8


def test_attempts_saving_one_step_at_once_all_get_the_first_reply(engine: Engine) -> None:
    turns = TurnStore(engine)
    with ThreadPoolExecutor(ATTEMPTS) as pool:
        kept = list(
            pool.map(
                lambda n: turns.save_reply("alice", "t1", 1, _reply(f"attempt {n}")).text,
                range(ATTEMPTS),
            )
        )
    assert len(set(kept)) == 1
    assert turns.reply("alice", "t1", 1) == _reply(kept[0])
    with engine.connect() as connection:
        rows = connection.execute(select(func.count()).select_from(TurnStepRow)).scalar_one()
    assert rows == 1


def test_a_context_dropped_between_attempts_is_stored_again(engine: Engine) -> None:
    turns = TurnStore(engine)
    assert turns.save_context("alice", "t1", _context("first")).system == "first"
    assert turns.save_context("alice", "t1", _context("second")).system == "first"
    turns.drop_context("alice", "t1")
    assert turns.save_context("alice", "t1", _context("third")).system == "third"
    assert turns.context("alice", "t1").system == "third"
