"""Activities of a forget (workflows/forget.py): open and close the erasure record, empty one
store of the user, and end and delete the user's workflow executions. Each is idempotent: a
retry, or a whole forget run again, finds less to do and ends the same.

The workflow executions are found through visibility: the user search attribute, and the ids
that name the user (a turn's `turn:<user>:<turn>`, a rotation's `rotation-<user>-<label>`,
for a run that failed before it set the attribute). Visibility trails the server by a moment,
so the deletion lists again until nothing of the user is listed.
"""

import asyncio
import logging
from datetime import timedelta

from temporalio import activity
from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.workflowservice.v1 import DeleteWorkflowExecutionRequest
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from durable_memory.activities.errors import classified_errors
from durable_memory.bootstrap import MemoryStack
from durable_memory.memory.core.errors import StoreBusy
from durable_memory.memory.core.ids import validate_user_id
from durable_memory.models.turn import (
    ID_SEPARATOR,
    ErasureRecord,
    ForgetInput,
    ForgetStep,
    forget_workflow_id,
)

log = logging.getLogger(__name__)

LISTED_EMPTY_WAIT = timedelta(seconds=60)
"""How long the deletion waits for visibility to stop listing what it deleted, before it
fails (retried) and lists again."""


def user_workflows_query(user_id: str) -> str:
    """Every workflow of the user: by the user search attribute, or by an id naming them."""
    validate_user_id(user_id)  # only then is it safe inside the quotes
    return (
        f"DmemUserId = '{user_id}' "
        f"OR WorkflowId STARTS_WITH 'turn{ID_SEPARATOR}{user_id}{ID_SEPARATOR}' "
        f"OR WorkflowId STARTS_WITH 'rotation-{user_id}-' "
        f"OR WorkflowId = '{forget_workflow_id(user_id)}'"
    )


def _names_user(workflow_id: str, user_id: str) -> bool:
    """Whether an id found by the query's prefixes is really the user's: `rotation-a-` also
    starts `rotation-a-b-human` (user `a-b`); a label has no '-', so the last one ends the id."""
    if workflow_id.startswith("rotation-"):
        return workflow_id.removeprefix("rotation-").rsplit("-", 1)[0] == user_id
    return True


async def user_executions(client: Client, user_id: str) -> list[tuple[str, str, bool]]:
    """(workflow id, run id, running) of every execution of the user but the calling
    activity's own workflow's."""
    own = activity.info().workflow_run_id
    found = []
    async for execution in client.list_workflows(user_workflows_query(user_id)):
        if execution.run_id == own or not _names_user(execution.id, user_id):
            continue
        running = execution.status == WorkflowExecutionStatus.RUNNING
        found.append((execution.id, execution.run_id, running))
    return found


async def delete_execution(client: Client, workflow_id: str, run_id: str) -> None:
    """Delete one workflow execution, its history with it (idempotent)."""
    try:
        await client.workflow_service.delete_workflow_execution(
            DeleteWorkflowExecutionRequest(
                namespace=client.namespace,
                workflow_execution=WorkflowExecution(workflow_id=workflow_id, run_id=run_id),
            )
        )
    except RPCError as error:
        if error.status != RPCStatusCode.NOT_FOUND:  # deleted already
            raise


async def delete_own_execution(client: Client) -> None:
    """An activity's last act for a workflow whose input must not stay in Temporal (a forget's
    names the user, a redaction's holds the text): delete the workflow's execution. The
    server terminates it first, so the activity's completion is never recorded."""
    info = activity.info()
    if info.workflow_id is None or info.workflow_run_id is None:
        raise TypeError(f"{info.activity_type} runs only in a workflow")
    log.info("deleting the execution %s (its own last step)", info.workflow_id)
    await delete_execution(client, info.workflow_id, info.workflow_run_id)


class ForgetActivities:
    def __init__(self, stack: MemoryStack, client: Client) -> None:
        self.stack = stack
        self.client = client

    @activity.defn(name="dmem.begin_forget")
    def begin_forget(self, request: ForgetInput) -> ErasureRecord:
        """Open the erasure record: from now on the user's turns are refused."""
        with classified_errors():
            return self.stack.erasures.begin(request.user_id, request.requested_by, request.reason)

    @activity.defn(name="dmem.forget_store")
    def forget_store(self, step: ForgetStep) -> int:
        with classified_errors():
            return self.stack.forget_in(step.user_id, step.store)

    @activity.defn(name="dmem.complete_forget")
    def complete_forget(self, user_id: str) -> ErasureRecord:
        with classified_errors():
            return self.stack.erasures.complete(user_id)

    async def _listed(self, user_id: str) -> list[tuple[str, str, bool]]:
        """(workflow id, run id, running) of every execution of the user but this one."""
        return await user_executions(self.client, user_id)

    @activity.defn(name="dmem.end_user_workflows")
    async def end_user_workflows(self, user_id: str) -> int:
        """Terminate the user's running workflows (their turns, rotations): how many."""
        with classified_errors():
            ended = 0
            for workflow_id, run_id, running in await self._listed(user_id):
                if running:
                    ended += await self._terminate(workflow_id, run_id)
            return ended

    async def _terminate(self, workflow_id: str, run_id: str) -> int:
        handle = self.client.get_workflow_handle(workflow_id, run_id=run_id)
        try:
            await handle.terminate(reason="the user is being forgotten (dmem forget)")
        except RPCError as error:
            if error.status != RPCStatusCode.NOT_FOUND:  # ended meanwhile: nothing to do
                raise
            return 0
        return 1

    @activity.defn(name="dmem.delete_user_workflows")
    async def delete_user_workflows(self, user_id: str) -> int:
        """Delete every execution of the user but this forget's own (a running one is
        terminated by the deletion), until visibility lists none: how many were deleted."""
        with classified_errors():
            deleted: set[str] = set()
            waited = timedelta()
            step = timedelta(milliseconds=200)
            while listed := await self._listed(user_id):
                for workflow_id, run_id, _ in listed:
                    if run_id not in deleted:
                        await delete_execution(self.client, workflow_id, run_id)
                        deleted.add(run_id)
                if waited >= LISTED_EMPTY_WAIT:
                    raise StoreBusy(
                        f"{len(listed)} execution(s) of user '{user_id}' still listed by "
                        "Temporal's visibility after their deletion"
                    )
                activity.heartbeat(len(deleted))
                await asyncio.sleep(step.total_seconds())
                waited += step
            return len(deleted)

    @activity.defn(name="dmem.delete_forget_execution")
    async def delete_forget_execution(self) -> None:
        """The forget's last step: delete its own execution (its input names the user). The
        server terminates it first, so this activity's completion is never recorded."""
        with classified_errors():
            await delete_own_execution(self.client)
