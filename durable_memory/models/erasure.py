"""The record of a user's erasure (`dmem forget`), and what a forget workflow is given."""

from datetime import datetime
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

from durable_memory.models.turn import ID_SEPARATOR, UserId


def forget_workflow_id(user_id: str) -> str:
    """One forget per user at a time: a second request while one runs joins it."""
    return f"forget{ID_SEPARATOR}{user_id}"


class ErasureRecord(BaseModel):
    """Who asked to forget a user, why and when; the user only as a SHA-256 of their id."""

    model_config = ConfigDict(frozen=True)

    user_hash: str
    requested_by: str
    reason: str
    started_at: datetime
    completed_at: datetime | None = None
    """None while the erasure is under way."""


class ForgetInput(BaseModel):
    model_config = ConfigDict(frozen=True)

    user_id: UserId
    requested_by: str = Field(min_length=1, max_length=200)
    reason: str = Field(min_length=1, max_length=2000)


class ForgetStore(StrEnum):
    """The stores a forget empties of a user, in the order it does (bootstrap.forget_in)."""

    ARCHIVE = "archive"
    """Passages: the embedded store, PostgreSQL, or the user's Weaviate tenant."""
    REPOSITORY = "repository"
    """The git repository: local, or the remote's and this host's clone."""
    ROWS = "rows"
    """Pending diffs, recall and its index, turn bookkeeping, summaries, rotation state, and
    last the user's row in the list of users."""


class ForgetStep(BaseModel):
    model_config = ConfigDict(frozen=True)

    user_id: UserId
    store: ForgetStore


class ForgetOutcome(BaseModel):
    model_config = ConfigDict(frozen=True)

    record: ErasureRecord
    deleted: dict[str, int]
    """Per step, how many things it deleted (rows, passages, repositories, executions)."""
