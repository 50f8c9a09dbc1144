"""Settings: `temporal.yaml` (found beside the working directory or named by DMEM_CONFIG),
overridden by environment variables. The memory core reads the `memory:` section."""

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from durable_memory.memory.errors import DurableMemoryError


class ConfigError(DurableMemoryError):
    """A missing or wrong configuration value; the message names the key."""


class MemorySettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    data_dir: Path = Path(".data")
    database_url: str | None = None
    """SQLAlchemy URL; default: a SQLite file `memory.db` in the data dir."""
    profile: str = "default"
    """A bundled profile name (`default`, `essay_coach`) or a path to a profile TOML file."""
    archive: Literal["embedded", "weaviate"] = "embedded"
    """Archival memory: the embedded SQLite store in data_dir, or Weaviate at WEAVIATE_URL."""
    rotation_target_ratio: float = Field(default=0.5, ge=0.05, le=1.0)
    """After rotation a block holds at most this share of its char limit."""
    max_steps: int = Field(default=8, ge=1, le=50)
    """Model calls per turn before the turn ends with a note saying so."""

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{self.data_dir.resolve() / 'memory.db'}"


_ENV = {
    "DMEM_DATA_DIR": "data_dir",
    "DMEM_DATABASE_URL": "database_url",
    "DMEM_PROFILE": "profile",
    "DMEM_ARCHIVE": "archive",
}


def load_config_file(path: Path | None = None) -> dict[str, Any]:
    file = path or Path(os.environ.get("DMEM_CONFIG", "temporal.yaml"))
    if not file.exists():
        if path is not None or "DMEM_CONFIG" in os.environ:
            raise ConfigError(f"config file {file} does not exist")
        return {}
    try:
        data = yaml.safe_load(file.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"{file}: not valid YAML: {error}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{file}: the top level must be a mapping")
    return data


def memory_settings(path: Path | None = None) -> MemorySettings:
    raw = load_config_file(path).get("memory") or {}
    if not isinstance(raw, dict):
        raise ConfigError("memory: must be a mapping")
    raw = {**raw, **{key: os.environ[env] for env, key in _ENV.items() if os.environ.get(env)}}
    try:
        return MemorySettings.model_validate(raw)
    except ValidationError as error:
        first = error.errors()[0]
        key = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"memory.{key}: {first['msg']}") from None
