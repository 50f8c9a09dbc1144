"""Redacting a text from a user's archival passages (`dmem redact`): every passage whose text
or tags hold it is replaced by one with the text REDACTED (embedded again, so no vector is
left computed from the text) and its commit id mapped to the rewritten history's; then the
old passage is deleted. Insert before delete: a kill in between leaves both, and the next run
finds the old one again. Idempotent.

A store that keeps deleted bytes until compaction (the embedded SQLite archive's full-text
index and WAL) is compacted last, by its `purge_deleted` if it has one.
"""

from collections.abc import Mapping

from durable_memory.memory.archive.protocol import ArchiveStore
from durable_memory.memory.store.redaction.history import REDACTED
from durable_memory.models.archive import NewPassage, Passage

PAGE = 200


def _holding(archive: ArchiveStore, user_id: str, needle: str) -> list[Passage]:
    found: list[Passage] = []
    offset = 0
    while page := archive.page(user_id, limit=PAGE, offset=offset):
        found.extend(p for p in page if needle in p.text or any(needle in t for t in p.tags))
        offset += len(page)
    return found


def count_passages_holding(archive: ArchiveStore, user_id: str, needle: str) -> int:
    return len(_holding(archive, user_id, needle))


def redact_passages(
    archive: ArchiveStore, user_id: str, needle: str, commits: Mapping[str, str]
) -> int:
    """Replace every passage of the user holding the text; how many there were."""
    old = _holding(archive, user_id, needle)
    for passage in old:
        archive.insert(
            NewPassage(
                user_id=user_id,
                text=passage.text.replace(needle, REDACTED),
                tags=tuple(tag.replace(needle, REDACTED) for tag in passage.tags),
                source=passage.source,
                label=passage.label,
                commit_sha=commits.get(passage.commit_sha or "", passage.commit_sha),
                created_at=passage.created_at,
            )
        )
    archive.delete(user_id, [p.id for p in old])
    purge = getattr(archive, "purge_deleted", None)
    if purge is not None:
        purge()
    return len(old)
