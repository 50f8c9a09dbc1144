"""How a decision reaches its turn: the `decide` Update, sent with a bounded retry of our own,
and the turn workflow's refusals as the domain errors the client raises; and the resend of a
request the network dropped, for every call of the client that is safe to repeat."""

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from pydantic import ValidationError
from temporalio.api.common.v1 import Payloads, WorkflowExecution
from temporalio.api.enums.v1 import UpdateWorkflowExecutionLifecycleStage
from temporalio.api.update.v1 import Input as UpdateInput
from temporalio.api.update.v1 import Meta as UpdateMeta
from temporalio.api.update.v1 import Request as UpdateRequest
from temporalio.api.update.v1 import WaitPolicy
from temporalio.api.workflowservice.v1 import UpdateWorkflowExecutionRequest
from temporalio.client import (
    Client,
    WorkflowHandle,
    WorkflowUpdateFailedError,
    WorkflowUpdateRPCTimeoutOrCancelledError,
)
from temporalio.converter import DataConverter, WorkflowSerializationContext
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from durable_memory.memory.core.errors import (
    DecisionRefused,
    DiffAlreadyDecided,
    DurableMemoryError,
    UnknownDiff,
)
from durable_memory.models.turn import DecisionOutcome, DiffDecision
from durable_memory.workflows.turn_boundary import (
    DECISION_REFUSED,
    DIFF_ALREADY_DECIDED,
    UNKNOWN_DIFF,
)


class DecisionLost(DiffAlreadyDecided):
    """A decision that did not apply because the diff was decided first: `outcome` is what
    did apply (status, commit, who decided and when)."""

    def __init__(self, message: str, outcome: DecisionOutcome | None) -> None:
        super().__init__(message)
        self.outcome = outcome


class DecisionNotApplied(DecisionRefused):
    """A decision that reached its turn and was refused there (the activity failed, the
    approval conflicted or has no commit): `outcome` is the diff's state, if known."""

    def __init__(self, message: str, outcome: DecisionOutcome | None) -> None:
        super().__init__(message)
        self.outcome = outcome


class DecisionBusy(DurableMemoryError):
    """Temporal refused the decision's Update for its per-workflow Update limits (10 in
    flight, 2,000 per run) even after backing off. Nothing was decided: retry later, or send
    the decision as a signal (`wait=False`)."""

    retryable = True


class DecisionUnconfirmed(DurableMemoryError):
    """Every send of the decision's Update ended without an answer (the connection reset, the
    request cancelled under it): it may have reached its turn and be applied yet. Send the
    decision again (a repeat of an applied decision is answered with what applied) or read the
    diff's status."""

    retryable = True


T = TypeVar("T")

BUSY_ATTEMPTS = 6
BUSY_FIRST_DELAY_S = 0.2
"""Backoff for an Update refused at the in-flight limit: 0.2, 0.4, ... 1.6 s (~3 s in all)."""
RESENDS = 6
RESEND_FIRST_DELAY_S = 0.1
"""Backoff for a request that ended without an answer: 0.1, 0.2, ... 3.2 s (~6 s in all)."""
ACCEPTED = UpdateWorkflowExecutionLifecycleStage.UPDATE_WORKFLOW_EXECUTION_LIFECYCLE_STAGE_ACCEPTED


async def execute_decision(
    client: Client,
    handle: WorkflowHandle[Any, Any],
    decision: DiffDecision,
    *,
    attempts: int = BUSY_ATTEMPTS,
    first_delay_s: float = BUSY_FIRST_DELAY_S,
) -> DecisionOutcome:
    """The `decide` Update with a bounded retry of our own: the SDK's retries an Update
    that Temporal refuses for the workflow's Update limits (RESOURCE_EXHAUSTED) without
    end, so the request is sent with its retries off, under one Update id (a resend of
    an admitted one attaches to it), and DecisionBusy comes once the attempts are spent.
    """
    update_id = uuid.uuid4().hex
    request = UpdateWorkflowExecutionRequest(
        namespace=client.namespace,
        workflow_execution=WorkflowExecution(workflow_id=handle.id),
        request=UpdateRequest(
            meta=UpdateMeta(update_id=update_id, identity=client.identity),
            input=UpdateInput(
                name="decide",
                args=Payloads(
                    payloads=await _converter(client, handle.id).encode([update_payload(decision)])
                ),
            ),
        ),
        wait_policy=WaitPolicy(lifecycle_stage=ACCEPTED),
    )
    delay = first_delay_s
    attempt = 0
    unanswered = 0
    while True:
        attempt += 1
        try:
            response = await client.workflow_service.update_workflow_execution(request, retry=False)
        except RPCError as error:
            if error.status in UNANSWERED_STATUSES:  # resent under the same Update id
                unanswered += 1
                if unanswered > RESENDS:
                    raise DecisionUnconfirmed(
                        f"diff {decision.diff_id}: Temporal did not answer the decision "
                        f"{unanswered} time(s) ({error.message}); it may still apply: send it "
                        "again (a repeat is answered with what applied) or read the diff"
                    ) from None
                await asyncio.sleep(RESEND_FIRST_DELAY_S * 2 ** (unanswered - 1))
                continue
            if error.status not in BUSY_STATUSES and not _total_update_limit(error):
                raise
            if attempt >= attempts or _total_update_limit(error):
                raise DecisionBusy(
                    f"diff {decision.diff_id}: nothing decided, Temporal refused the "
                    f"decision {attempt} time(s) ({error.message}); retry later, or "
                    "send it as a signal (wait=False)"
                ) from None
            await asyncio.sleep(delay)
            delay *= 2
            continue
        if response.stage < ACCEPTED:  # the server's long poll ended first: ask again
            continue
        if response.outcome.HasField("failure"):  # refused by the validator
            cause = await _converter(client, handle.id).decode_failure(response.outcome.failure)
            raise WorkflowUpdateFailedError(cause)
        update = handle.get_update_handle(
            update_id,
            workflow_run_id=response.update_ref.workflow_execution.run_id,
            result_type=DecisionOutcome,
        )
        outcome: DecisionOutcome = await resend_dropped(update.result)
        return outcome


async def resend_dropped(send: Callable[[], Awaitable[T]]) -> T:
    """`send()`, sent again (a bounded number of times, with backoff) while the request is
    dropped on its way: cancelled under us by a proxy or by the server itself under load
    ("operation was canceled"), which Temporal's client, unlike a refused connection, does not
    resend. Only for calls that are safe to repeat: reads, our decisions (a repeat is answered
    with what applied), a turn's update-with-start (the same turn id attaches to its turn)."""
    for resend in range(RESENDS + 1):
        try:
            return await send()
        except (RPCError, WorkflowUpdateRPCTimeoutOrCancelledError) as error:
            if resend == RESENDS or not _dropped(error):
                raise
        await asyncio.sleep(RESEND_FIRST_DELAY_S * 2**resend)
    raise AssertionError("unreachable: the last resend returns or raises")


def _dropped(error: BaseException) -> bool:
    """A request cancelled or timed out without our asking: our own cancellation (an
    asyncio.CancelledError behind the SDK's error) is not a drop."""
    if isinstance(error, WorkflowUpdateRPCTimeoutOrCancelledError):
        error = error.__cause__ if error.__cause__ is not None else error
    return isinstance(error, RPCError) and error.status in DROPPED_STATUSES


def _converter(client: Client, workflow_id: str) -> DataConverter:
    """The client's converter for the turn's payloads: with the workflow's context, as the
    SDK's own calls have it, so a per-user codec encrypts the decision for the turn's user."""
    return client.data_converter.with_context(
        WorkflowSerializationContext(namespace=client.namespace, workflow_id=workflow_id)
    )


def update_payload(decision: DiffDecision) -> dict[str, Any]:
    """The `decide` Update's payload as sent: the fields set, not the user (the turn knows)."""
    return decision.model_dump(mode="json", exclude_none=True, exclude={"user_id"})


def signal_payload(decision: DiffDecision) -> dict[str, Any]:
    """An `approve` / `reject` signal's payload: as the Update's, without the decision, which
    the signal's name carries."""
    return decision.model_dump(mode="json", exclude_none=True, exclude={"user_id", "decision"})


BUSY_STATUSES = (
    RPCStatusCode.RESOURCE_EXHAUSTED,  # "limit on number of concurrent in-flight updates"
    RPCStatusCode.ABORTED,  # an admitted Update dropped before the workflow took it
)
"""Refusals of an Update that waiting may cure (server: history/workflow/update/registry.go)."""
DROPPED_STATUSES = (
    RPCStatusCode.CANCELLED,  # cancelled on its way: a proxy, the server under load
    RPCStatusCode.DEADLINE_EXCEEDED,  # a deadline we did not set: the server's or a proxy's
)
UNANSWERED_STATUSES = (
    *DROPPED_STATUSES,
    RPCStatusCode.UNKNOWN,  # "transport error": the connection was reset mid-request
    RPCStatusCode.UNAVAILABLE,  # no connection, or the frontend going away
    RPCStatusCode.INTERNAL,
)
"""What ends the Update's request without an answer from the workflow (the client's own
retries, which would resend these, are off for the Update: see execute_decision)."""


def _total_update_limit(error: RPCError) -> bool:
    """FAILED_PRECONDITION "limit on number of total updates has been reached": the run has
    had its 2,000 Updates; waiting does not help, a signal still works."""
    return error.status is RPCStatusCode.FAILED_PRECONDITION and "total updates" in (error.message)


def decision_error(error: WorkflowUpdateFailedError) -> DurableMemoryError:
    """The workflow's refusal of a decision as the domain error it is."""
    cause = _application_cause(error)
    message = cause.message if cause is not None else str(error)
    kind = cause.type if cause is not None else None
    outcome = _details_outcome(cause)
    if kind == DIFF_ALREADY_DECIDED:
        return DecisionLost(message, outcome)
    if kind == DECISION_REFUSED:
        return DecisionNotApplied(message, outcome)
    if kind == UNKNOWN_DIFF:
        return UnknownDiff(message)
    return DurableMemoryError(message)


def _details_outcome(cause: ApplicationError | None) -> DecisionOutcome | None:
    if cause is None or not cause.details:
        return None
    try:
        return DecisionOutcome.model_validate(cause.details[0])
    except ValidationError:
        return None


def _application_cause(error: BaseException) -> ApplicationError | None:
    cause = error.__cause__ or getattr(error, "cause", None)
    while cause is not None and not isinstance(cause, ApplicationError):
        cause = getattr(cause, "cause", None) or cause.__cause__
    return cause


def failure_message(error: BaseException) -> str:
    cause = _application_cause(error)
    return cause.message if cause is not None else str(error)
