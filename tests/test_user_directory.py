"""Registering users (every turn registers its own): a user already recorded is found by a
read and nothing is written; only those not found are inserted, once, however many callers
register them at once, on SQLite and PostgreSQL."""

import threading

from sqlalchemy import Engine
from sqlmodel import Session, select

from durable_memory.memory.store.users import REGISTER_BATCH, UserDirectory, UserRow


def _rows(engine: Engine) -> dict[str, object]:
    with Session(engine) as session:
        return {r.user_id: r.registered_at for r in session.exec(select(UserRow)).all()}


def test_a_known_user_keeps_their_row_and_only_new_ones_are_added(engine: Engine) -> None:
    users = UserDirectory(engine)
    users.register(["ada"])
    first = _rows(engine)
    users.register(["ada", "bob", "ada", "bob"])  # repeats in one call, known and new mixed
    rows = _rows(engine)
    assert set(rows) == {"ada", "bob"}
    assert rows["ada"] == first["ada"]  # left as it was, not written again
    assert users.users() == ["ada", "bob"]


def test_more_users_than_a_batch_are_all_registered(engine: Engine) -> None:
    users = UserDirectory(engine)
    many = [f"u{n:05d}" for n in range(REGISTER_BATCH + 7)]
    users.register(many[:10])
    users.register(many)
    assert sorted(_rows(engine)) == many


def test_registering_at_once_from_many_threads_records_each_user_once(engine: Engine) -> None:
    users = UserDirectory(engine)
    start = threading.Barrier(8)
    errors: list[BaseException] = []

    def register(n: int) -> None:
        try:
            start.wait()
            users.register(["ada", f"only-{n}", "bob"])
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=register, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert sorted(_rows(engine)) == sorted(["ada", "bob", *(f"only-{n}" for n in range(8))])
