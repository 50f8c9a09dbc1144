"""The composition root: the memory stack (faces, stores, rotation, tools) built from settings.

The only place outside the tests that assembles the domain's parts. The CLI and the client build
one per command or connection, the Temporal worker one per process (workers/worker.py).
"""

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import Engine

from durable_memory.config import Settings, postgres_archive_url
from durable_memory.memory.agent.context import ContextSources, Summarizer
from durable_memory.memory.agent.steps import ChatModel, TurnSteps, turn_context
from durable_memory.memory.agent.tools import MemoryTools
from durable_memory.memory.archive.embedders import Embedder, default_embedder
from durable_memory.memory.archive.protocol import ArchiveError, ArchiveStore
from durable_memory.memory.archive.sqlite import SqliteArchive
from durable_memory.memory.archive.vector_cache import VECTOR_CACHE_BYTES
from durable_memory.memory.core.profiles import ProfileCatalog
from durable_memory.memory.rotation.planner import DEFAULT_TARGET_RATIO
from durable_memory.memory.rotation.steps import Rotator
from durable_memory.memory.rotation.task_sink import ArchiveTaskSink
from durable_memory.memory.service import MemoryFaces
from durable_memory.memory.service.access import BlockAccess, TaskArchive
from durable_memory.memory.service.blocks import Blocks
from durable_memory.memory.service.edits import DirectEdits
from durable_memory.memory.service.history import History
from durable_memory.memory.service.policies import Policies
from durable_memory.memory.service.review import Review
from durable_memory.memory.store.block_repository import BlockRepository
from durable_memory.memory.store.db import make_engine
from durable_memory.memory.store.diffs import DiffStore
from durable_memory.memory.store.erasure import ErasureLedger, erase_user_rows
from durable_memory.memory.store.git import GitBlockStore, RemoteGitBlockStore
from durable_memory.memory.store.recall import RecallStore
from durable_memory.memory.store.rotation_state import RotationStateStore
from durable_memory.memory.store.sql import one_connection
from durable_memory.memory.store.summaries import SummaryStore
from durable_memory.memory.store.turns import TurnStore
from durable_memory.memory.store.users import PayloadKeyStore, UserDirectory
from durable_memory.models.blocks import AgentProfile
from durable_memory.models.context import CompiledContext
from durable_memory.models.turn import ForgetStore


@dataclass(frozen=True, kw_only=True)
class MemoryStack(MemoryFaces):
    """The faces (blocks, edits, review, history) and the stores callers use directly."""

    recall: RecallStore
    archive: ArchiveStore
    summaries: SummaryStore
    turns: TurnStore
    rotator: Rotator
    tools: MemoryTools
    git: GitBlockStore
    """The users' repositories as files (with a git remote: this host's clones of them), for
    what inspects them (snapshots, benchmarks): memory is read and changed through the faces."""
    erasures: ErasureLedger
    """The erasure records (`dmem forget`); an open one keeps the user's turns out."""
    engine: Engine

    @contextlib.contextmanager
    def pinned(self) -> Iterator[None]:
        """One activity's work: its reads of a user's repository see one state of it (with a
        git remote, the remote is asked once per user: `RemoteGitBlockStore.pinned`), and its
        lone SQL statements share one pooled connection per engine (`one_connection`): the
        memory database's, and a PostgreSQL archive's own (its count, every turn)."""
        with contextlib.ExitStack() as held:
            held.enter_context(self.git.pinned())
            archive_engine = getattr(self.archive, "engine", None)
            for engine in (self.engine, archive_engine):
                if isinstance(engine, Engine):
                    held.enter_context(one_connection(engine))
            yield

    def compile(self, user_id: str, summarizer: Summarizer | None = None) -> CompiledContext:
        return turn_context(self.sources(), self.archive, user_id, summarizer)

    def turn_steps(self, model: ChatModel) -> TurnSteps:
        """The steps of a turn on this stack, calling `model`."""
        return TurnSteps(self.sources(), self.archive, self.tools, model, self.turns)

    def forget_in(self, user_id: str, store: ForgetStore) -> int:
        """Delete everything of the user in one store (idempotent); how much there was."""
        if store is ForgetStore.ARCHIVE:
            return self.archive.forget_user(user_id)
        if store is ForgetStore.REPOSITORY:
            return self.git.forget_user(user_id)
        self.turns.parsed_contexts.forget_user(user_id)
        return erase_user_rows(self.engine, user_id)

    def sources(self) -> ContextSources:
        """What a turn's context is compiled from."""
        return ContextSources(self.blocks, self.review, self.recall, self.summaries)

    def close(self) -> None:
        close = getattr(self.archive, "close", None)
        if close is not None:
            close()
        self.engine.dispose()


def memory_faces(
    profiles: ProfileCatalog,
    git: BlockRepository,
    diffs: DiffStore,
    users: UserDirectory,
    archive: TaskArchive | None = None,
) -> MemoryFaces:
    """The faces of one store, sharing one BlockAccess; each user's blocks follow the
    user's own profile from `profiles`."""
    access = BlockAccess(profiles, git, users, archive)
    policies = Policies(access)
    review = Review(access, diffs, policies)
    return MemoryFaces(Blocks(access), DirectEdits(access), review, History(access), policies)


def open_archive(
    data_dir: Path,
    backend: str,
    embedder: Embedder,
    database_url: str | None = None,
    vector_cache_bytes: int = VECTOR_CACHE_BYTES,
) -> ArchiveStore:
    """The archive `backend` names; `vector_cache_bytes` bounds the embedded one's vectors in
    memory (the others keep none)."""
    if backend == "embedded":
        return SqliteArchive(data_dir / "archive.db", embedder, cache_bytes=vector_cache_bytes)
    # The other backends' modules are imported only when chosen: psycopg alone holds 9 MiB
    # of an embedded worker's memory (docs/benchmarks.md, memory).
    if backend == "postgres":
        from durable_memory.memory.archive.postgres import PostgresArchive

        return PostgresArchive(postgres_archive_url(database_url), embedder)
    if backend == "weaviate":
        from durable_memory.memory.archive.weaviate import WeaviateArchive, connect

        return WeaviateArchive(connect(), embedder)
    raise ArchiveError(
        f"unknown archive backend {backend!r}; use 'embedded', 'postgres' or 'weaviate'"
    )


def sql_url(data_dir: Path, database_url: str | None) -> str:
    """memory.database_url, else the SQLite file `memory.db` in the data dir."""
    return database_url or f"sqlite:///{data_dir.resolve() / 'memory.db'}"


def payload_keys_from_settings(settings: Settings) -> PayloadKeyStore:
    """The users' payload keys (durable_memory/codec/), in the memory database: the codec of
    a Temporal client holds it for as long as the client lives."""
    root = Path(settings.memory.data_dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    return PayloadKeyStore(make_engine(sql_url(root, settings.memory.database_url)))


def open_stack(
    data_dir: str | Path,
    database_url: str | None = None,
    profile: AgentProfile | str | Path = "default",
    *,
    archive_backend: str = "embedded",
    embedder: Embedder | None = None,
    target_ratio: float = DEFAULT_TARGET_RATIO,
    git_remote: str | None = None,
    git_token: str | None = None,
    vector_cache_bytes: int = VECTOR_CACHE_BYTES,
) -> MemoryStack:
    """The stack on `data_dir`; with `git_remote`, users' repositories live on the remote and
    `data_dir` keeps only disposable clones (see store/git/remote.py)."""
    root = Path(data_dir).resolve()  # no store path may depend on the current directory
    root.mkdir(parents=True, exist_ok=True)
    # The archive first: a backend refused for its settings leaves no memory.db behind.
    archive = open_archive(
        root, archive_backend, embedder or default_embedder(), database_url, vector_cache_bytes
    )
    engine = make_engine(sql_url(root, database_url))
    profiles = ProfileCatalog(profile)  # `profile`: the default, beside the bundled ones
    git = (
        GitBlockStore(root)
        if git_remote is None
        else RemoteGitBlockStore(root, git_remote, git_token)
    )
    recall = RecallStore(engine)
    faces = memory_faces(
        profiles, git, DiffStore(engine), UserDirectory(engine), ArchiveTaskSink(archive)
    )
    return MemoryStack(
        **faces.faces(),
        recall=recall,
        archive=archive,
        summaries=SummaryStore(engine),
        turns=TurnStore(engine),
        rotator=Rotator(faces.blocks, git, archive, RotationStateStore(engine), target_ratio),
        tools=MemoryTools(faces.blocks, faces.review, recall, archive),
        git=git,
        erasures=ErasureLedger(engine),
        engine=engine,
    )


def stack_from_settings(settings: Settings) -> MemoryStack:
    memory = settings.memory
    return open_stack(
        memory.data_dir,
        memory.database_url,
        memory.profile,
        archive_backend=memory.archive,
        target_ratio=memory.rotation_target_ratio,
        git_remote=memory.git_remote,
        git_token=memory.git_token() if memory.git_remote else None,
        vector_cache_bytes=(
            VECTOR_CACHE_BYTES
            if memory.vector_cache_mib is None
            else memory.vector_cache_mib * 2**20
        ),
    )
