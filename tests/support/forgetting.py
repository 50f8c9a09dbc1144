"""A user's forget run from inside another request's long wait (a model call, an embedding),
and what is left of the user afterwards: for the tests of requests that race a forget."""

from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine, text

from durable_memory.memory.archive.protocol import ArchiveStore
from durable_memory.memory.store.erasure import USER_TABLES, ErasureLedger, erase_user_rows
from durable_memory.memory.store.git import GitBlockStore


def rows_of(engine: Engine, user_id: str) -> dict[str, int]:
    """How many rows of the user each table keyed by user holds (the tables with any)."""
    counts = {}
    with engine.connect() as connection:
        for table in USER_TABLES:
            query = text(f"SELECT count(*) FROM {table} WHERE user_id = :user")
            counts[table] = connection.execute(query, {"user": user_id}).scalar_one()
    return {table: n for table, n in counts.items() if n}


def forget_begins(
    engine: Engine,
    stage: str,
    archive: ArchiveStore | None = None,
    git: GitBlockStore | None = None,
    user_id: str = "alice",
) -> Callable[[], None]:
    """The forget's steps, at once, up to `stage`: "opened" (its record), "emptied" (the
    rows, and the archive's passages and the repository when given, deleted too) or
    "completed" (its record closed)."""

    def forget() -> None:
        ledger = ErasureLedger(engine)
        ledger.begin(user_id, "dpo@school", "asked")
        if stage != "opened":
            erase_user_rows(engine, user_id)
            if archive is not None:
                archive.forget_user(user_id)
            if git is not None:
                git.forget_user(user_id)
        if stage == "completed":
            ledger.complete(user_id)

    return forget


class EmbeddingAcrossAForget:
    """An archive's embedder, running `meanwhile` while it embeds passages (an insert embeds
    for seconds, longer when it waits for a slot)."""

    def __init__(self, inner: Any, meanwhile: Callable[[], None]) -> None:
        self.inner, self.meanwhile = inner, meanwhile
        self.name, self.dim = inner.name, inner.dim

    def embed_passages(self, texts: list[str]) -> Any:
        self.meanwhile()
        return self.inner.embed_passages(texts)

    def embed_query(self, text: str) -> Any:
        return self.inner.embed_query(text)
