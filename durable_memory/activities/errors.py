"""Every error an activity raises becomes a Temporal failure once, here, in one of three classes:

- domain errors (`DurableMemoryError` whose `retryable` is False: bad input, a decided diff, a
  model 4xx) fail at once, not retried: a retry would fail the same way;
- transient errors (a domain error marked `retryable`, a model 429/5xx, SQLite's "database is
  locked", PostgreSQL's OperationalError, connection refused or reset, a time-out, a git lock
  held by another process) are retried with the activity's backoff, up to its
  maximum_attempts (always finite, see models/activity_settings.RetrySettings);
- anything else (a bug, pydantic's ValidationError, LookupError, ValueError...) is retried a
  few times, in case it came from a passing state, then fails for good.

Every failure's message is short (under 1 KiB, so an operator never sees only "Failure exceeds
size limit") and names the activity and the error's type, which is the error's class name.
The workflows' retry policies name the domain error types that are never retried
(`final_error_types`), read from the same `retryable` attributes.
"""

import contextlib
import functools
import sqlite3
from collections.abc import Iterator
from datetime import timedelta

import git
import sqlalchemy.exc
from temporalio import activity
from temporalio.exceptions import ApplicationError, FailureError

from durable_memory.faults import crash_point

# Every module of the domain that defines an error class, so the set of final types is the same
# in every process, whatever else it imported (a test checks that this list is complete).
from durable_memory.memory.agent.llm import ModelCallError
from durable_memory.memory.archive import protocol as _archive_errors  # noqa: F401
from durable_memory.memory.core import limits as _limit_errors  # noqa: F401
from durable_memory.memory.core import policies as _policy_errors  # noqa: F401
from durable_memory.memory.core.errors import DurableMemoryError, short_message

DOMAIN_PACKAGE = "durable_memory.memory"

UNKNOWN_ERROR_ATTEMPTS = 3
"""Attempts an unclassified error gets before its failure is made final."""
_SQLITE_BUSY = ("database is locked", "database table is locked", "database is busy")
_GIT_LOCK_BUSY = (".lock': File exists", "Another git process seems to be running")


def is_transient(error: BaseException) -> bool:
    """An error that a later attempt of the same work may not meet (see the module doc)."""
    if isinstance(error, DurableMemoryError):
        return error.retryable
    if isinstance(error, ConnectionError | TimeoutError | sqlalchemy.exc.TimeoutError):
        return True
    if isinstance(error, sqlalchemy.exc.DBAPIError) and error.connection_invalidated:
        return True
    if isinstance(error, sqlalchemy.exc.OperationalError):
        if isinstance(error.orig, sqlite3.OperationalError):  # also "no such table": a bug
            return any(busy in str(error.orig) for busy in _SQLITE_BUSY)
        return True  # PostgreSQL: connection lost or refused, serialization failure
    if isinstance(error, git.GitCommandError):
        return any(busy in str(error.stderr) for busy in _GIT_LOCK_BUSY)
    return False


def _subclasses(cls: type[DurableMemoryError]) -> Iterator[type[DurableMemoryError]]:
    for subclass in cls.__subclasses__():
        yield subclass
        yield from _subclasses(subclass)


def domain_error_classes() -> list[type[DurableMemoryError]]:
    """Every error class the domain defines (the errors an activity can raise): not the
    client's or the CLI's, which a process may or may not have imported."""
    classes: list[type[DurableMemoryError]] = [DurableMemoryError, *_subclasses(DurableMemoryError)]
    return [cls for cls in classes if cls.__module__.startswith(DOMAIN_PACKAGE + ".")]


def final_error_types() -> list[str]:
    """The failure types (class names, as `to_failure` gives them) of the domain errors that
    are never retryable as a class. The same list in every process: a retry policy is part of
    the command a workflow issues. A name that two classes share is left out unless both are
    final."""
    return list(_final_error_types())


@functools.cache
def _final_error_types() -> tuple[str, ...]:
    # Computed once: every domain error class is imported above, so the answer cannot change,
    # and workflows ask for it each time they schedule an activity.
    classes = domain_error_classes()
    final = {c.__name__ for c in classes if not (c.retryable or c.retryable_per_instance)}
    retried = {c.__name__ for c in classes if c.retryable or c.retryable_per_instance}
    return tuple(sorted(final - retried))


def to_failure(error: Exception, activity_type: str, attempt: int) -> ApplicationError:
    """The ApplicationError that reports `error` from attempt `attempt` of an activity."""
    kind = type(error).__name__
    message = short_message(f"{activity_type} failed: {kind}: {error}")
    if isinstance(error, ModelCallError) and error.retryable and error.retry_after is not None:
        delay = timedelta(seconds=error.retry_after)
        return ApplicationError(message, type=kind, non_retryable=False, next_retry_delay=delay)
    if isinstance(error, DurableMemoryError) or is_transient(error):
        return ApplicationError(message, type=kind, non_retryable=not is_transient(error))
    final = attempt >= UNKNOWN_ERROR_ATTEMPTS
    if final:
        message = short_message(
            f"{activity_type} failed on attempt {attempt}, not retried again: {kind}: {error}"
        )
    return ApplicationError(message, type=kind, non_retryable=final)


@contextlib.contextmanager
def classified_errors() -> Iterator[None]:
    """Wraps every activity body: classifies its errors (see the module doc), and marks the
    activity's boundaries as the crash points `before:<activity>` and `after:<activity>`
    (see faults.py)."""
    info = activity.info()
    crash_point(f"before:{info.activity_type}")
    try:
        yield
    except FailureError:  # already a Temporal failure (or the activity's cancellation)
        raise
    except Exception as error:
        raise to_failure(error, info.activity_type, info.attempt) from None
    crash_point(f"after:{info.activity_type}")
