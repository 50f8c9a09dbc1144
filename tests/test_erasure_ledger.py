"""The erasure ledger decides which of a user's records is the newest by the order the
database gave them (their ids), never by `started_at`, the clock of whichever host began the
forget: hosts' clocks differ. On SQLite and PostgreSQL, through every reader of the ledger."""

from datetime import timedelta

import pytest
from sqlalchemy import Engine, update
from sqlmodel import Session, select

from durable_memory.memory.core.errors import UserBeingForgotten, UserForgotten
from durable_memory.memory.store.erasure import (
    ErasureLedger,
    ErasureRow,
    erase_user_rows,
    user_hash,
)
from durable_memory.memory.store.users import UserDirectory


def _set_clock_back(engine: Engine, record_id: int, by: timedelta) -> None:
    """The record's `started_at` as a host whose clock is `by` behind would have written it."""
    with Session(engine) as session:
        row = session.exec(select(ErasureRow).where(ErasureRow.id == record_id)).one()
        session.execute(
            update(ErasureRow)
            .where(ErasureRow.id == record_id)  # type: ignore[arg-type]
            .values(started_at=row.started_at - by)
        )
        session.commit()


def test_a_forget_begun_on_a_host_whose_clock_is_behind_still_closes_the_user(
    engine: Engine,
) -> None:
    """Alice is forgotten and started afresh; she is forgotten again from a host whose clock
    is an hour behind the first one's. The second forget's record is the newest: she is
    closed by it, the ledger's every reader says so, and starting her afresh again marks it
    (not the first one) readmitted."""
    ledger = ErasureLedger(engine)
    users = UserDirectory(engine)
    ledger.begin("alice", "dpo@school", "asked")
    ledger.complete("alice")
    ledger.readmit("alice")
    first = ledger.refuse_if_forgotten("alice")
    users.register(["alice"])  # her new memory
    ledger.begin("alice", "dpo@school", "asked again")
    with Session(engine) as session:
        second_id = max(r.id or 0 for r in session.exec(select(ErasureRow)).all())
    assert second_id > first
    _set_clock_back(engine, second_id, timedelta(hours=1))
    with pytest.raises(UserBeingForgotten):
        ledger.refuse_if_forgotten("alice")
    ledger.complete("alice")

    for since in (None, first):  # a new turn, and a late step of a turn of her second memory
        with pytest.raises(UserForgotten) as refused:
            ledger.refuse_if_forgotten("alice", since)
        assert not refused.value.started_afresh
    assert ledger.closed_user_hashes() == {user_hash("alice")}
    # A late step's cleanup empties her second memory: she is closed.
    assert erase_user_rows(engine, "alice", only_while_closed=True) == 1
    assert [r.reason for r in ledger.records("alice")] == ["asked again", "asked"]

    ledger.readmit("alice")
    assert ledger.refuse_if_forgotten("alice") == second_id
    with pytest.raises(UserForgotten, match="started afresh since"):
        ledger.refuse_if_forgotten("alice", first)
    assert ledger.closed_user_hashes() == set()
    with Session(engine) as session:
        readmitted = {r.id: r.readmitted_at is not None for r in session.exec(select(ErasureRow))}
    assert readmitted == {first: True, second_id: True}
    users.register(["alice"])
    assert erase_user_rows(engine, "alice", only_while_closed=True) == 0  # open: nothing
