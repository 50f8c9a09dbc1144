"""`dmem worker` as a real separate process, for tests that kill it."""

import os
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import yaml
from temporalio.testing import WorkflowEnvironment

from bench.processes import start_until_polling
from bench.processes import stop_worker as stop_worker  # the tests stop workers through here
from durable_memory.config import Settings
from durable_memory.models.activity_settings import (
    ActivitiesSettings,
    ActivitySettings,
    RetrySettings,
)
from tests.support.temporal_helpers import rig_settings

FAST = ActivitySettings(
    start_to_close_s=4, retry=RetrySettings(initial_interval_s=0.2, maximum_interval_s=2.0)
)
"""An activity lost with its worker is retried after 4 s, then 0.2 s, doubling up to 2 s (the
default's 60 s would have an activity lost to seven kills in a row wait 25 s more, after
them)."""
STICKY_S = 1.0


def crash_settings(tmp_path: Path) -> Settings:
    """Short activity timeouts, so that an activity lost with its worker is retried quickly."""
    return with_fast_activities(rig_settings(tmp_path / "data"))


def with_fast_activities(settings: Settings) -> Settings:
    """`settings` with every activity on FAST's timeout and retry, and a workflow whose
    worker died taken over after STICKY_S (10 s by default: most of a kill test's time)."""
    fast = ActivitiesSettings(model_call=FAST, memory=FAST, commit=FAST, archive=FAST)
    sticky = settings.temporal.model_copy(update={"sticky_schedule_to_start_s": STICKY_S})
    return settings.model_copy(update={"activities": fast, "temporal": sticky})


def address(env: WorkflowEnvironment) -> str:
    return env.client.service_client.config.target_host


def spawn_worker(
    settings: Settings,
    temporal: str,
    model_url: str,
    crash_at: str | None = None,
    marker: Path | None = None,
    log: Path | None = None,
    extra_env: Mapping[str, str] | None = None,
    manage_schedule: bool = False,
) -> subprocess.Popen[str]:
    """Start `dmem worker` and return once it polls its task queue (its stderr appended to
    `log`, if given). Its turns run with `settings`' turn settings (step limit, approval TTL,
    activity options), given to it as a config file as a deployment would. `extra_env` adds
    to (or overrides) its DMEM_* variables: the shared stores of another host, say. It leaves
    the rotation Schedule alone unless `manage_schedule`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMEM_", "ANTHROPIC_"))}
    env.update(
        {
            "DMEM_CONFIG": str(_turn_config_file(settings, manage_schedule)),
            "DMEM_DATA_DIR": str(settings.memory.data_dir),
            "DMEM_PROFILE": settings.memory.profile,
            "DMEM_TEMPORAL_ADDRESS": temporal,
            "DMEM_TASK_QUEUE": settings.temporal.task_queue,
            "ANTHROPIC_BASE_URL": model_url,
        }
    )
    env.update(extra_env or {})
    if crash_at:
        env.update({"DMEM_CRASH_AT": crash_at, "DMEM_CRASH_MARKER": str(marker)})
    return start_until_polling(
        [sys.executable, "-m", "durable_memory.cli", "worker"],
        env,
        settings.memory.data_dir.parent,
        log,
    )


def _turn_config_file(settings: Settings, manage_schedule: bool) -> Path:
    config = settings.memory.data_dir.parent / f"worker-{settings.temporal.task_queue}.yaml"
    turn = {
        "memory": {"max_steps": settings.memory.max_steps},
        "turn": settings.turn.model_dump(mode="json"),
        "activities": settings.activities.model_dump(mode="json"),
        "temporal": {"sticky_schedule_to_start_s": settings.temporal.sticky_schedule_to_start_s},
        # Tests share one dev server: a worker that made the hourly sweep's Schedule would
        # start rotations of its test's users at the top of the hour, racing the test's own.
        "rotation": settings.rotation.model_copy(
            update={"manage_schedule": manage_schedule}
        ).model_dump(mode="json"),
    }
    config.write_text(yaml.safe_dump(turn), encoding="utf-8")
    return config


@contextmanager
def worker_process(
    settings: Settings,
    temporal: str,
    model_url: str,
    crash_at: str | None = None,
    marker: Path | None = None,
) -> Iterator[subprocess.Popen[str]]:
    process = spawn_worker(settings, temporal, model_url, crash_at, marker)
    try:
        yield process
    finally:
        stop_worker(process)
