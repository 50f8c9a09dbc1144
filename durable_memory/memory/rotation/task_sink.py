"""Finished tasks into archival memory: the faces' `TaskArchive` (memory/service/access.py)
on an ArchiveStore."""

from collections.abc import Callable

from durable_memory.memory.archive.protocol import ArchiveStore
from durable_memory.models.archive import NewPassage, PassageSource


class ArchiveTaskSink:
    """The faces' TaskArchive on an ArchiveStore: finished tasks become passages."""

    def __init__(self, archive: ArchiveStore) -> None:
        self.archive = archive

    def archive_task(
        self,
        user_id: str,
        text: str,
        *,
        dedupe_key: str,
        before_write: Callable[[], object] | None = None,
    ) -> list[str]:
        return self.archive.insert(
            NewPassage(
                user_id=user_id,
                text=text,
                tags=("task",),
                source=PassageSource.TASK,
                dedupe_key=dedupe_key,
            ),
            chunk=True,
            before_write=before_write,
        )
