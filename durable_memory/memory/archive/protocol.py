"""The archival memory interface; backends live in memory/archive/sqlite.py,
memory/archive/postgres.py and memory/archive/weaviate.py."""

import unicodedata
import uuid
from collections.abc import Callable
from typing import Protocol

from durable_memory.memory.archive.embedders import Embedder, Vector
from durable_memory.memory.core.errors import DurableMemoryError
from durable_memory.memory.core.ids import validate_user_id
from durable_memory.memory.core.limits import LimitExceeded
from durable_memory.memory.core.tokens import count_tokens, split_tokens
from durable_memory.models.archive import ArchiveSearch, NewPassage, Passage, PassageHit
from durable_memory.models.limits import MAX_PASSAGE_TAGS, MAX_TAG_CHARS, MAX_TOOL_ARGUMENT_CHARS

PASSAGE_NAMESPACE = uuid.UUID("5b0e3c1e-4a7f-4d2e-9f57-6f1d0c2b8a11")

AGENT_INSERT_TOKEN_LIMIT = 8192
"""Letta's limit on one archival insert by the model."""


def passage_id(user_id: str, source: str, text: str, chunk: int = 0) -> str:
    """A deterministic id: a retried insert of the same text is the same passage."""
    return str(uuid.uuid5(PASSAGE_NAMESPACE, f"{user_id}\x00{source}\x00{chunk}\x00{text}"))


class ArchiveStore(Protocol):
    """Passages per user; every call is scoped to one user."""

    def insert(
        self,
        passage: NewPassage,
        *,
        chunk: bool = False,
        before_write: Callable[[], object] | None = None,
    ) -> list[str]:
        """Store the passage (split into chunks when `chunk`, else refused when too long);
        idempotent: inserting the same text again returns the same ids and stores nothing.
        `before_write`: called once the text is embedded (which may take seconds), before
        anything is stored; what it raises stores nothing (a turn's erasure check)."""
        ...

    def search(self, user_id: str, request: ArchiveSearch) -> list[PassageHit]: ...

    def count(self, user_id: str) -> int: ...

    def page(self, user_id: str, *, limit: int = 50, offset: int = 0) -> list[Passage]:
        """Passages newest first, for listing and export."""
        ...

    def delete(self, user_id: str, ids: list[str]) -> int: ...

    def forget_user(self, user_id: str) -> int:
        """Delete every passage of the user, leaving nothing of them in the store (idempotent);
        how many passages there were."""
        ...


SYSTEM_CHUNK_TOKENS = 512
"""Chunk size for text archived by the system: the embedder reads 512 tokens at most."""


class ArchiveError(DurableMemoryError):
    """A bad archive request or an archive that cannot be used."""


def check_passage(passage: NewPassage, *, chunk: bool) -> list[str]:
    """Validate a passage; return its chunks (one unless `chunk` and the text is long)."""
    validate_user_id(passage.user_id)
    if not passage.text.strip():
        raise ArchiveError("an archival passage needs some text")
    if len(passage.tags) > MAX_PASSAGE_TAGS:
        raise ArchiveError(f"at most {MAX_PASSAGE_TAGS} tags per passage, got {len(passage.tags)}")
    for tag in passage.tags:
        if not tag or len(tag) > MAX_TAG_CHARS or any(unicodedata.category(c) == "Cc" for c in tag):
            raise ArchiveError(
                f"invalid tag {tag!r:.70}: 1-{MAX_TAG_CHARS} characters, no control characters"
            )
    if chunk:
        return chunk_text(passage.text, SYSTEM_CHUNK_TOKENS)
    if len(passage.text) > MAX_TOOL_ARGUMENT_CHARS:  # refused before tokenising all of it
        raise LimitExceeded(
            "the passage",
            len(passage.text),
            MAX_TOOL_ARGUMENT_CHARS,
            "split it into several inserts",
        )
    tokens = count_tokens(passage.text)
    if tokens > AGENT_INSERT_TOKEN_LIMIT:
        raise ArchiveError(
            f"passage is {tokens} tokens, over the archival limit of {AGENT_INSERT_TOKEN_LIMIT}; "
            "split it into several inserts"
        )
    return [passage.text]


def chunk_text(text: str, max_tokens: int) -> list[str]:
    """Split on line boundaries into chunks of at most `max_tokens`; an over-long line is cut
    at token boundaries. Nothing is lost: the chunks in order hold every character."""
    chunks: list[str] = []
    current: list[str] = []
    size = 0
    for line in text.split("\n"):
        cost = count_tokens(line) + 1
        if cost > max_tokens:
            if current:
                chunks.append("\n".join(current))
                current, size = [], 0
            chunks.extend(split_tokens(line, max_tokens))
            continue
        if size + cost > max_tokens and current:
            chunks.append("\n".join(current))
            current, size = [], 0
        current.append(line)
        size += cost
    if current:
        chunks.append("\n".join(current))
    return chunks


def chunk_ids(passage: NewPassage, chunks: list[str]) -> list[str]:
    key = passage.dedupe_key if passage.dedupe_key is not None else passage.text
    return [passage_id(passage.user_id, passage.source.value, key, i) for i in range(len(chunks))]


def missing_chunks(
    ids: list[str], chunks: list[str], known: set[str]
) -> list[tuple[int, str, str]]:
    """(chunk index, passage id, text) of the chunks not stored yet: what an insert must add."""
    return [
        (i, pid, text)
        for i, (pid, text) in enumerate(zip(ids, chunks, strict=True))
        if pid not in known
    ]


def embed_for_writing(
    embedder: Embedder,
    todo: list[tuple[int, str, str]],
    before_write: Callable[[], object] | None,
) -> Vector:
    """The vectors of the chunks an insert adds (`missing_chunks`), then `before_write`: every
    backend's one place between its embedding (seconds for a long text) and its write."""
    vectors = embedder.embed_passages([text for _, _, text in todo])
    if before_write is not None:
        before_write()
    return vectors


def relative_score_fusion(
    vector: dict[str, float], keyword: dict[str, float], alpha: float
) -> dict[str, float]:
    """Weaviate's relativeScoreFusion: each leg min-max normalised (best 1, worst 0; a leg of
    equal scores gives 1), weighted `alpha` for vectors and `1 - alpha` for BM25; an object
    missing from a leg scores 0 there."""

    def normalise(scores: dict[str, float]) -> dict[str, float]:
        if not scores:
            return {}
        low, high = min(scores.values()), max(scores.values())
        span = high - low
        return {k: (v - low) / span if span > 0 else 1.0 for k, v in scores.items()}

    v, k = normalise(vector), normalise(keyword)
    return {
        key: alpha * v.get(key, 0.0) + (1 - alpha) * k.get(key, 0.0) for key in v.keys() | k.keys()
    }
