"""MemoryClient: what a backend service uses. Turns and decisions go through Temporal; reads
and a user's own edits go to the memory store, which the client shares with the workers
(same `memory:` settings).

    async with await MemoryClient.connect() as client:
        reply = await client.send_message("alice", "I love building robots")
        await client.approve(reply.diffs[0].id, approver="ms-rivera")

Turns and decisions address the workflow by its type and handler names, as a caller in
another language does: the workflow validates every payload itself (workflows/turn.py).
"""

import asyncio
import gc
import uuid
from datetime import timedelta
from types import TracebackType
from typing import Any, Self

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
    Schedule,
    ScheduleActionStartWorkflow,
    ScheduleAlreadyRunningError,
    ScheduleIntervalSpec,
    ScheduleSpec,
    ScheduleUpdate,
    ScheduleUpdateInput,
    WithStartWorkflowOperation,
    WorkflowHandle,
    WorkflowUpdateFailedError,
)
from temporalio.common import SearchAttributePair, TypedSearchAttributes, WorkflowIDConflictPolicy
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode, TLSConfig

from durable_memory.bootstrap import MemoryStack, stack_from_settings
from durable_memory.config import Settings, load_settings
from durable_memory.memory.core.errors import (
    DecisionRefused,
    DiffAlreadyDecided,
    DurableMemoryError,
    UnknownDiff,
    validation_message,
)
from durable_memory.memory.core.formats import from_markdown
from durable_memory.memory.core.ids import validate_diff_id, validate_label, validate_user_id
from durable_memory.memory.store.git import validate_author_name
from durable_memory.models.archive import ArchiveSearch, PassageHit
from durable_memory.models.context import ContextWindowOverview
from durable_memory.models.diffs import DiffStatus, PendingDiff
from durable_memory.models.history import Author, AuthorKind, CommitInfo
from durable_memory.models.turn import (
    DecisionOutcome,
    DiffDecision,
    RotationInput,
    RotationOutcome,
    SweepInput,
    TurnInput,
    TurnOutcome,
    TurnReply,
    legacy_turn_workflow_id,
    rotation_workflow_id,
    turn_workflow_id,
)
from durable_memory.workflows.common import USER_ID
from durable_memory.workflows.rotation import RotationSweepWorkflow, RotationWorkflow
from durable_memory.workflows.turn import TurnWorkflow
from durable_memory.workflows.turn_boundary import (
    DECISION_REFUSED,
    DIFF_ALREADY_DECIDED,
    TURN_WORKFLOW,
    UNKNOWN_DIFF,
    already_decided,
)


class TemporalUnavailable(DurableMemoryError):
    """Temporal cannot be reached, or refused the request."""


class TurnFailed(DurableMemoryError):
    """The turn ended with a failure: its input was refused, or a step failed for good (the
    message names the step)."""


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


BUSY_ATTEMPTS = 6
BUSY_FIRST_DELAY_S = 0.2
"""Backoff for an Update refused at the in-flight limit: 0.2, 0.4, ... 1.6 s (~3 s in all)."""
ACCEPTED = UpdateWorkflowExecutionLifecycleStage.UPDATE_WORKFLOW_EXECUTION_LIFECYCLE_STAGE_ACCEPTED


async def connect_temporal(settings: Settings) -> Client:
    t = settings.temporal
    tls: bool | TLSConfig = t.tls or bool(t.api_key)
    if t.tls_cert and t.tls_key:
        tls = TLSConfig(
            client_cert=t.tls_cert.read_bytes(), client_private_key=t.tls_key.read_bytes()
        )
    try:
        return await Client.connect(
            t.address,
            namespace=t.namespace,
            api_key=t.api_key,
            tls=tls,
            data_converter=pydantic_data_converter,
        )
    except RuntimeError as error:
        raise TemporalUnavailable(
            f"cannot reach Temporal at {t.address} (namespace {t.namespace}): {error}; "
            "start one with `dmem dev` or set temporal.address"
        ) from None


def _checked(model: type[Any], **values: Any) -> Any:
    try:
        return model(**values)
    except ValidationError as error:
        raise DurableMemoryError(validation_message(error, "invalid input")) from None


class MemoryClient:
    """Use as an async context manager (`async with await MemoryClient.connect() as c:`), or
    call `close()`; leaving one open at interpreter exit is safe too."""

    busy_attempts = BUSY_ATTEMPTS
    busy_first_delay_s = BUSY_FIRST_DELAY_S

    def __init__(self, client: Client, settings: Settings, stack: MemoryStack) -> None:
        self.client = client
        self.settings = settings
        self.stack = stack
        self._closed = False

    @classmethod
    async def connect(cls, settings: Settings | None = None) -> "MemoryClient":
        settings = settings or load_settings()
        client = await connect_temporal(settings)
        return cls(client, settings, stack_from_settings(settings))

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the memory store (idempotent). The Temporal connection has no close in the
        SDK: it ends when the last reference goes, so collect it now, while the interpreter
        is whole, rather than during its finalisation (sdk-python issue #300)."""
        if self._closed:
            return
        self._closed = True
        self.stack.close()
        gc.collect()

    # -- turns -----------------------------------------------------------------------------

    async def send_message(
        self, user_id: str, message: str, *, turn_id: str | None = None
    ) -> TurnReply:
        """Run a turn and return its reply in the same call (update-with-start). Sending again
        with the same turn id returns the same turn's reply instead of starting another."""
        validate_user_id(user_id)
        turn: TurnInput = _checked(
            TurnInput,
            user_id=user_id,
            turn_id=turn_id or uuid.uuid4().hex,
            message=message,
            max_steps=self.settings.memory.max_steps,
            approval_ttl_s=self.settings.turn.approval_ttl_s,
            activities=self.settings.activities,
        )
        start: WithStartWorkflowOperation[Any, TurnOutcome] = WithStartWorkflowOperation(
            TURN_WORKFLOW,
            turn,
            result_type=TurnOutcome,
            id=turn_workflow_id(user_id, turn.turn_id),
            task_queue=self.settings.temporal.task_queue,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            search_attributes=TypedSearchAttributes([SearchAttributePair(USER_ID, user_id)]),
            static_summary=f"Turn of {user_id}: {message[:100]}",
        )
        try:
            result: TurnReply = await self.client.execute_update_with_start_workflow(
                TurnWorkflow.reply, start_workflow_operation=start
            )
        except WorkflowUpdateFailedError as error:
            raise TurnFailed(f"the turn failed: {_cause(error)}") from None
        except RPCError as error:
            raise TemporalUnavailable(f"the turn could not start: {error.message}") from None
        return result

    # -- decisions -------------------------------------------------------------------------

    async def pending_diffs(self, user_id: str) -> list[PendingDiff]:
        return await asyncio.to_thread(self.stack.review.pending, validate_user_id(user_id))

    async def preview(self, diff_id: str, user_id: str | None = None) -> str:
        return await asyncio.to_thread(self.stack.review.preview, diff_id, user_id)

    async def approve(
        self,
        diff_id: str,
        approver: str,
        *,
        user_id: str | None = None,
        edited_markdown: str | None = None,
        wait: bool = True,
    ) -> DecisionOutcome | None:
        """Approve (optionally with the block edited as Markdown). With `wait`, an Update that
        returns the commit; without, a signal that is accepted even while workers are down."""
        return await self._decide(
            "approve",
            diff_id,
            approver,
            user_id=user_id,
            edited_markdown=edited_markdown,
            wait=wait,
        )

    async def reject(
        self,
        diff_id: str,
        approver: str,
        reason: str,
        *,
        user_id: str | None = None,
        wait: bool = True,
    ) -> DecisionOutcome | None:
        if not reason.strip():
            raise DurableMemoryError("a rejection needs a reason")
        return await self._decide(
            "reject", diff_id, approver, user_id=user_id, reason=reason, wait=wait
        )

    async def _decide(
        self,
        kind: str,
        diff_id: str,
        approver: str,
        *,
        user_id: str | None,
        wait: bool,
        reason: str | None = None,
        edited_markdown: str | None = None,
    ) -> DecisionOutcome | None:
        validate_diff_id(diff_id)
        validate_author_name(approver)
        diff = await asyncio.to_thread(self.stack.review.get, diff_id, user_id)
        decision: DiffDecision = _checked(
            DiffDecision,
            diff_id=diff_id,
            user_id=diff.user_id,
            decision=kind,
            approver=approver,
            reason=reason,
            edited_markdown=edited_markdown,
        )
        turn_id = diff.proposer.turn_id
        if turn_id is None:
            raise DurableMemoryError(f"diff {diff_id} was not proposed by a turn")
        if edited_markdown is not None:  # refused here, with line and reason, not in history
            await asyncio.to_thread(
                from_markdown, self.stack.blocks.spec(diff.label), edited_markdown
            )
        # A turn started before the unambiguous ids keeps its old id: tried second.
        for workflow_id in (
            turn_workflow_id(diff.user_id, turn_id),
            legacy_turn_workflow_id(diff.user_id, turn_id),
        ):
            handle = self.client.get_workflow_handle(workflow_id)
            try:
                if workflow_id != turn_workflow_id(diff.user_id, turn_id):
                    # An old id may be another user's turn ('a-b' + 'c' = 'a' + 'b-c').
                    found = await handle.describe()
                    if found.typed_search_attributes.get(USER_ID) != diff.user_id:
                        continue
                if not wait:
                    await handle.signal(kind, decision)
                    return None
                return await self._execute_decision(handle, decision)
            except WorkflowUpdateFailedError as error:
                raise _decision_error(error) from None
            except RPCError as error:
                if error.status is not RPCStatusCode.NOT_FOUND:
                    raise TemporalUnavailable(
                        f"the decision was not sent: {error.message}"
                    ) from None
                gone = error  # this id names no turn that takes decisions
        # Neither id names a running turn: it has ended, and the store has the diff's
        # final state.
        current = await asyncio.to_thread(self.stack.review.get, diff_id, diff.user_id)
        if current.status is DiffStatus.PENDING:
            raise DecisionRefused(
                f"diff {diff_id} is pending but its turn is no longer waiting ({gone.message})"
            ) from None
        outcome = DecisionOutcome(
            diff_id=current.id,
            status=current.status,
            commit_sha=current.commit_sha,
            message=current.decision_reason or "",
            label=current.label,
            decided_by=current.decided_by,
            decided_at=current.decided_at,
        )
        raise DecisionLost(already_decided(outcome).message, outcome) from None

    async def _execute_decision(
        self, handle: WorkflowHandle[Any, Any], decision: DiffDecision
    ) -> DecisionOutcome:
        """The `decide` Update with a bounded retry of our own: the SDK's retries an Update
        that Temporal refuses for the workflow's Update limits (RESOURCE_EXHAUSTED) without
        end, so the request is sent with its retries off, under one Update id (a resend of
        an admitted one attaches to it), and DecisionBusy comes once the attempts are spent.
        """
        update_id = uuid.uuid4().hex
        request = UpdateWorkflowExecutionRequest(
            namespace=self.client.namespace,
            workflow_execution=WorkflowExecution(workflow_id=handle.id),
            request=UpdateRequest(
                meta=UpdateMeta(update_id=update_id, identity=self.client.identity),
                input=UpdateInput(
                    name="decide",
                    args=Payloads(payloads=await self.client.data_converter.encode([decision])),
                ),
            ),
            wait_policy=WaitPolicy(lifecycle_stage=ACCEPTED),
        )
        delay = self.busy_first_delay_s
        attempt = 0
        while True:
            attempt += 1
            try:
                response = await self.client.workflow_service.update_workflow_execution(
                    request, retry=False
                )
            except RPCError as error:
                if error.status not in BUSY_STATUSES and not _total_update_limit(error):
                    raise
                if attempt >= self.busy_attempts or _total_update_limit(error):
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
                cause = await self.client.data_converter.decode_failure(response.outcome.failure)
                raise WorkflowUpdateFailedError(cause)
            outcome: DecisionOutcome = await handle.get_update_handle(
                update_id,
                workflow_run_id=response.update_ref.workflow_execution.run_id,
                result_type=DecisionOutcome,
            ).result()
            return outcome

    # -- a person's own memory -------------------------------------------------------------

    async def edit_block(self, user_id: str, label: str, markdown: str, author: str) -> str:
        """A user's own edit of a block (its Markdown form), committed directly as them."""
        person = Author(name=validate_author_name(author), kind=AuthorKind.USER)
        return await asyncio.to_thread(
            self.stack.edits.edit_markdown, validate_user_id(user_id), label, markdown, person
        )

    async def history(self, user_id: str, label: str, limit: int = 20) -> list[CommitInfo]:
        return await asyncio.to_thread(self.stack.history.history, user_id, label, limit)

    async def restore(self, user_id: str, label: str, sha: str, author: str) -> str:
        person = Author(name=validate_author_name(author), kind=AuthorKind.USER)
        return await asyncio.to_thread(self.stack.history.restore, user_id, label, sha, person)

    async def search_archive(self, user_id: str, query: str, **options: Any) -> list[PassageHit]:
        request: ArchiveSearch = _checked(ArchiveSearch, query=query, **options)
        return await asyncio.to_thread(
            self.stack.archive.search, validate_user_id(user_id), request
        )

    async def context_overview(self, user_id: str) -> ContextWindowOverview:
        context = await asyncio.to_thread(self.stack.compile, validate_user_id(user_id))
        return context.overview

    # -- rotation --------------------------------------------------------------------------

    async def rotate_now(
        self, user_id: str, label: str | None = None, *, force: bool = False
    ) -> list[RotationOutcome]:
        """Run the rotation workflow for one block or every block, and wait for the results."""
        validate_user_id(user_id)
        labels = (
            [validate_label(label)]
            if label
            else [b.label for b in self.stack.blocks.profile.blocks]
        )
        for name in labels:
            self.stack.blocks.spec(name)
        handles = [
            await self.client.start_workflow(
                RotationWorkflow.run,
                RotationInput(
                    user_id=user_id, label=name, force=force, activities=self.settings.activities
                ),
                id=rotation_workflow_id(user_id, name),
                task_queue=self.settings.temporal.task_queue,
                id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                static_summary=f"Rotate {name} of {user_id}",
            )
            for name in labels
        ]
        return [await handle.result() for handle in handles]

    async def ensure_rotation_schedule(self) -> str:
        """Create (or update) the Temporal Schedule that sweeps for blocks over threshold."""
        rotation = self.settings.rotation
        action = ScheduleActionStartWorkflow(
            RotationSweepWorkflow.run,
            SweepInput(activities=self.settings.activities),
            id=f"{rotation.schedule_id}-run",
            task_queue=self.settings.temporal.task_queue,
        )
        spec = ScheduleSpec(
            intervals=[ScheduleIntervalSpec(every=timedelta(seconds=rotation.interval_s))]
        )
        schedule = Schedule(action=action, spec=spec)
        try:
            await self.client.create_schedule(rotation.schedule_id, schedule)
        except ScheduleAlreadyRunningError:

            def update(_: ScheduleUpdateInput) -> ScheduleUpdate:
                return ScheduleUpdate(schedule=schedule)

            await self.client.get_schedule_handle(rotation.schedule_id).update(update)
        return rotation.schedule_id


BUSY_STATUSES = (
    RPCStatusCode.RESOURCE_EXHAUSTED,  # "limit on number of concurrent in-flight updates"
    RPCStatusCode.ABORTED,  # an admitted Update dropped before the workflow took it
    RPCStatusCode.UNAVAILABLE,
)
"""Refusals of an Update that waiting may cure (server: history/workflow/update/registry.go)."""


def _total_update_limit(error: RPCError) -> bool:
    """FAILED_PRECONDITION "limit on number of total updates has been reached": the run has
    had its 2,000 Updates; waiting does not help, a signal still works."""
    return error.status is RPCStatusCode.FAILED_PRECONDITION and "total updates" in (error.message)


def _decision_error(error: WorkflowUpdateFailedError) -> DurableMemoryError:
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


def _cause(error: BaseException) -> str:
    cause = _application_cause(error)
    return cause.message if cause is not None else str(error)
