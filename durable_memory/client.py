"""MemoryClient: what a backend service uses. Turns and decisions go through Temporal; reads
and a user's own edits go to the memory store, which the client shares with the workers
(same `memory:` settings).

    client = await MemoryClient.connect()
    reply = await client.send_message("alice", "I love building robots")
    await client.approve(reply.diffs[0].id, approver="ms-rivera")
"""

import asyncio
import uuid
from datetime import timedelta
from typing import Any

from pydantic import ValidationError
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
    WorkflowUpdateFailedError,
)
from temporalio.common import SearchAttributePair, TypedSearchAttributes, WorkflowIDConflictPolicy
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, TLSConfig

from durable_memory.config import Settings, load_settings
from durable_memory.memory.context import ContextWindowOverview
from durable_memory.memory.errors import (
    DecisionRefused,
    DiffAlreadyDecided,
    DurableMemoryError,
    validation_message,
)
from durable_memory.memory.formats import from_markdown
from durable_memory.memory.git_store import validate_author_name
from durable_memory.memory.ids import validate_diff_id, validate_label, validate_user_id
from durable_memory.memory.stack import MemoryStack
from durable_memory.models.archive import ArchiveSearch, PassageHit
from durable_memory.models.diffs import PendingDiff
from durable_memory.models.history import Author, AuthorKind, CommitInfo
from durable_memory.models.turn import (
    DecisionOutcome,
    DiffDecision,
    RotationInput,
    RotationOutcome,
    SweepInput,
    TurnInput,
    TurnReply,
    rotation_workflow_id,
    turn_workflow_id,
)
from durable_memory.workers.worker import stack_from_settings
from durable_memory.workflows.common import USER_ID
from durable_memory.workflows.rotation import RotationSweepWorkflow, RotationWorkflow
from durable_memory.workflows.turn import TurnWorkflow


class TemporalUnavailable(DurableMemoryError):
    """Temporal cannot be reached, or refused the request."""


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
    def __init__(self, client: Client, settings: Settings, stack: MemoryStack) -> None:
        self.client = client
        self.settings = settings
        self.stack = stack

    @classmethod
    async def connect(cls, settings: Settings | None = None) -> "MemoryClient":
        settings = settings or load_settings()
        client = await connect_temporal(settings)
        return cls(client, settings, stack_from_settings(settings))

    def close(self) -> None:
        self.stack.close()

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
        start = WithStartWorkflowOperation(
            TurnWorkflow.run,
            turn,
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
        except (WorkflowUpdateFailedError, RPCError) as error:
            raise TemporalUnavailable(f"the turn failed: {_cause(error)}") from None
        return result

    # -- decisions -------------------------------------------------------------------------

    async def pending_diffs(self, user_id: str) -> list[PendingDiff]:
        return await asyncio.to_thread(self.stack.service.pending, validate_user_id(user_id))

    async def preview(self, diff_id: str, user_id: str | None = None) -> str:
        return await asyncio.to_thread(self.stack.service.preview, diff_id, user_id)

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
        diff = await asyncio.to_thread(self.stack.service.diffs.get, diff_id, user_id)
        decision: DiffDecision = _checked(
            DiffDecision,
            diff_id=diff_id,
            user_id=diff.user_id,
            decision=kind,
            approver=approver,
            reason=reason,
            edited_markdown=edited_markdown,
        )
        if not diff.proposed_by.startswith("turn:"):
            raise DurableMemoryError(f"diff {diff_id} was not proposed by a turn")
        if edited_markdown is not None:  # refused here, with line and reason, not in history
            await asyncio.to_thread(
                from_markdown, self.stack.service.spec(diff.label), edited_markdown
            )
        handle = self.client.get_workflow_handle(
            turn_workflow_id(diff.user_id, diff.proposed_by.removeprefix("turn:"))
        )
        try:
            if not wait:
                signal = TurnWorkflow.approve if kind == "approve" else TurnWorkflow.reject
                await handle.signal(signal, decision)
                return None
            outcome: DecisionOutcome = await handle.execute_update(TurnWorkflow.decide, decision)
            return outcome
        except WorkflowUpdateFailedError as error:
            if _cause_type(error) == "DecisionRefused":
                raise DecisionRefused(_cause(error)) from None
            raise DiffAlreadyDecided(_cause(error)) from None
        except RPCError as error:
            current = await asyncio.to_thread(self.stack.service.diffs.get, diff_id, diff.user_id)
            raise DiffAlreadyDecided(
                f"diff {diff_id} is already {current.status.value}; its turn is no longer waiting "
                f"({error.message})"
            ) from None

    # -- a person's own memory -------------------------------------------------------------

    async def edit_block(self, user_id: str, label: str, markdown: str, author: str) -> str:
        """A user's own edit of a block (its Markdown form), committed directly as them."""
        person = Author(name=validate_author_name(author), kind=AuthorKind.USER)
        return await asyncio.to_thread(
            self.stack.service.edit_markdown, validate_user_id(user_id), label, markdown, person
        )

    async def history(self, user_id: str, label: str, limit: int = 20) -> list[CommitInfo]:
        return await asyncio.to_thread(self.stack.service.history, user_id, label, limit)

    async def restore(self, user_id: str, label: str, sha: str, author: str) -> str:
        person = Author(name=validate_author_name(author), kind=AuthorKind.USER)
        return await asyncio.to_thread(self.stack.service.restore, user_id, label, sha, person)

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
            else [b.label for b in self.stack.service.profile.blocks]
        )
        for name in labels:
            self.stack.service.spec(name)
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


def _application_cause(error: BaseException) -> ApplicationError | None:
    cause = error.__cause__ or getattr(error, "cause", None)
    while cause is not None and not isinstance(cause, ApplicationError):
        cause = getattr(cause, "cause", None) or cause.__cause__
    return cause


def _cause(error: BaseException) -> str:
    cause = _application_cause(error)
    return cause.message if cause is not None else str(error)


def _cause_type(error: BaseException) -> str | None:
    cause = _application_cause(error)
    return cause.type if cause is not None else None
