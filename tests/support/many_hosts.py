"""Hosts for the N-host proof (tests/test_many_hosts.py): `dmem worker` processes that share
nothing but the distributed stores (PostgreSQL, the git server, Temporal), each with its own
data dir, killed and restarted; and what the proof reads afterwards: the bare repositories on
the git server, read with git directly, and which host ran each activity of a workflow."""

import asyncio
import contextlib
import random
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from temporalio.client import WorkflowHandle

from durable_memory.config import Settings
from durable_memory.memory.core.ids import validate_user_id
from durable_memory.workflows.turn_details import WAITING_FOR_GIT_REMOTE
from tests.support.distributed import distributed_env, remote_log
from tests.support.git_checks import git_output
from tests.support.temporal_helpers import current_details
from tests.support.worker_process import spawn_worker, stop_worker

DIFF_ID_TRAILER = "%(trailers:key=Diff-Id,valueonly,separator=%x2C)"
"""git log's format for a commit's Diff-Id trailers, comma-separated."""


@dataclass
class Host:
    """One host: a `dmem worker` on its own data dir with the distributed settings. The ids of
    every process it ran name it in the workflow histories (a worker's identity is
    `pid@hostname`)."""

    name: str
    settings: Settings
    temporal: str
    model_url: str
    log: Path
    process: subprocess.Popen[str] | None = None
    pids: list[int] = field(default_factory=list)
    crashes: list[tuple[str, Path]] = field(default_factory=list)
    """Each crash point a process was armed with, and the marker it leaves when it dies there."""

    def start(self, crash_at: str | None = None) -> None:
        """Start a new process (armed to SIGKILL itself at the crash point `crash_at`) and
        return once it polls the task queue."""
        self.settings.memory.data_dir.parent.mkdir(parents=True, exist_ok=True)
        marker = None
        if crash_at:
            marker = self.log.with_name(f"{self.name}-crashed-{len(self.pids)}")
            self.crashes.append((crash_at, marker))
        self.process = spawn_worker(
            self.settings,
            self.temporal,
            self.model_url,
            crash_at,
            marker,
            log=self.log,
            extra_env=distributed_env(self.settings),
        )
        self.pids.append(self.process.pid)

    def kill(self) -> None:
        """SIGKILL, as a host that loses its power."""
        assert self.process is not None
        self.process.kill()
        self.process.wait(30)

    def stop(self) -> None:
        if self.process is not None:
            stop_worker(self.process)

    def ran(self, identity: str) -> bool:
        return _pid(identity) in self.pids


def _pid(identity: str) -> int | None:
    pid, _, host = identity.partition("@")
    return int(pid) if pid.isdigit() and host == socket.gethostname() else None


@dataclass(frozen=True)
class KillPlan:
    """How one life of the killed host ends: at a named crash point (`crash_at`, the process
    kills itself there), or by SIGKILL from outside after `alive_s`."""

    crash_at: str | None
    alive_s: float


@dataclass
class Killer:
    """Runs the killed host through its plans, one life each, then starts its last life,
    which stays up. A life armed with a crash point that it has not reached within
    `crash_wait_s` is killed from outside (`Host.crashes` tells which were reached), so the
    campaign always ends."""

    host: Host
    plans: list[KillPlan]
    dead_s: tuple[float, float]
    crash_wait_s: float
    rng: random.Random
    lives: list[str] = field(default_factory=list)
    """How each life ended and how long it lived, for the proof's summary."""

    async def run(self) -> None:
        for plan in self.plans:
            await asyncio.to_thread(self.host.start, plan.crash_at)
            process = self.host.process
            assert process is not None
            born = time.monotonic()
            if plan.crash_at is None:
                await asyncio.sleep(plan.alive_s)
            else:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    await asyncio.to_thread(process.wait, self.crash_wait_s)
            await asyncio.to_thread(self.host.kill)  # a process that died already is reaped
            self.lives.append(f"{plan.crash_at or 'killed'} after {time.monotonic() - born:.1f}s")
            await asyncio.sleep(self.rng.uniform(*self.dead_s))
        await asyncio.to_thread(self.host.start)


def bare_repository(root: Path, user_id: str) -> Path:
    """User U's repository on the git server: `{root}/{U}.git` (contract of issue 15)."""
    return root / f"{validate_user_id(user_id)}.git"


def remote_commits(bare: Path) -> dict[str, list[str]]:
    """The commits of main on a bare repository, by the Diff-Id trailer they carry."""
    commits_of: dict[str, list[str]] = {}
    log = remote_log(bare, f"--format=%H {DIFF_ID_TRAILER}", "main")
    for line in log.splitlines():
        sha, _, trailers = line.partition(" ")
        for diff_id in filter(None, trailers.split(",")):
            commits_of.setdefault(diff_id.strip(), []).append(sha)
    return commits_of


def merge_commits(bare: Path) -> list[str]:
    return remote_log(bare, "--merges", "--format=%H", "main").split()


def block_file(bare: Path, label: str) -> str:
    return git_output(bare, "show", f"main:blocks/{label}.toml")


async def activity_runs(handle: WorkflowHandle[Any, Any]) -> list[tuple[str, str]]:
    """(activity type, identity of the worker that ran it) for each activity of a workflow
    (the attempt that completed it)."""
    history = await handle.fetch_history()
    scheduled = {
        event.event_id: event.activity_task_scheduled_event_attributes.activity_type.name
        for event in history.events
        if event.HasField("activity_task_scheduled_event_attributes")
    }
    return [
        (scheduled[started.scheduled_event_id], started.identity)
        for event in history.events
        if event.HasField("activity_task_started_event_attributes")
        for started in [event.activity_task_started_event_attributes]
    ]


async def waiting_for_git_remote(handle: WorkflowHandle[Any, Any]) -> bool:
    """Whether a turn's current details say that a decision waits out the git remote."""
    return WAITING_FOR_GIT_REMOTE in await current_details(handle)
