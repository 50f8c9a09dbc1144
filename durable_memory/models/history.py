"""What the git store reports about commits and who makes them."""

from datetime import datetime
from enum import StrEnum

from pydantic import BaseModel, ConfigDict


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
