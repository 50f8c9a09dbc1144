"""The memory's faces over real stores, without Temporal, an archive or the rest of the stack,
for tests of the domain; the stores are there too, for tests that look beneath the faces."""

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, event

from durable_memory.bootstrap import memory_faces
from durable_memory.memory.agent.context import ContextSources
from durable_memory.memory.core.profiles import ProfileCatalog, load_profile
from durable_memory.memory.service import MemoryFaces
from durable_memory.memory.service.access import TaskArchive
from durable_memory.memory.store.diffs import DiffStore
from durable_memory.memory.store.git import GitBlockStore
from durable_memory.memory.store.recall import RecallStore
from durable_memory.memory.store.summaries import SummaryStore
from durable_memory.memory.store.users import UserDirectory
from durable_memory.models.blocks import AgentProfile


@dataclass(frozen=True, kw_only=True)
class MemoryRig(MemoryFaces):
    profile: AgentProfile
    git: GitBlockStore
    diffs: DiffStore
    recall: RecallStore

    @classmethod
    def open(
        cls,
        profile: AgentProfile,
        git: GitBlockStore,
        diffs: DiffStore,
        recall: RecallStore,
        archive: TaskArchive | None = None,
    ) -> "MemoryRig":
        faces = memory_faces(
            ProfileCatalog(profile), git, diffs, UserDirectory(diffs.engine), archive
        )
        return cls(
            **faces.faces(),
            profile=profile,
            git=git,
            diffs=diffs,
            recall=recall,
        )

    def sources(self, summaries: SummaryStore) -> ContextSources:
        return ContextSources(self.blocks, self.review, self.recall, summaries)


def memory_rig(
    engine: Engine,
    data_dir: Path,
    profile: AgentProfile | str = "essay_coach",
    archive: TaskArchive | None = None,
) -> MemoryRig:
    loaded = profile if isinstance(profile, AgentProfile) else load_profile(profile)
    git = GitBlockStore(data_dir)
    return MemoryRig.open(loaded, git, DiffStore(engine), RecallStore(engine), archive)


@contextlib.contextmanager
def statements_sent(engine: Engine) -> Iterator[list[str]]:
    """The SQL statements sent to `engine`'s database within the block (BEGIN and COMMIT are
    not cursor statements, so they are not among them)."""
    sent: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        sent.append(statement)

    event.listen(engine, "before_cursor_execute", record)
    try:
        yield sent
    finally:
        event.remove(engine, "before_cursor_execute", record)


@contextlib.contextmanager
def round_trips(engine: Engine) -> Iterator[list[list[str]]]:
    """The statements sent to `engine`'s database within the block, grouped by the round trip
    that sent them: those sent together in one psycopg pipeline (`run_together`) are one
    group; every other statement is a group of its own. The BEGIN and COMMIT a batch sends
    around itself are not cursor statements of ours and are not counted (with a pipeline they
    travel in the batch's own round trip)."""
    trips: list[list[str]] = []
    last: list[Any] = [None]

    def record(_conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        pipeline = getattr(getattr(cursor, "connection", None), "_pipeline", None)
        if pipeline is not None and pipeline is last[0]:
            trips[-1].append(statement)
        else:
            trips.append([statement])
        last[0] = pipeline

    event.listen(engine, "before_cursor_execute", record)
    try:
        yield trips
    finally:
        event.remove(engine, "before_cursor_execute", record)
