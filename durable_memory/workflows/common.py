"""What the workflows share: activity options from settings, and the search attributes."""

from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy, SearchAttributeKey, SearchAttributePair

from durable_memory.activities.errors import final_error_types
from durable_memory.activities.turn import TurnActivities
from durable_memory.models.activity_settings import ActivitySettings, RetrySettings
from durable_memory.models.turn import TurnStatus, WorkerTurnSettings

USER_ID = SearchAttributeKey.for_keyword("DmemUserId")
TURN_STATUS = SearchAttributeKey.for_keyword("DmemTurnStatus")
PENDING_DIFFS = SearchAttributeKey.for_int("DmemPendingDiffs")
PROFILE = SearchAttributeKey.for_keyword("DmemProfile")
"""The agent profile the turn runs with."""
FAILED_STEP = SearchAttributeKey.for_keyword("DmemFailedStep")
"""The step a failed turn failed at: an activity type (`dmem.call_model`), or `input`."""
DIFF_IDS = SearchAttributeKey.for_keyword_list("DmemDiffIds")
"""Every diff the turn proposed: `DmemDiffIds = '<id>'` finds the turn of a diff."""
SEARCH_ATTRIBUTES = (USER_ID, TURN_STATUS, PENDING_DIFFS, PROFILE, FAILED_STEP, DIFF_IDS)
"""Registered by `dmem dev` and the tests' servers; docs/operations.md for another cluster."""


def starting_attributes(user_id: str) -> list[SearchAttributePair[Any]]:
    """A turn's search attributes as it starts: its user, status `replying`, no pending diffs.
    `MemoryClient` sets them in the start request; the turn upserts them unless the start
    carried exactly these (patch `turn-starter-attributes`)."""
    return [
        SearchAttributePair(USER_ID, user_id),
        SearchAttributePair(TURN_STATUS, TurnStatus.REPLYING.value),
        SearchAttributePair(PENDING_DIFFS, 0),
    ]


def activity_options(
    settings: ActivitySettings, *, also_final: Sequence[str] = ()
) -> dict[str, Any]:
    """Timeouts and retry policy of a regular activity; `also_final` names error types the
    workflow handles itself, which Temporal must then not retry either (they reach it at
    once). `local_activity_options` for a local one."""
    options = local_activity_options(settings, also_final=also_final)
    heartbeat = settings.heartbeat_s
    if heartbeat is not None and heartbeat < settings.start_to_close_s:
        options["heartbeat_timeout"] = timedelta(seconds=heartbeat)  # the worker's Heartbeats
    return options


def local_activity_options(
    settings: ActivitySettings, *, also_final: Sequence[str] = ()
) -> dict[str, Any]:
    """`activity_options` without the heartbeat timeout, which a local activity does not take
    (it runs inside its workflow task: a dead worker is noticed by that task's timeout)."""
    retry = settings.retry
    return {
        "start_to_close_timeout": timedelta(seconds=settings.start_to_close_s),
        "retry_policy": RetryPolicy(
            initial_interval=timedelta(seconds=retry.initial_interval_s),
            backoff_coefficient=retry.backoff,
            maximum_interval=timedelta(seconds=retry.maximum_interval_s),
            maximum_attempts=retry.maximum_attempts,
            # Our activities already fail these as non-retryable; naming them here as well
            # keeps a domain error final even if it escaped `classified_errors`.
            non_retryable_error_types=[*final_error_types(), *also_final],
        ),
    }


WORKER_SETTINGS_TIMEOUT = timedelta(seconds=10)
WORKER_SETTINGS_RETRY = RetryPolicy(maximum_attempts=3)
"""The options of the step that fetches the worker's settings, so fixed here: it only reads
the worker's configuration in memory; a worker that cannot answer in 10 s three times is
broken, and the workflow fails naming `dmem.turn_settings`."""


async def worker_settings(summary: str) -> WorkerTurnSettings:
    """The deployment's settings, from the worker that runs this step (the local activity
    `dmem.turn_settings`): recorded in the history, so replay sees the same."""
    return await workflow.execute_local_activity_method(
        TurnActivities.turn_settings,
        summary=summary,
        start_to_close_timeout=WORKER_SETTINGS_TIMEOUT,
        retry_policy=WORKER_SETTINGS_RETRY,
    )


def backoff_delays(retry: RetrySettings, longest: timedelta) -> Iterator[timedelta]:
    """The waits between attempts that a workflow retries itself, spaced as Temporal spaces
    an activity's: `initial_interval_s`, growing by `backoff`, at most `longest`. Endless:
    the caller bounds the attempts."""
    delay = timedelta(seconds=retry.initial_interval_s)
    while True:
        yield min(delay, longest)
        delay = min(delay * retry.backoff, longest)
