"""The erasure ledger decides which of a user's records is the newest by the order the
database gave them (their ids), never by `started_at`, the clock of whichever host began the
forget: hosts' clocks differ. On SQLite and PostgreSQL, through every reader of the ledger."""

from collections.abc import Callable
from datetime import timedelta
from functools import partial

import pytest
from sqlalchemy import Engine, update
from sqlmodel import Session, select

from durable_memory.memory.core.errors import (
    UserBeingForgotten,
    UserBeingRedacted,
    UserForgotten,
)
from durable_memory.memory.store.erasure import (
    ErasureLedger,
    ErasureRow,
    erase_user_rows,
    user_hash,
)
from durable_memory.memory.store.redaction.gate import RedactionGate
from durable_memory.memory.store.users import AdmissionRead, UserDirectory


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


def _answer(check: Callable[[], int]) -> tuple[str, object]:
    """What an erasure check answers: the `since` it returns, or its refusal (class, whether
    the user was started afresh since, message)."""
    try:
        return ("admitted", check())
    except (UserBeingForgotten, UserForgotten) as refused:
        afresh = getattr(refused, "started_afresh", None)
        return (type(refused).__name__, (afresh, str(refused)))


def test_a_turns_admission_read_decides_as_the_ledger_does_and_sees_only_its_user(
    engine: Engine,
) -> None:
    """A turn reads the erasure ledger, the redaction gate and the user list in one statement
    where its admission asks them together (`UserDirectory.admission`). At every state of a
    user's records (none, a forget under way, completed, started afresh, forgotten again),
    and for every `since` a turn may carry, the check decided on that read answers what the
    ledger's own read answers; the gate's record and the listing are the user's own, whoever
    else has rows; and the read is as the database was, not as it will be."""
    ledger, users, gate = ErasureLedger(engine), UserDirectory(engine), RedactionGate(engine)
    # Neighbours whose ids share a prefix with hers, each with rows of every kind.
    for other in ("alic", "alice2"):
        users.register([other])
        gate.open(other, "r-" + other, "dpo@school")
        ledger.begin(other, "dpo@school", "theirs")

    def same_answers(user_id: str) -> AdmissionRead:
        read = users.admission(user_id)
        records = [(r.requested_by, r.completed_at, r.readmitted_at) for r in read.erasures]
        assert [(b, c is None, r is None) for b, c, r in records] == [
            (r.requested_by, r.completed_at is None, r.readmitted_at is None)
            for r in ledger.records(user_id)  # newest first, as the ledger lists them
        ]
        sinces: list[int | None] = [None, 0, *(r.id for r in read.erasures)]
        for since in sinces:
            mine = _answer(partial(users.refuse_if_forgotten, user_id, since, read=read))
            assert mine == _answer(partial(ledger.refuse_if_forgotten, user_id, since))
        return read

    empty = same_answers("alice")
    assert (empty.erasures, empty.redaction, empty.listed) == ([], None, False)
    users.register(["alice"])
    gate.open("alice", "r1", "editor@school")
    read = same_answers("alice")
    assert read.listed
    assert read.redaction is not None
    assert read.redaction.requested_by == "editor@school"
    with pytest.raises(UserBeingRedacted, match="editor@school"):
        gate.admit_turn_as_read("alice", "t1", read.redaction)
    gate.close("alice")
    assert read.redaction is not None  # what was read stays what it was
    assert same_answers("alice").redaction is None

    ledger.begin("alice", "dpo@school", "asked")
    under_way = same_answers("alice")
    assert _answer(lambda: users.refuse_if_forgotten("alice", read=under_way))[0] == (
        "UserBeingForgotten"
    )
    ledger.complete("alice")
    erase_user_rows(engine, "alice")
    closed = same_answers("alice")
    assert (len(closed.erasures), closed.listed) == (1, False)
    ledger.readmit("alice")
    users.register(["alice"])
    same_answers("alice")
    ledger.begin("alice", "dpo@school", "asked again")
    ledger.complete("alice")
    again = same_answers("alice")
    assert [r.id for r in again.erasures] == sorted((r.id for r in again.erasures), reverse=True)
    assert len(again.erasures) == 2
    ledger.readmit("alice")
    same_answers("alice")
    for other in ("alic", "alice2"):  # theirs, untouched by hers
        theirs = users.admission(other)
        assert (len(theirs.erasures), theirs.listed) == (1, True)
        assert theirs.redaction is not None
        assert theirs.redaction.requested_by == "dpo@school"
