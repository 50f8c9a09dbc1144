"""The distributed mode on loopback: a `dmem git-serve` server (in-process, stoppable and
restartable on its port), settings for a host that uses it with the shared PostgreSQL, and
the environment a `dmem` process on another "host" needs."""

import subprocess
from collections.abc import Iterator
from contextlib import ExitStack, closing, contextmanager
from pathlib import Path

from durable_memory.bootstrap import MemoryStack, open_stack
from durable_memory.config import MemorySettings, Settings
from durable_memory.gitserver.server import GitServer, ServeSettings
from tests.support.temporal_helpers import rig_settings

GIT_TOKEN = "test-git-token-0123456789"


def start_git_server(root: Path, port: int = 0) -> GitServer:
    return GitServer(ServeSettings(root=root, token=GIT_TOKEN), port=port).start()


@contextmanager
def git_server(root: Path, port: int = 0) -> Iterator[GitServer]:
    """`dmem git-serve root` on loopback with GIT_TOKEN; `server.url` is the git remote. The
    server yielded may be replaced by `restart_git_server`: stop the last one at the end."""
    server = start_git_server(root, port)
    try:
        yield server
    finally:
        server.stop()


def restart_git_server(server: GitServer, root: Path) -> GitServer:
    """A new server for `root` on the stopped `server`'s port (the same git remote)."""
    port = int(server.url.rsplit(":", 1)[1])
    return start_git_server(root, port)


def distributed_settings(data_dir: Path, *, database_url: str, git_remote: str) -> Settings:
    """A host of the distributed mode: its own data dir (clones only), the shared PostgreSQL
    (database and archive) and the git remote."""
    settings = rig_settings(data_dir)
    token_file = data_dir.parent / f"{data_dir.name}.git-token"
    token_file.parent.mkdir(parents=True, exist_ok=True)
    token_file.write_text(GIT_TOKEN + "\n", encoding="utf-8")
    memory = MemorySettings(
        data_dir=data_dir,
        profile=settings.memory.profile,
        database_url=database_url,
        archive="postgres",
        git_remote=git_remote,
        git_token_file=token_file,
    )
    return settings.model_copy(update={"memory": memory})


def distributed_env(settings: Settings) -> dict[str, str]:
    """What a `dmem` process on another host reads: the DMEM_* variables of `settings`."""
    memory = settings.memory
    assert memory.git_remote is not None
    assert memory.database_url is not None
    return {
        "DMEM_DATA_DIR": str(memory.data_dir),
        "DMEM_DATABASE_URL": memory.database_url,
        "DMEM_ARCHIVE": memory.archive,
        "DMEM_GIT_REMOTE": memory.git_remote,
        "DMEM_GIT_TOKEN": GIT_TOKEN,
        "DMEM_PROFILE": memory.profile,
        "DMEM_TASK_QUEUE": settings.temporal.task_queue,
    }


def remote_log(bare: Path, *args: str) -> str:
    """`git log` of a bare repository on the server's disk (what the remote really holds)."""
    return subprocess.run(
        ["git", "--git-dir", str(bare), "log", *args],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout


@contextmanager
def two_hosts(
    root: Path, served: bool, database_url: str | None = None
) -> Iterator[tuple[MemoryStack, MemoryStack]]:
    """Two hosts' stacks (data dirs `root/here` and `root/there`, essay_coach, embedded
    stores, or the one database at `database_url` if given) on one git remote: the bare
    repositories in `root/shared`, reached as `file://` or, when `served`, through `dmem
    git-serve` over that directory."""
    with ExitStack() as cleanup:
        shared = root / "shared"
        remote = cleanup.enter_context(git_server(shared)).url if served else f"file://{shared}"
        here, there = (
            cleanup.enter_context(
                closing(
                    open_stack(
                        root / host,
                        database_url,
                        profile="essay_coach",
                        git_remote=remote,
                        git_token=GIT_TOKEN,
                    )
                )
            )
            for host in ("here", "there")
        )
        yield here, there
