"""No silent hangs: every activity error is classified once (domain: final; transient: retried
up to the cap; anything else: a few attempts), every retry policy is finite, and every failure
message is short and names the activity. Real errors from SQLite, PostgreSQL, git and sockets
at the classification; then, against a real worker, an activity that outlives its timeout on
every attempt. (The other class seen stuck forever, a value the recall store refused, is now
bounded at its source: tests/test_huge_turn.py.)"""

import asyncio
import importlib
import pkgutil
import socket
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import git
import pytest
import sqlalchemy
from pydantic import ValidationError
from temporalio.api.enums.v1 import EventType
from temporalio.api.failure.v1 import Failure
from temporalio.client import WorkflowExecutionStatus
from temporalio.common import RetryPolicy
from temporalio.testing import WorkflowEnvironment

import durable_memory
from durable_memory.activities.errors import (
    DOMAIN_PACKAGE,
    UNKNOWN_ERROR_ATTEMPTS,
    domain_error_classes,
    final_error_types,
    is_transient,
    to_failure,
)
from durable_memory.bootstrap import MemoryStack
from durable_memory.config import ConfigError, load_settings
from durable_memory.memory.agent.llm import ModelCallError
from durable_memory.memory.core.errors import (
    FAILURE_MESSAGE_BYTES,
    DurableMemoryError,
    UnknownDiff,
    short_message,
)
from durable_memory.models.activity_settings import (
    ActivitiesSettings,
    ActivitySettings,
    RetrySettings,
)
from durable_memory.models.recall import MessageRole, NewMessage
from durable_memory.models.turn import TurnInput, turn_workflow_id
from durable_memory.workflows.common import activity_options
from tests.support.temporal_helpers import Rig, activity_attempts, rig_settings, running_rig

ROOT = Path(__file__).resolve().parent.parent


class LockBusy(DurableMemoryError):
    retryable = True


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _sqlite_locked(tmp_path: Path) -> sqlalchemy.exc.OperationalError:
    path = tmp_path / "busy.db"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("CREATE TABLE t (x INTEGER)")
    holder.execute("BEGIN EXCLUSIVE")
    engine = sqlalchemy.create_engine(f"sqlite:///{path}", connect_args={"timeout": 0})
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql("INSERT INTO t VALUES (1)")
    except sqlalchemy.exc.OperationalError as error:
        return error
    finally:
        holder.close()
        engine.dispose()
    raise AssertionError("the write did not meet the lock")


def _raised(call: Any) -> Exception:
    try:
        call()
    except Exception as error:
        return error
    raise AssertionError(f"{call} raised nothing")


def _git_lock_held(tmp_path: Path) -> Exception:
    repo = git.Repo.init(tmp_path / "repo")
    (tmp_path / "repo" / "f").write_text("x", encoding="utf-8")
    (Path(repo.git_dir) / "index.lock").touch()
    return _raised(lambda: repo.git.add("f"))


def test_transient_errors_are_told_apart_from_the_rest(tmp_path: Path) -> None:
    refused = _free_port()
    transient = [
        _sqlite_locked(tmp_path),
        _raised(
            lambda: (
                sqlalchemy.create_engine(f"postgresql+psycopg://u@127.0.0.1:{refused}/d")
                .connect()
                .close()
            )
        ),
        _raised(lambda: socket.create_connection(("127.0.0.1", refused), timeout=5)),
        TimeoutError("read timed out"),
        _git_lock_held(tmp_path),
        LockBusy("the user's repository is busy"),
        ModelCallError("overloaded", retryable=True, status=529),
    ]
    engine = sqlalchemy.create_engine(f"sqlite:///{tmp_path / 'other.db'}")
    final_or_unknown = [
        _raised(lambda: engine.connect().exec_driver_sql("SELECT * FROM missing")),  # a bug
        _raised(lambda: NewMessage(role=MessageRole.USER, content="x" * 1_000_001)),
        LookupError("turn t1 has no compiled context"),
        ValueError("bad"),
        UnknownDiff("no diff"),
        ModelCallError("bad request", retryable=False, status=400),
    ]
    engine.dispose()
    assert [is_transient(e) for e in transient] == [True] * len(transient), transient
    assert [is_transient(e) for e in final_or_unknown] == [False] * len(final_or_unknown)


def test_each_class_fails_as_it_should_with_a_short_named_message() -> None:
    huge = "é" * 100_000
    domain = to_failure(UnknownDiff(huge), "dmem.decide", attempt=1)
    assert domain.non_retryable
    assert domain.type == "UnknownDiff"
    assert domain.message.startswith("dmem.decide failed: UnknownDiff: ")

    busy = to_failure(LockBusy("busy"), "dmem.decide", attempt=9)
    assert not busy.non_retryable  # retried until the activity's maximum_attempts

    retry_after = to_failure(
        ModelCallError("slow down", retryable=True, status=429, retry_after=7), "dmem.x", 1
    )
    assert retry_after.next_retry_delay == timedelta(seconds=7)
    assert not retry_after.non_retryable

    invalid = _raised(lambda: NewMessage(role=MessageRole.USER, content=huge * 11))
    assert isinstance(invalid, ValidationError)
    attempts = [
        to_failure(invalid, "dmem.call_model", n) for n in range(1, UNKNOWN_ERROR_ATTEMPTS + 1)
    ]
    assert [a.non_retryable for a in attempts] == [False] * (UNKNOWN_ERROR_ATTEMPTS - 1) + [True]
    assert attempts[-1].type == "ValidationError"
    assert "dmem.call_model failed on attempt 3" in attempts[-1].message
    for failure in [domain, *attempts]:
        assert len(failure.message.encode("utf-8")) <= FAILURE_MESSAGE_BYTES


def _every_domain_error_class() -> list[type[DurableMemoryError]]:
    """Every DurableMemoryError class of the package (each module imported) and of this file."""
    for module in pkgutil.walk_packages(durable_memory.__path__, "durable_memory."):
        importlib.import_module(module.name)
    found: list[type[DurableMemoryError]] = [DurableMemoryError]
    for cls in found:
        found.extend(cls.__subclasses__())
    return found


def _instances(cls: type[DurableMemoryError]) -> list[DurableMemoryError]:
    """An instance as raised; a class whose instances choose get one of each kind."""
    if cls.retryable_per_instance:
        return [cls("refused", retryable=flag) for flag in (True, False)]  # type: ignore[call-arg]
    try:
        return [cls("refused")]
    except TypeError:  # a constructor that wants more (CharLimitExceeded's label and sizes)
        error = cls.__new__(cls)
        Exception.__init__(error, "refused")
        return [error]


def test_every_domain_error_is_retried_as_its_retryable_says() -> None:
    """By the activity wrapper (the failure's non_retryable flag) and by the workflows' retry
    policy (its non-retryable types), each on its own: `retryable` is the one truth."""
    classes = _every_domain_error_class()
    policy = activity_options(ActivitySettings(start_to_close_s=1))["retry_policy"]
    assert isinstance(policy, RetryPolicy)
    final_types = set(policy.non_retryable_error_types or ())
    assert {"UnknownDiff", "DiffAlreadyDecided", "LimitExceeded"} <= final_types
    assert LockBusy in classes
    assert ModelCallError in classes
    for cls in classes:
        listed = cls.__name__ in final_types
        final = not cls.retryable and not cls.retryable_per_instance
        if cls.__module__.startswith(DOMAIN_PACKAGE + "."):
            assert listed == final, cls
        for error in _instances(cls):
            for attempt in (1, UNKNOWN_ERROR_ATTEMPTS + 1):
                failure = to_failure(error, "dmem.x", attempt)
                assert failure.type == cls.__name__
                assert failure.non_retryable is not error.retryable, (cls, attempt)
                retried = not failure.non_retryable and failure.type not in final_types
                assert retried is error.retryable, (cls, attempt)


def test_the_final_types_do_not_depend_on_what_a_process_imported() -> None:
    """activities/errors.py imports every domain module that defines an error, so a process that
    imported nothing else and this one (which imported every module) issue the same policy."""
    alone = subprocess.run(
        [
            sys.executable,
            "-c",
            "from durable_memory.activities.errors import final_error_types as f; print(*f())",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    _every_domain_error_class()
    assert alone == final_error_types()
    assert len(domain_error_classes()) == len(
        [c for c in _every_domain_error_class() if c.__module__.startswith(DOMAIN_PACKAGE + ".")]
    )


def test_short_message_cuts_on_a_character_boundary() -> None:
    assert short_message("short") == "short"
    cut = short_message("€" * 1000)
    assert len(cut.encode("utf-8")) <= FAILURE_MESSAGE_BYTES
    assert cut.endswith("[truncated]")
    assert set(cut.removesuffix(" [truncated]")) == {"€"}


def test_every_retry_policy_is_finite(tmp_path: Path) -> None:
    for settings in (ActivitiesSettings(), load_settings(ROOT / "temporal.yaml").activities):
        for name, activity in settings:
            assert isinstance(activity, ActivitySettings)
            assert activity.retry.maximum_attempts >= 1, name
    # 0 meant "forever" in workflows started before: their input now gets the default cap.
    old = TurnInput.model_validate(
        {
            "user_id": "alice",
            "turn_id": "t1",
            "message": "hi",
            "activities": {"memory": {"start_to_close_s": 30, "retry": {"maximum_attempts": 0}}},
        }
    )
    assert old.legacy_settings().activities.memory.retry.maximum_attempts == (
        RetrySettings().maximum_attempts
    )
    # A person who writes 0 in a config file is told it is not allowed.
    config = tmp_path / "temporal.yaml"
    config.write_text(
        "activities:\n  commit: {start_to_close_s: 60, retry: {maximum_attempts: 0}}\n",
        encoding="utf-8",
    )
    with pytest.raises(ConfigError, match=r"activities\.commit\.retry\.maximum_attempts"):
        load_settings(config)


# -- against a real worker -------------------------------------------------------------------

QUICK = RetrySettings(initial_interval_s=0.1, backoff=1, maximum_interval_s=0.1)


def _failure_text(failure: Failure) -> str:
    """Every message of a failure's cause chain, with the activity type where one failed."""
    parts = []
    while failure.message or failure.HasField("cause"):
        parts.append(failure.message)
        if failure.HasField("activity_failure_info"):
            parts.append(failure.activity_failure_info.activity_type.name)
        if not failure.HasField("cause"):
            break
        failure = failure.cause
    return " | ".join(parts)


@dataclass
class FailedTurn:
    failure: str
    """Every message of the workflow's failure and its causes."""
    attempts: dict[str, int]
    """Each activity's last attempt."""
    final_types: dict[str, list[str]]
    """Each activity's non-retryable error types, as its retry policy reached the server."""


async def _failed_turn(rig: Rig, user_id: str, turn_id: str) -> FailedTurn:
    """Send a turn that must fail; what its history says of the failure."""
    with pytest.raises(Exception, match=r"."):  # the caller's error is `wfboundary`'s to shape
        await asyncio.wait_for(rig.client.send_message(user_id, "hi", turn_id=turn_id), 300)
    handle = rig.client.client.get_workflow_handle(turn_workflow_id(user_id, turn_id))
    assert (await handle.describe()).status is WorkflowExecutionStatus.FAILED
    history = await handle.fetch_history()
    turn = FailedTurn(failure="", attempts=dict(activity_attempts(history.events)), final_types={})
    for event in history.events:
        if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            scheduled = event.activity_task_scheduled_event_attributes
            final_types = list(scheduled.retry_policy.non_retryable_error_types)
            turn.final_types[scheduled.activity_type.name] = final_types
        elif event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_FAILED:
            turn.failure = _failure_text(event.workflow_execution_failed_event_attributes.failure)
    return turn


@contextmanager
def _held_repository(stack: MemoryStack, user_id: str) -> Iterator[None]:
    """Hold the user's write lock from another thread, so every write waits (as on a hung
    disk or a stuck git) until the block ends."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with stack.git.transaction(user_id):
            held.set()
            release.wait()

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait()
    try:
        yield
    finally:
        release.set()
        holder.join()


async def test_an_activity_past_its_timeout_on_every_attempt_ends_the_turn(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    settings = rig_settings(tmp_path / "data")
    retry = QUICK.model_copy(update={"maximum_attempts": 3})
    short = ActivitySettings(start_to_close_s=1, retry=retry)
    # The turn's first activity (prepare, then the first model call) has a model call's
    # options: those are the ones it must outlast on every attempt.
    short_steps = ActivitiesSettings(memory=short, model_call=short)
    settings = settings.model_copy(update={"activities": short_steps})
    async with running_rig(temporal_env.client, settings, []) as rig:
        rig.stack.blocks.ensure_user("alice")
        with _held_repository(rig.stack, "alice"):
            turn = await _failed_turn(rig, "alice", "t1")
        assert turn.attempts["dmem.start_turn"] == 3
        assert "dmem.start_turn" in turn.failure
        assert "timed out" in turn.failure.lower()


async def test_the_server_holds_policies_naming_the_final_types(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    """Every regular activity's retry policy, as the server holds it, names the final domain
    error types (a local step's is its worker's, built by the same function); a model 400 (a
    class whose instances choose, so never named) still ends the turn at its first attempt."""
    settings = rig_settings(tmp_path / "data")
    quick = ActivitySettings(start_to_close_s=30, retry=QUICK)
    activities = ActivitiesSettings(memory=quick, model_call=quick)
    settings = settings.model_copy(update={"activities": activities})
    async with running_rig(temporal_env.client, settings, []) as rig:  # no reply scripted
        turn = await _failed_turn(rig, "alice", "t1")
    assert turn.attempts == {"dmem.start_turn": 1}  # prepare and the model call, in one
    assert "ModelCallError: model API error 400" in turn.failure
    final = final_error_types()
    assert {"UnknownDiff", "DiffAlreadyDecided"} <= set(final)
    assert "ModelCallError" not in final
    assert turn.final_types == {"dmem.start_turn": final}
