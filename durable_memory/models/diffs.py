"""Pending diffs: an agent's proposed edit, waiting for a human decision."""

from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Self

from pydantic import BaseModel, ConfigDict

from durable_memory.models.operations import EditOperation


class DiffStatus(StrEnum):
    PENDING = "pending"
    APPROVED = "approved"
    """Decided; `commit_sha` is set once the commit exists (an approval is recorded first)."""
    REJECTED = "rejected"
    SUPERSEDED = "superseded"
    """A newer proposal for the same block replaced it before a decision."""
    EXPIRED = "expired"
    CONFLICTED = "conflicted"
    """Approved, but the block had changed so that the edit no longer applied: memory untouched."""


TURN_PROPOSER_PREFIX = "turn:"
STANDING_PREFIX = "standing:"
"""How a standing approval is named where a person's name would stand (the diff's decider,
the commit's Approved-By trailer): `standing:<policy id>` (memory/core/policies.py)."""


@dataclass(frozen=True)
class Proposer:
    """Who proposed a diff, typed. Stored as its text (`PendingDiff.proposed_by`, the commit's
    Proposed-By trailer): `turn:<turn id>` for the agent in a turn, anything else is another
    actor's name, kept as given."""

    text: str

    @classmethod
    def turn(cls, turn_id: str) -> Self:
        """The agent, proposing in turn `turn_id`."""
        return cls(TURN_PROPOSER_PREFIX + turn_id)

    @classmethod
    def parse(cls, text: str) -> Self:
        return cls(text)

    @property
    def turn_id(self) -> str | None:
        """The turn that proposed it, or None if no turn did."""
        if not self.text.startswith(TURN_PROPOSER_PREFIX):
            return None
        return self.text.removeprefix(TURN_PROPOSER_PREFIX)

    def __str__(self) -> str:
        return self.text


class PendingDiff(BaseModel):
    model_config = ConfigDict(frozen=True)

    id: str
    user_id: str
    label: str
    operation: EditOperation
    base_sha: str | None
    reasoning: str
    proposed_by: str
    """Who proposed it, as text: `proposer` is its typed form."""
    status: DiffStatus
    created_at: datetime
    decided_at: datetime | None = None
    decided_by: str | None = None
    decision_reason: str | None = None
    edited_operation: EditOperation | None = None
    """The reviewer's edited version, applied instead of `operation`."""
    commit_sha: str | None = None
    superseded_by: str | None = None
    summary: str = ""

    @property
    def proposer(self) -> Proposer:
        return Proposer.parse(self.proposed_by)

    @property
    def standing_approval(self) -> str | None:
        """The id of the standing approval that approved it, None if a person decided it."""
        decided_by = self.decided_by or ""
        return (
            decided_by.removeprefix(STANDING_PREFIX)
            if decided_by.startswith(STANDING_PREFIX)
            else None
        )

    @property
    def effective_operation(self) -> EditOperation:
        return self.edited_operation or self.operation
