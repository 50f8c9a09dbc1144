"""What the git store reports about commits and who makes them, and what a redaction (the one
rewrite of history) is asked and records."""

from datetime import datetime
from enum import StrEnum
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from durable_memory.models.ids import LABEL
from durable_memory.models.turn import ID_SEPARATOR, UserId


class AuthorKind(StrEnum):
    USER = "user"
    """The user editing their own memory."""
    APPROVER = "approver"
    """A human who approved an agent's proposal."""
    SERVICE = "service"
    """A backend service calling a domain operation directly."""
    ROTATION = "rotation"
    SYSTEM = "system"
    """durable-memory itself (repository creation)."""


class Author(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    kind: AuthorKind


SYSTEM_AUTHOR = Author(name="durable-memory", kind=AuthorKind.SYSTEM)
"""durable-memory itself: it creates repositories and expires undecided diffs."""


class CommitInfo(BaseModel):
    model_config = ConfigDict(frozen=True)

    sha: str
    message: str
    author: str
    author_kind: str
    timestamp: datetime
    trailers: dict[str, str]


# -- redacting a text from a block's history (`dmem redact`, workflows/redact.py) ----------

MAX_REDACTED_CHARS = 2000

Label = Annotated[str, AfterValidator(LABEL.check)]


def redact_workflow_id(user_id: str) -> str:
    """One redaction per user at a time: a second request while one runs is refused by the
    server (the id is taken) and may be run again after."""
    return f"redact{ID_SEPARATOR}{user_id}"


class RedactInput(BaseModel):
    model_config = ConfigDict(frozen=True)

    user_id: UserId
    label: Label
    text: str = Field(min_length=1, max_length=MAX_REDACTED_CHARS, pattern=r"\S")
    """The text to remove from every version of the block (not blank)."""
    requested_by: str = Field(max_length=100, pattern=r"\S")
    reason: str = Field(max_length=2000, pattern=r"\S")
    delete_executions: bool = False
    """Also delete the user's ended workflow executions whose histories hold the text."""
    redaction_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    """Chosen by the caller: the record's `Redaction-Id` trailer, by which a redaction run
    again (a retry, a kill) finds that it is done."""


class RedactionRecord(BaseModel):
    """What a redaction did, as its record commit says it."""

    model_config = ConfigDict(frozen=True)

    redaction_id: str
    label: str
    text_sha256: str
    requested_by: str
    reason: str
    record_commit: str
    """The record: main's tip after the redaction."""
    old_head: str
    commits: dict[str, str]
    """Old -> new id of every commit the rewrite replaced."""
    redacted_at: datetime


class RedactOutcome(BaseModel):
    model_config = ConfigDict(frozen=True)

    record: RedactionRecord
    rows: int
    """SQL values (pending diffs, recall, summaries, turn bookkeeping) that held the text."""
    passages: int
    """Archival passages that held it (replaced and embedded again)."""
    executions_deleted: int = 0
    """Ended workflow executions of the user whose histories held it, deleted."""
