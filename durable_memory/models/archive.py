"""Archival memory: passages of text the agent can search later."""

from datetime import datetime
from enum import StrEnum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from durable_memory.models.limits import (
    MAX_PASSAGE_CHARS,
    MAX_PASSAGE_TAGS,
    MAX_QUERY_CHARS,
    MAX_TAG_CHARS,
)


class PassageSource(StrEnum):
    ROTATION = "rotation"
    """Full text of a block before rotation compressed it."""
    TASK = "task"
    """A finished task (clear_task with archive)."""
    AGENT = "agent"
    """The model's archival_memory_insert."""
    IMPORT = "import"


class TagMatch(StrEnum):
    ANY = "any"
    ALL = "all"


class NewPassage(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    user_id: str
    text: str = Field(min_length=1, max_length=MAX_PASSAGE_CHARS)
    tags: tuple[str, ...] = ()
    """At most MAX_PASSAGE_TAGS, each 1-MAX_TAG_CHARS characters: the archive checks them."""
    source: PassageSource
    label: str | None = None
    """The block it was rotated out of."""
    commit_sha: str | None = None
    """The commit whose block content it is (rotation)."""
    created_at: datetime | None = None
    """Defaults to now when inserted."""
    dedupe_key: str | None = None
    """What makes two inserts the same passage; defaults to the text. Rotation uses the block's
    content at its commit, so a retry whose header time differs is still the same passage."""


class Passage(BaseModel):
    model_config = ConfigDict(frozen=True)

    id: str
    user_id: str
    text: str
    tags: tuple[str, ...]
    source: PassageSource
    label: str | None
    commit_sha: str | None
    chunk: int
    """Index of this chunk within a long text (0 for a text that fit in one)."""
    created_at: datetime


class PassageHit(BaseModel):
    model_config = ConfigDict(frozen=True)

    passage: Passage
    score: float


class ArchiveSearch(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    query: str = Field(default="", max_length=MAX_QUERY_CHARS)
    tags: tuple[Annotated[str, Field(max_length=MAX_TAG_CHARS)], ...] = Field(
        default=(), max_length=MAX_PASSAGE_TAGS
    )
    tag_match: TagMatch = TagMatch.ANY
    start: datetime | None = None
    end: datetime | None = None
    top_k: int = Field(default=10, ge=1, le=100)
    alpha: float = Field(default=0.5, ge=0.0, le=1.0)
    """Fusion weight: 1.0 is pure vector search, 0.0 pure BM25 (Weaviate's convention)."""
