"""The archival memory interface; backends live in memory/archive_sqlite.py and
memory/archive_weaviate.py."""

import uuid
from typing import Protocol

from durable_memory.models.archive import ArchiveSearch, NewPassage, Passage, PassageHit

PASSAGE_NAMESPACE = uuid.UUID("5b0e3c1e-4a7f-4d2e-9f57-6f1d0c2b8a11")

AGENT_INSERT_TOKEN_LIMIT = 8192
"""Letta's limit on one archival insert by the model."""


def passage_id(user_id: str, source: str, text: str, chunk: int = 0) -> str:
    """A deterministic id: a retried insert of the same text is the same passage."""
    return str(uuid.uuid5(PASSAGE_NAMESPACE, f"{user_id}\x00{source}\x00{chunk}\x00{text}"))


class ArchiveStore(Protocol):
    """Passages per user; every call is scoped to one user."""

    def insert(self, passage: NewPassage, *, chunk: bool = False) -> list[str]:
        """Store the passage (split into chunks when `chunk`, else refused when too long);
        idempotent: inserting the same text again returns the same ids and stores nothing."""
        ...

    def search(self, user_id: str, request: ArchiveSearch) -> list[PassageHit]: ...

    def count(self, user_id: str) -> int: ...

    def page(self, user_id: str, *, limit: int = 50, offset: int = 0) -> list[Passage]:
        """Passages newest first, for listing and export."""
        ...

    def delete(self, user_id: str, ids: list[str]) -> int: ...
