"""The turn's decision queue on its own: arrival order, tickets for Updates only, answers read
once, and closing hands back what was still queued."""

import pytest

from durable_memory.models.turn import DiffDecision
from durable_memory.workflows.decision_queue import (
    DecisionQueue,
    DecisionQueueClosed,
    QueuedDecision,
)


def _decision(n: int, kind: str = "approve") -> DiffDecision:
    return DiffDecision.model_validate(
        {"diff_id": f"{n:032x}", "user_id": "alice", "decision": kind, "approver": "ms-rivera"}
    )


def test_decisions_come_out_in_arrival_order_signals_without_a_ticket() -> None:
    queue: DecisionQueue[str] = DecisionQueue()
    assert not queue
    first = queue.add_update(_decision(1))
    queue.add_signal(_decision(2, "reject"))
    second = queue.add_update(_decision(3))
    assert (first, second) == (1, 2)
    assert len(queue) == 3
    assert [queue.pop(), queue.pop(), queue.pop()] == [
        QueuedDecision(_decision(1), 1),
        QueuedDecision(_decision(2, "reject"), None),
        QueuedDecision(_decision(3), 2),
    ]
    assert not queue
    with pytest.raises(IndexError):
        queue.pop()


def test_an_answer_is_posted_once_and_read_once() -> None:
    queue: DecisionQueue[str] = DecisionQueue()
    ticket = queue.add_update(_decision(1))
    assert not queue.is_answered(ticket)
    queue.post(ticket, "approved")
    assert queue.is_answered(ticket)
    with pytest.raises(ValueError, match="already answered"):
        queue.post(ticket, "rejected")
    assert queue.take_answer(ticket) == "approved"
    assert not queue.is_answered(ticket)
    with pytest.raises(KeyError):
        queue.take_answer(ticket)


def test_answers_wait_for_their_own_ticket_in_any_order() -> None:
    queue: DecisionQueue[str] = DecisionQueue()
    tickets = [queue.add_update(_decision(n)) for n in range(3)]
    queue.post(tickets[2], "third")
    queue.post(tickets[0], "first")
    assert [queue.is_answered(t) for t in tickets] == [True, False, True]
    assert queue.take_answer(tickets[2]) == "third"
    assert queue.take_answer(tickets[0]) == "first"


def test_closing_returns_what_was_queued_and_refuses_more() -> None:
    queue: DecisionQueue[str] = DecisionQueue()
    queue.add_signal(_decision(1))
    ticket = queue.add_update(_decision(2))
    assert not queue.closed
    assert queue.close() == [
        QueuedDecision(_decision(1), None),
        QueuedDecision(_decision(2), ticket),
    ]
    assert queue.closed
    assert not queue
    assert queue.close() == []  # closing again is harmless
    with pytest.raises(DecisionQueueClosed):
        queue.add_signal(_decision(3))
    with pytest.raises(DecisionQueueClosed):
        queue.add_update(_decision(4))
    queue.post(ticket, "refused")  # a handler already waiting still gets its answer
    assert queue.take_answer(ticket) == "refused"


def test_tickets_are_the_same_on_every_run() -> None:
    """Replay rebuilds the queue from history: the same arrivals give the same tickets."""

    def run() -> list[int]:
        queue: DecisionQueue[str] = DecisionQueue()
        queue.add_signal(_decision(1))
        return [queue.add_update(_decision(n)) for n in range(2, 5)]

    assert run() == run() == [1, 2, 3]
