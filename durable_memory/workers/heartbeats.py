"""Heartbeats for every regular activity that has a heartbeat timeout, sent by the worker.

Temporal learns that a worker died only from timeouts. Without a heartbeat, an activity whose
worker was killed is retried after its `start_to_close` (a model call's 120 s, a commit's
60 s); with one, after its heartbeat timeout (`activities.*.heartbeat_s`, 10 s by default).
Our activities are short steps and blocking calls (the model, git, SQL) that cannot heartbeat
themselves, so the worker does it for them: while one runs, a timer on the worker's event loop
heartbeats it every third of its timeout. An activity shorter than that (every step of a turn
on an instant model) sends none, so the turn's path pays one timer set and cancelled.

What the heartbeat proves is that the worker process and its event loop are alive, not that
the activity makes progress: an activity stuck in a live worker still ends at its
`start_to_close`, as before. These heartbeats carry no details (they replace those of the
two forget and redaction activities that heartbeat their progress; no activity of ours
resumes from heartbeat details). Local activities have no heartbeat timeout (a dead worker
is noticed by their workflow task's timeout) and get no heartbeats.

A heartbeat's answer also brings cancellations: the activity's workflow ended (a forget ends
a user's turns) or asked to cancel it. The SDK delivers one to a synchronous activity by
raising CancelledError into its thread at whatever bytecode it is running, which in a worker
that lives on could leave a lock held or a connection pool half-updated. So every synchronous
activity of ours, local ones included, runs shielded (`activity.shield_thread_cancel_exception`):
it finishes its step (each refuses to write for an ended turn or a forgotten user, as after a
kill) and the cancellation is raised once it returns.
"""

import asyncio
import functools
from collections.abc import Callable
from typing import Any

from temporalio import activity
from temporalio.worker import (
    ActivityInboundInterceptor,
    ActivityOutboundInterceptor,
    ExecuteActivityInput,
    Interceptor,
)

BEATS_PER_TIMEOUT = 3
"""Heartbeats per heartbeat timeout (the SDK core sends the first at once and then at most one
per 80% of the timeout; the server sees a gap of at most that)."""


class Heartbeats(Interceptor):
    """The worker interceptor that heartbeats its activities (see the module's docstring)."""

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        return _HeartbeatingActivity(next)


class _HeartbeatingActivity(ActivityInboundInterceptor):
    def init(self, outbound: ActivityOutboundInterceptor) -> None:
        self._outbound = outbound
        super().init(outbound)

    async def execute_activity(self, input: ExecuteActivityInput) -> Any:
        if input.executor is not None:  # the SDK runs a synchronous activity in its executor
            input.fn = functools.partial(_shielded, input.fn)
        info = activity.info()
        timeout = info.heartbeat_timeout
        if info.is_local or not timeout:
            return await super().execute_activity(input)
        # The outbound interceptor's heartbeat is the SDK's own for this activity, called on
        # the event loop as it must be (a synchronous activity's `activity.heartbeat` hands
        # over to this loop and waits).
        beating = _Beating(timeout.total_seconds() / BEATS_PER_TIMEOUT, self._outbound.heartbeat)
        try:
            return await super().execute_activity(input)
        finally:
            beating.stop()


class _Beating:
    """Calls `heartbeat` on the running event loop every `every_s` until stopped."""

    def __init__(self, every_s: float, heartbeat: Callable[[], None]) -> None:
        self._loop = asyncio.get_running_loop()
        self._every_s = every_s
        self._heartbeat = heartbeat
        self._next = self._loop.call_later(every_s, self._beat)

    def _beat(self) -> None:
        self._next = self._loop.call_later(self._every_s, self._beat)  # even if this one fails
        self._heartbeat()

    def stop(self) -> None:
        self._next.cancel()


def _shielded(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` in the activity's thread, a cancellation held until it returns."""
    with activity.shield_thread_cancel_exception():
        return fn(*args)
