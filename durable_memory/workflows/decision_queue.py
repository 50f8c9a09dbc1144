"""The queue that serialises a turn's decisions, and the answers waiting for their callers.

A decision arrives as a signal (nobody waits for its answer) or as an Update (its handler
waits until the answer for its ticket is posted). The workflow takes decisions in arrival
order, one at a time, and posts each answer; once the queue is closed it takes no more, and
closing hands back whatever was still queued so that each can be answered with the truth.

Plain, deterministic data: no Temporal calls, no clock, no randomness, so the workflow can
hold it as state and tests can drive it directly. Tickets are numbered 1, 2, 3... in the
order Updates arrive, which replay reproduces.
"""

from collections import deque
from dataclasses import dataclass
from typing import Generic, TypeVar

from durable_memory.models.turn import DiffDecision

Answer = TypeVar("Answer")


class DecisionQueueClosed(RuntimeError):
    """A decision was added after `close()`; callers check `closed` first."""


@dataclass(frozen=True)
class QueuedDecision:
    decision: DiffDecision
    ticket: int | None
    """The Update's ticket its handler waits on; None for a signal, which has no caller."""


class DecisionQueue(Generic[Answer]):
    def __init__(self) -> None:
        self._waiting: deque[QueuedDecision] = deque()
        self._answers: dict[int, Answer] = {}
        self._last_ticket = 0
        self._closed = False

    def __len__(self) -> int:
        return len(self._waiting)

    def __bool__(self) -> bool:
        return bool(self._waiting)

    @property
    def closed(self) -> bool:
        return self._closed

    def add_signal(self, decision: DiffDecision) -> None:
        self._add(QueuedDecision(decision, None))

    def add_update(self, decision: DiffDecision) -> int:
        """Queue an Update's decision; returns the ticket its answer will be posted under."""
        ticket = self._last_ticket + 1
        self._add(QueuedDecision(decision, ticket))
        self._last_ticket = ticket
        return ticket

    def _add(self, queued: QueuedDecision) -> None:
        if self._closed:
            raise DecisionQueueClosed(f"decision on {queued.decision.diff_id} after close")
        self._waiting.append(queued)

    def pop(self) -> QueuedDecision:
        """The oldest queued decision; IndexError if none is queued."""
        return self._waiting.popleft()

    def close(self) -> list[QueuedDecision]:
        """Take no more decisions; returns those still queued, oldest first, to be answered."""
        self._closed = True
        left = list(self._waiting)
        self._waiting.clear()
        return left

    def post(self, ticket: int, answer: Answer) -> None:
        """Post the answer for the Update holding `ticket`."""
        if ticket in self._answers:
            raise ValueError(f"ticket {ticket} is already answered")
        self._answers[ticket] = answer

    def is_answered(self, ticket: int) -> bool:
        return ticket in self._answers

    def take_answer(self, ticket: int) -> Answer:
        """The posted answer for `ticket`, removed (each is read once); KeyError if none."""
        return self._answers.pop(ticket)
