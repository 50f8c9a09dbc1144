"""Redacting a text from a user's memory (`dmem redact`): every version of one block in the
repository (the one history rewrite), then the user's SQL rows and archival passages, on
request the user's ended executions whose histories hold the text, then this redaction's own
execution deleted, since its input holds the text.

Its id is `redact:<user>`: one redaction of a user at a time. Each step is idempotent (a
rewrite recognises itself on main by its Redaction-Id), so a redaction killed at any point
is finished by its retries, or by running it again. It serialises with the user's turns where
they meet: at the repository, the rewrite holds the user's lock (and in the distributed mode
replaces main only if no writer moved it: a lease), so a turn's commit lands before it (and is
rewritten too) or after it, on the new history.
"""

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from durable_memory.activities.redact import RedactActivities
    from durable_memory.models.history import RedactInput, RedactOutcome
    from durable_memory.workflows.common import activity_options, worker_settings


@workflow.defn
class RedactWorkflow:
    @workflow.run
    async def run(self, request: RedactInput) -> RedactOutcome:
        activities = (await worker_settings("the deployment's activity settings")).activities
        memory = activity_options(activities.memory)
        slow = activity_options(activities.archive)  # many rows, passages embedded again
        workflow.set_current_details(f"Redacting block '{request.label}': the repository")
        record = await workflow.execute_activity_method(
            RedactActivities.redact_repository,
            request,
            summary="rewrite the block's history without the text",
            **slow,
        )
        workflow.set_current_details(f"Redacting block '{request.label}': the rows")
        rows = await workflow.execute_activity_method(
            RedactActivities.redact_rows,
            args=[request, record],
            summary="redact the user's rows, map the rewritten commits",
            **slow,
        )
        workflow.set_current_details(f"Redacting block '{request.label}': the archive")
        passages = await workflow.execute_activity_method(
            RedactActivities.redact_passages,
            args=[request, record],
            summary="redact the user's archival passages",
            **slow,
        )
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
