"""Timeouts and retry policies of the activities. Plain data: they travel inside a turn's and a
rotation's input (models/turn.py), and the settings file sets their defaults (config.py)."""

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

DEFAULT_MAXIMUM_ATTEMPTS = 10
"""With the default backoff (1 s doubling to 60 s): about four minutes of retrying at most."""
SETTINGS_FILE_CONTEXT = "settings from a file"
"""Validation context of load_settings: values a person wrote, not payloads of old workflows."""


class RetrySettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    initial_interval_s: float = Field(default=1.0, gt=0)
    backoff: float = Field(default=2.0, ge=1.0)
    maximum_interval_s: float = Field(default=60.0, gt=0)
    maximum_attempts: int = Field(default=DEFAULT_MAXIMUM_ATTEMPTS, ge=1)
    """Attempts in all, the first included. Always finite: no retry may run forever."""

    @field_validator("maximum_attempts", mode="before")
    @classmethod
    def _bounded(cls, value: Any, info: ValidationInfo) -> Any:
        """0 meant "retry forever" before every retry was bounded. Workflows started then
        carry it in their input: they get the default cap. A config file is refused."""
        if value == 0 and not (info.context or {}).get(SETTINGS_FILE_CONTEXT):
            return DEFAULT_MAXIMUM_ATTEMPTS
        return value


DEFAULT_HEARTBEAT_S = 10.0


class ActivitySettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    start_to_close_s: float = Field(gt=0)
    retry: RetrySettings = RetrySettings()
    heartbeat_s: float | None = Field(default=DEFAULT_HEARTBEAT_S, gt=0)
    """The activity's heartbeat timeout: its worker heartbeats it while it runs (every third
    of this), so an attempt whose worker died is retried after this long, not after its
    `start_to_close_s` (a model call's 120 s). None, or not less than `start_to_close_s`:
    no heartbeat, the attempt's `start_to_close_s` alone. Local activities never have one."""


def _activity(start_to_close_s: float, **retry: float) -> ActivitySettings:
    return ActivitySettings(start_to_close_s=start_to_close_s, retry=RetrySettings(**retry))


class ActivitiesSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model_call: ActivitySettings = _activity(120)
    memory: ActivitySettings = _activity(30)
    commit: ActivitySettings = _activity(60)
    archive: ActivitySettings = _activity(300)
