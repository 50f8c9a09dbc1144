"""Domain errors become Temporal failures once, here: bad input is not retried, a model error
is retried when the API says it may be (after its retry-after), anything else is retried."""

import contextlib
from collections.abc import Iterator
from datetime import timedelta

from temporalio import activity
from temporalio.exceptions import ApplicationError

from durable_memory.faults import crash_point
from durable_memory.memory.errors import DurableMemoryError
from durable_memory.memory.llm import ModelCallError


@contextlib.contextmanager
def domain_errors() -> Iterator[None]:
    """Wraps every activity body: maps domain errors, and marks the activity's boundaries as
    the crash points `before:<activity>` and `after:<activity>` (see faults.py)."""
    name = activity.info().activity_type
    crash_point(f"before:{name}")
    try:
        yield
    except ModelCallError as error:
        raise ApplicationError(
            str(error),
            type="ModelCallError",
            non_retryable=not error.retryable,
            next_retry_delay=(
                timedelta(seconds=error.retry_after) if error.retry_after is not None else None
            ),
        ) from None
    except DurableMemoryError as error:
        raise ApplicationError(str(error), type=type(error).__name__, non_retryable=True) from None
    crash_point(f"after:{name}")
