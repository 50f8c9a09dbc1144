"""Forgetting a user (`dmem forget`): the record opened, the user's turns ended, every store
emptied of the user, every workflow execution of the user deleted, the record closed, and
last this forget's own execution deleted (its input names the user).

One forget per user at a time: its id is `forget:<user>`, and a second request while it runs
joins it. Every step is idempotent, so a forget killed at any point, or failed for good (a
store down too long), is finished by running it again. While the record is open, the user's
turns are refused at their first step (`Blocks.ensure_user`), so nothing of the user is made
again behind the forget's back; the stores are emptied a second time after the executions are
deleted, for what an activity of an ended turn may still have written meanwhile.
"""

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from durable_memory.activities.forget import ForgetActivities
    from durable_memory.models.turn import (
        ForgetInput,
        ForgetOutcome,
        ForgetStep,
        ForgetStore,
    )
    from durable_memory.workflows.common import activity_options, worker_settings


@workflow.defn
class ForgetWorkflow:
    @workflow.run
    async def run(self, request: ForgetInput) -> ForgetOutcome:
        activities = (await worker_settings("the deployment's activity settings")).activities
        memory = activity_options(activities.memory)
        slow = activity_options(activities.archive)  # long enough for many rows or executions
        user = request.user_id
        workflow.set_current_details(f"Forgetting a user, requested by {request.requested_by}")
        await workflow.execute_activity_method(
            ForgetActivities.begin_forget, request, summary="open the erasure record", **memory
        )
        deleted = {
            "running workflows ended": await workflow.execute_activity_method(
                ForgetActivities.end_user_workflows,
                user,
                summary="end the user's running turns",
                **slow,
            )
        }
        for rerun in (False, True):
            for store in ForgetStore:
                workflow.set_current_details(f"Forgetting: emptying the {store.value} store")
                count = await workflow.execute_activity_method(
                    ForgetActivities.forget_store,
                    ForgetStep(user_id=user, store=store),
                    summary=f"empty the {store.value} store" + (" again" if rerun else ""),
                    **slow,
                )
                deleted[store.value] = deleted.get(store.value, 0) + count
            if not rerun:
                workflow.set_current_details("Forgetting: deleting the user's executions")
                deleted["workflow executions deleted"] = await workflow.execute_activity_method(
                    ForgetActivities.delete_user_workflows,
                    user,
                    summary="delete every execution of the user",
                    **slow,
                )
        record = await workflow.execute_activity_method(
            ForgetActivities.complete_forget, user, summary="close the erasure record", **memory
        )
        outcome = ForgetOutcome(record=record, deleted=deleted)
        # The server terminates this execution while deleting it: nothing runs after.
        await workflow.execute_activity_method(
            ForgetActivities.delete_forget_execution,
            summary="delete this execution",
            **memory,
        )
        return outcome
