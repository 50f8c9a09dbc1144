"""Redacting a text from a user's archival passages (`dmem redact`): every passage whose text
or tags hold it is replaced by one with the text REDACTED (embedded again, so no vector is
left computed from the text) and its commit id mapped to the rewritten history's; so is every
passage that holds no text but names a rewritten commit (its text unchanged), so none points
at a commit that is gone. The old passage is deleted after. Insert before delete: a kill in
between leaves both, and the next run finds the old one again. Idempotent.

A store that keeps deleted bytes until compaction (the embedded SQLite archive's full-text
index and WAL) is compacted last, by its `purge_deleted` if it has one.
"""

from collections.abc import Callable, Mapping

from durable_memory.memory.archive.protocol import ArchiveStore
from durable_memory.memory.store.redaction.history import REDACTED
from durable_memory.models.archive import NewPassage, Passage

PAGE = 200


def _holds(passage: Passage, needle: str) -> bool:
    return needle in passage.text or any(needle in tag for tag in passage.tags)


def _passages(
    archive: ArchiveStore, user_id: str, wanted: Callable[[Passage], bool]
) -> list[Passage]:
    found: list[Passage] = []
    offset = 0
    while page := archive.page(user_id, limit=PAGE, offset=offset):
        found.extend(p for p in page if wanted(p))
        offset += len(page)
    return found


def count_passages_holding(archive: ArchiveStore, user_id: str, needle: str) -> int:
    return len(_passages(archive, user_id, lambda p: _holds(p, needle)))


def redact_passages(
    archive: ArchiveStore, user_id: str, needle: str, commits: Mapping[str, str]
) -> int:
    """Replace every passage of the user holding the text (how many there were), or naming
    a rewritten commit."""
    old = _passages(
        archive, user_id, lambda p: _holds(p, needle) or (p.commit_sha or "") in commits
    )
    for passage in old:
        text = passage.text.replace(needle, REDACTED)
        mapped = commits.get(passage.commit_sha or "")
        archive.insert(
            NewPassage(
                user_id=user_id,
                text=text,
                tags=tuple(tag.replace(needle, REDACTED) for tag in passage.tags),
                source=passage.source,
                label=passage.label,
                commit_sha=mapped or passage.commit_sha,
                created_at=passage.created_at,
                # Keyed by its new commit too: a passage whose text is unchanged gets a new
                # id, never its old one, which is deleted below.
                dedupe_key=f"{mapped}\0{text}" if mapped else None,
            )
        )
    archive.delete(user_id, [p.id for p in old])
    purge = getattr(archive, "purge_deleted", None)
    if purge is not None:
        purge()
    return sum(_holds(passage, needle) for passage in old)
