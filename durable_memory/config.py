"""Settings: `temporal.yaml` (found beside the working directory or named by DMEM_CONFIG),
overridden by environment variables. The memory core reads the `memory:` section."""

import os
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from durable_memory.memory.core.errors import DurableMemoryError
from durable_memory.memory.store.bare_repos import read_git_token
from durable_memory.memory.store.sql import is_postgres_url
from durable_memory.models.activity_settings import SETTINGS_FILE_CONTEXT, ActivitiesSettings
from durable_memory.models.llm import CostFactors
from durable_memory.models.turn import (
    DEFAULT_GIT_REMOTE_WAIT_S,
    MAX_STEPS_LIMIT,
    WorkerTurnSettings,
)


class ConfigError(DurableMemoryError):
    """A missing or wrong configuration value; the message names the key."""


class MemorySettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    data_dir: Path = Path(".data")
    database_url: str | None = None
    """SQLAlchemy URL; default: a SQLite file `memory.db` in the data dir."""
    profile: str = "default"
    """A bundled profile name (`default`, `essay_coach`) or a path to a profile TOML file."""
    archive: Literal["embedded", "postgres", "weaviate"] = "embedded"
    """Archival memory: the embedded SQLite store in data_dir, PostgreSQL at database_url
    (shared by workers on several hosts), or Weaviate at WEAVIATE_URL."""
    rotation_target_ratio: float = Field(default=0.5, ge=0.05, le=1.0)
    """After rotation a block holds at most this share of its char limit."""
    max_steps: int = Field(default=8, ge=1, le=MAX_STEPS_LIMIT)
    """Model calls per turn before the turn ends with a note saying so."""
    git_remote: str | None = None
    """The distributed mode (docs/deploy.md): a base URL, user U's repository being
    `{git_remote}/{U}.git`; `file:///shared/dir` or `http(s)://host:port` (`dmem git-serve`).
    The token for HTTP comes from DMEM_GIT_TOKEN (or git_token_file), never from the URL.
    Each host then keeps only disposable clones in data_dir; the database must be PostgreSQL
    and the archive shared (postgres or weaviate)."""
    git_token_file: Path | None = None
    """A file whose first line is the git server's token (default: $DMEM_GIT_TOKEN)."""
    forgotten_clone_sweep_s: float = Field(default=60.0, gt=0, le=86_400)
    """Distributed mode: how often each worker deletes its clones of users a forget closed
    (the forget deletes the remote and only its own host's clone)."""
    vector_cache_mib: int | None = Field(default=None, ge=1)
    """The embedded archive's vectors kept in memory across users, least recently searched
    out first; default: the archive's own bound, 64 MiB (memory/archive/vector_cache.py)."""

    def git_token(self) -> str | None:
        """The git server's token: git_token_file's first line, else $DMEM_GIT_TOKEN."""
        return read_git_token(self.git_token_file)

    @model_validator(mode="after")
    def _archive_has_its_database(self) -> "MemorySettings":
        if self.archive == "postgres":
            postgres_archive_url(self.database_url)
        if self.git_remote is not None:
            validate_git_remote(self.git_remote)
            if self.database_url is None or not is_postgres_url(self.database_url):
                raise ConfigError(
                    "memory.git_remote: the distributed mode keeps diffs, recall and turns in "
                    "PostgreSQL, shared by every host: memory.database_url must be a "
                    "PostgreSQL URL (postgresql://...)"
                )
            if self.archive == "embedded":
                raise ConfigError(
                    "memory.git_remote: the distributed mode needs a shared archive, "
                    "memory.archive: 'postgres' or 'weaviate' (the embedded one lives on one "
                    "host)"
                )
        return self


_REMOTE_SCHEMES = ("file:///", "http://", "https://")


def validate_git_remote(url: str) -> str:
    """memory.git_remote: a file:// path or an http(s) base URL without credentials, query
    or fragment (the token is never written into a URL, where logs and .git/config keep it)."""
    parts = urlsplit(url)
    if not url.startswith(_REMOTE_SCHEMES) or parts.query or parts.fragment:
        raise ConfigError(
            f"memory.git_remote: {url[:80]!r} is not a base URL: use file:///shared/dir or "
            "http(s)://host:port[/path] (the git server's address)"
        )
    if parts.username is not None or parts.password is not None:
        raise ConfigError(
            "memory.git_remote: put no credentials in the URL; give the token as "
            "DMEM_GIT_TOKEN or memory.git_token_file"
        )
    return url


def postgres_archive_url(database_url: str | None) -> str:
    """memory.database_url, which `memory.archive: postgres` needs to name PostgreSQL."""
    if database_url is None or not is_postgres_url(database_url):
        raise ConfigError(
            "memory.archive: 'postgres' keeps the archive in the database of "
            "memory.database_url, which must then be a PostgreSQL URL (postgresql://...); "
            + ("it is not set" if database_url is None else "it names another database")
        )
    return database_url


_ENV = {
    "DMEM_DATA_DIR": "data_dir",
    "DMEM_DATABASE_URL": "database_url",
    "DMEM_PROFILE": "profile",
    "DMEM_ARCHIVE": "archive",
    "DMEM_GIT_REMOTE": "git_remote",
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


class TemporalSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    address: str = "127.0.0.1:7233"
    namespace: str = "default"
    task_queue: str = "durable-memory"
    tls: bool = False
    api_key: str | None = None
    """Temporal Cloud API key (implies TLS)."""
    tls_cert: Path | None = None
    tls_key: Path | None = None
    no_worker_grace_s: float = Field(default=120, gt=0)
    """A client waiting for a turn's reply or a decision's answer gives up with
    `NoWorkerPolling` once no worker has polled the task queue for this long (a worker's
    long poll lasts about a minute, so keep it above 60 s)."""
    sticky_schedule_to_start_s: float = Field(default=10, ge=0.1)
    """How long a workflow task waits on the queue of the worker that ran the workflow's last
    task (its sticky queue: that worker holds the workflow in memory) before any worker may
    take it, replaying the history. So the wait of a turn whose worker died (SIGKILL, a lost
    host) before another worker carries it on. Lower is quicker after a crash; too low moves
    tasks off a worker that is merely busy, each move a replay. The SDK's default, 10 s."""


class DevServerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    ip: str = "127.0.0.1"
    port: int = Field(default=7233, gt=0, lt=65536)
    ui_port: int = Field(default=8233, gt=0, lt=65536)
    db_filename: str = "temporal.db"
    """Relative paths live in the data dir."""
    log_level: Literal["debug", "info", "warn", "error"] = "warn"


class TurnSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    approval_ttl_s: float = Field(default=7 * 24 * 3600, gt=0)
    """Undecided diffs expire after this long."""
    git_remote_wait_s: float = Field(default=DEFAULT_GIT_REMOTE_WAIT_S, gt=0)
    """A decision whose commit cannot reach the git remote waits (retrying with the commit
    activity's backoff) at most this long before it is answered as not applied."""


class RotationScheduleSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    schedule_id: str = "durable-memory-rotation-sweep"
    interval_s: float = Field(default=3600, ge=10)
    manage_schedule: bool = True
    """Whether `dmem worker` / `dmem dev` create (or update) the Schedule when they start.
    False for a worker that must not touch it: a deployment that manages the Schedule
    elsewhere, or a test rig whose workers share one Temporal server (the Schedule fires at
    the top of every hour, Temporal aligning intervals to the epoch)."""


REVIEW_SECRET_ENV = "DMEM_REVIEW_SECRET"
MIN_REVIEW_SECRET_CHARS = 32


class ReviewSettings(BaseModel):
    """`dmem serve`, the review page (docs/review.md), and the links `dmem review-link` signs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    secret_file: Path | None = None
    """A file whose first line is the secret that signs links, sessions and CSRF tokens
    (default: $DMEM_REVIEW_SECRET); at least 32 characters. No secret, no page."""
    base_url: str = "http://127.0.0.1:8300"
    """Where people reach the page (behind a proxy: its public URL and mount path); links
    are printed with it, and an https one marks the session cookie Secure."""
    host: str = "127.0.0.1"
    port: int = Field(default=8300, gt=0, lt=65536)
    link_ttl_s: float = Field(default=900, gt=0, le=7 * 24 * 3600)
    """How long a link may wait before it is opened (`dmem review-link --ttl` overrides)."""
    session_ttl_s: float = Field(default=8 * 3600, gt=0, le=30 * 24 * 3600)
    """How long the session an opened link starts lasts."""

    @model_validator(mode="after")
    def _base_url_is_http(self) -> "ReviewSettings":
        parts = urlsplit(self.base_url)
        if parts.scheme not in ("http", "https") or not parts.netloc or parts.query:
            raise ConfigError(
                f"review.base_url: {self.base_url[:80]!r} is not an http(s) URL "
                "(e.g. http://127.0.0.1:8300 or https://example.org/review)"
            )
        return self

    def secret(self) -> bytes:
        """The signing secret: secret_file's first line, else $DMEM_REVIEW_SECRET; a missing
        or short one is a ConfigError (the page refuses to start rather than sign with it)."""
        if self.secret_file is not None:
            try:
                lines = self.secret_file.read_text(encoding="utf-8").splitlines()
            except OSError as error:
                raise ConfigError(
                    f"review.secret_file: cannot read {self.secret_file}: {error.strerror}"
                ) from None
            value, where = (
                (lines[0].strip() if lines else ""),
                f"review.secret_file {self.secret_file}",
            )
        else:
            value, where = os.environ.get(REVIEW_SECRET_ENV, "").strip(), REVIEW_SECRET_ENV
        if not value:
            raise ConfigError(
                f"review: no secret to sign review links with: set {REVIEW_SECRET_ENV} or "
                "review.secret_file (e.g. the output of `openssl rand -hex 32`)"
            )
        if len(value) < MIN_REVIEW_SECRET_CHARS:
            raise ConfigError(
                f"review: the secret from {where} is {len(value)} characters; use at least "
                f"{MIN_REVIEW_SECRET_CHARS} (e.g. `openssl rand -hex 32`)"
            )
        return value.encode("utf-8")


PAYLOAD_MASTER_KEY_ENV = "DMEM_PAYLOAD_MASTER_KEY"
PAYLOAD_PREVIOUS_MASTER_KEY_ENV = "DMEM_PAYLOAD_PREVIOUS_MASTER_KEY"
CODEC_SERVER_TOKEN_ENV = "DMEM_CODEC_SERVER_TOKEN"
MIN_CODEC_TOKEN_CHARS = 32


def _first_line_secret(file: Path | None, env: str, key: str) -> str | None:
    """A secret: the first line of `file` (config key `key`), else the environment variable
    `env`; None when neither is set. An unreadable file is a ConfigError naming the key."""
    if file is None:
        return os.environ.get(env, "").strip() or None
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise ConfigError(f"{key}: cannot read {file}: {error.strerror}") from None
    return (lines[0].strip() if lines else "") or None


class CodecServerSettings(BaseModel):
    """`dmem codec-server`: Temporal's codec-server protocol for the Web UI and the CLI."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(default=8234, gt=0, lt=65536)
    token_file: Path | None = None
    """A file whose first line is the bearer token callers must send (default:
    $DMEM_CODEC_SERVER_TOKEN); at least 32 characters. No token, no server."""
    cors_origins: tuple[str, ...] = ("http://127.0.0.1:8233", "http://localhost:8233")
    """The Web UI origins a browser may call the server from (the dev server's UI by
    default); a request from any other origin is refused."""
    audit_log: Path | None = None
    """A file the audit line of every /decode request is appended to (default: stderr)."""

    def token(self) -> str:
        value = _first_line_secret(
            self.token_file, CODEC_SERVER_TOKEN_ENV, "payload_encryption.codec_server.token_file"
        )
        if value is None or len(value) < MIN_CODEC_TOKEN_CHARS:
            raise ConfigError(
                f"payload_encryption.codec_server: set {CODEC_SERVER_TOKEN_ENV} or token_file "
                f"to a token of at least {MIN_CODEC_TOKEN_CHARS} characters (e.g. `openssl "
                "rand -hex 32`): the codec server decrypts users' turns for whoever has it"
            )
        return value


class PayloadEncryptionSettings(BaseModel):
    """Per-user encryption of the users' Temporal payloads (docs/governance.md, "Payload
    encryption"). `payload_encryption: per_user` is short for `{mode: per_user}`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["off", "per_user"] = "off"
    """off: plain JSON payloads, as every caller in any language sends them. per_user: the
    payloads of each user's workflows are encrypted with that user's key."""
    master_key_file: Path | None = None
    """A file whose first line is the master key, 64 hex characters (default:
    $DMEM_PAYLOAD_MASTER_KEY); it wraps the users' keys in the database. Needed by
    per_user, and to read payloads encrypted before the mode was turned off."""
    previous_master_key_file: Path | None = None
    """During a master-key rotation only (`dmem rewrap-keys`, docs/governance.md "Replacing
    the master key"): the master key being replaced, given like the master key (default:
    $DMEM_PAYLOAD_PREVIOUS_MASTER_KEY). Users' keys still wrapped by it are read; every new
    wrapping uses the master key."""
    codec_server: CodecServerSettings = CodecServerSettings()

    @model_validator(mode="before")
    @classmethod
    def _mode_alone(cls, value: Any) -> Any:
        if isinstance(value, str | bool):
            value = {"mode": value}
        if isinstance(value, dict) and value.get("mode") is False:  # YAML reads `off` so
            value = {**value, "mode": "off"}
        return value

    def master_key(self) -> bytes | None:
        """The master key's 32 bytes, None when none is configured; a malformed one is a
        ConfigError."""
        return _master_key(self.master_key_file, PAYLOAD_MASTER_KEY_ENV, "master_key_file")

    def previous_master_key(self) -> bytes | None:
        """The master key being replaced, as `master_key` reads the master key."""
        return _master_key(
            self.previous_master_key_file,
            PAYLOAD_PREVIOUS_MASTER_KEY_ENV,
            "previous_master_key_file",
        )


def _master_key(file: Path | None, env: str, key: str) -> bytes | None:
    value = _first_line_secret(file, env, f"payload_encryption.{key}")
    if value is None:
        return None
    try:
        master_key = bytes.fromhex(value)
    except ValueError:
        master_key = b""
    if len(master_key) != 32:
        raise ConfigError(
            f"payload_encryption.{key} (or ${env}): a master key must be 64 hex characters "
            "(32 bytes; e.g. `openssl rand -hex 32`)"
        )
    return master_key


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    memory: MemorySettings = MemorySettings()
    temporal: TemporalSettings = TemporalSettings()
    dev_server: DevServerSettings = DevServerSettings()
    activities: ActivitiesSettings = ActivitiesSettings()
    turn: TurnSettings = TurnSettings()
    rotation: RotationScheduleSettings = RotationScheduleSettings()
    cost_factors: CostFactors = CostFactors()
    """Prompt-cache prices relative to an uncached input token (Anthropic's by default)."""
    review: ReviewSettings = ReviewSettings()
    payload_encryption: PayloadEncryptionSettings = PayloadEncryptionSettings()

    @model_validator(mode="after")
    def _encryption_has_its_key(self) -> "Settings":
        if self.payload_encryption.mode == "per_user" and not self.payload_encryption.master_key():
            raise ConfigError(
                "payload_encryption: per_user needs the master key that wraps the users' keys: "
                f"set {PAYLOAD_MASTER_KEY_ENV} or payload_encryption.master_key_file"
            )
        return self

    def turn_settings(self) -> WorkerTurnSettings:
        """What a turn on this deployment runs with; its worker hands it to each turn."""
        return WorkerTurnSettings(
            max_steps=self.memory.max_steps,
            approval_ttl_s=self.turn.approval_ttl_s,
            activities=self.activities,
            git_remote_wait_s=self.turn.git_remote_wait_s,
            cost_factors=self.cost_factors,
        )


_SETTINGS_ENV = {
    "DMEM_TEMPORAL_ADDRESS": ("temporal", "address"),
    "DMEM_TEMPORAL_NAMESPACE": ("temporal", "namespace"),
    "DMEM_TEMPORAL_API_KEY": ("temporal", "api_key"),
    "DMEM_TASK_QUEUE": ("temporal", "task_queue"),
    "DMEM_NO_WORKER_GRACE_S": ("temporal", "no_worker_grace_s"),
    "DMEM_APPROVAL_TTL_S": ("turn", "approval_ttl_s"),
    "DMEM_REVIEW_BASE_URL": ("review", "base_url"),
    "DMEM_PAYLOAD_ENCRYPTION": ("payload_encryption", "mode"),
    **{env: ("memory", key) for env, key in _ENV.items()},
}


def load_settings(path: Path | None = None) -> Settings:
    """temporal.yaml (or DMEM_CONFIG) with environment overrides; a wrong or missing value is
    a ConfigError naming the key."""
    raw = load_config_file(path)
    if isinstance(raw.get("payload_encryption"), str | bool):  # the short form, `: per_user`
        raw["payload_encryption"] = {"mode": raw["payload_encryption"]}
    for env, (section, key) in _SETTINGS_ENV.items():
        if os.environ.get(env):
            part = raw.setdefault(section, {})
            if not isinstance(part, dict):
                raise ConfigError(f"{section}: must be a mapping")
            part[key] = os.environ[env]
    try:
        return Settings.model_validate(raw, context={SETTINGS_FILE_CONTEXT: True})
    except ValidationError as error:
        first = error.errors()[0]
        key = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"{key}: {first['msg']}") from None
