"""Pending diffs: an agent's proposed edit, waiting for a human decision."""

from datetime import datetime
from enum import StrEnum

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


class PendingDiff(BaseModel):
    model_config = ConfigDict(frozen=True)

    id: str
    user_id: str
    label: str
    operation: EditOperation
    base_sha: str | None
    reasoning: str
    proposed_by: str
    """Who proposed it: `turn:<turn id>` for the agent, or another actor."""
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
    def effective_operation(self) -> EditOperation:
        return self.edited_operation or self.operation
