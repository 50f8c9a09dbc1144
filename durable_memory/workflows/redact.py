"""Redacting a text from a user's memory (`dmem redact`): the open redaction record opened and
the writers that began before it waited for, then every version of one block in the
repository (the one history rewrite), the user's SQL rows and archival passages, the record
closed and the rows swept once more, on request the user's ended executions whose histories
hold the text, then this redaction's own execution deleted, since its input holds the text.

Its id is `redact:<user>`: one redaction of a user at a time. Each step is idempotent (a
rewrite recognises itself on main by its Redaction-Id), so a redaction killed at any point
is finished by its retries, or by running it again.

It serialises with the user's turns, decisions and rotations (patch `redaction-waits-for-
writers`, docs/governance.md "Redact a version"): while the record is open they wait at
their first step (retried), and the redaction first waits until none that began before it
can still write what it read before the rewrite; so each completes before the redaction or
runs after it, on the redacted memory. A redaction that waits longer than its step's retries
gives up, closes the record and fails, having changed nothing. Before the patch it met them
only at the repository (the rewrite holds the user's lock, and in the distributed mode
replaces main only if no writer moved it: a lease).
"""

from typing import Any

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError, FailureError

with workflow.unsafe.imports_passed_through():
    from durable_memory.activities.redact import RedactActivities
    from durable_memory.models.history import RedactInput, RedactionRecord, RedactOutcome
    from durable_memory.workflows.common import activity_options, worker_settings

WAIT_FOR_WRITERS = "redaction-waits-for-writers"
"""Patch: the redaction opens its record and waits for the user's writers first, and closes
the record and sweeps the rows again after the archive. Redactions started before it run the
rewrite, rows and archive steps alone."""

GAVE_UP = "RedactionGaveUp"
"""The failure type of a redaction that gave up waiting for the user's writers."""


@workflow.defn
class RedactWorkflow:
    @workflow.run
    async def run(self, request: RedactInput) -> RedactOutcome:
        activities = (await worker_settings("the deployment's activity settings")).activities
        memory = activity_options(activities.memory)
        slow = activity_options(activities.archive)  # many rows, passages embedded again
        waits = workflow.patched(WAIT_FOR_WRITERS)
        if waits:
            await self._begin(request, memory)
        try:
            record, rows, passages = await self._redact(request, slow)
        finally:
            if waits:  # whatever happened, the user's turns go on
                await workflow.execute_activity_method(
                    RedactActivities.end_redaction,
                    request.user_id,
                    summary="close the redaction record",
                    **memory,
                )
        if waits:
            # What a turn refused at the gate wrote before it was refused (a summary, its
            # prompt base), and what a step that began before the record wrote after the
            # first pass: found now, the record closed after it.
            workflow.set_current_details(f"Redacting block '{request.label}': the rows again")
            rows += await self._rows(request, record, "sweep the user's rows once more", slow)
        executions = 0
        if request.delete_executions:
            workflow.set_current_details("Redacting: deleting ended executions holding it")
            executions = await workflow.execute_activity_method(
                RedactActivities.delete_executions_holding,
                request,
                summary="delete the user's ended executions whose history holds the text",
                **slow,
            )
        outcome = RedactOutcome(
            record=record, rows=rows, passages=passages, executions_deleted=executions
        )
        # The server terminates this execution while deleting it: nothing runs after.
        await workflow.execute_activity_method(
            RedactActivities.delete_redact_execution, summary="delete this execution", **memory
        )
        return outcome

    async def _begin(self, request: RedactInput, memory: dict[str, Any]) -> None:
        """Open the record and wait for the writers; on giving up, close it and fail."""
        workflow.set_current_details(
            f"Redacting block '{request.label}': waiting for the user's running turns, "
            "decisions and rotations to finish writing (new ones wait for the redaction)"
        )
        try:
            await workflow.execute_activity_method(
                RedactActivities.begin_redaction,
                request,
                summary="open the redaction record, wait for the user's writers",
                **memory,
            )
        except ActivityError as error:
            await workflow.execute_activity_method(
                RedactActivities.end_redaction,
                request.user_id,
                summary="close the redaction record: gave up",
                **memory,
            )
            cause = error.cause.message if isinstance(error.cause, FailureError) else str(error)
            raise ApplicationError(
                f"the redaction gave up, nothing was changed: {cause}",
                type=GAVE_UP,
                non_retryable=True,
            ) from None

    async def _redact(
        self, request: RedactInput, slow: dict[str, Any]
    ) -> tuple[RedactionRecord, int, int]:
        """The rewrite, the rows and the passages: (the record, rows, passages redacted)."""
        workflow.set_current_details(f"Redacting block '{request.label}': the repository")
        record = await workflow.execute_activity_method(
            RedactActivities.redact_repository,
            request,
            summary="rewrite the block's history without the text",
            **slow,
        )
        workflow.set_current_details(f"Redacting block '{request.label}': the rows")
        rows = await self._rows(
            request, record, "redact the user's rows, map the rewritten commits", slow
        )
        workflow.set_current_details(f"Redacting block '{request.label}': the archive")
        passages = await workflow.execute_activity_method(
            RedactActivities.redact_passages,
            args=[request, record],
            summary="redact the user's archival passages",
            **slow,
        )
        return record, rows, passages

    @staticmethod
    async def _rows(
        request: RedactInput, record: RedactionRecord, summary: str, slow: dict[str, Any]
    ) -> int:
        return await workflow.execute_activity_method(
            RedactActivities.redact_rows,
            args=[request, record],
            summary=summary,
            **slow,
        )
