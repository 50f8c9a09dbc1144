"""MemoryClient: what a backend service uses. Turns and decisions go through Temporal; reads
and a user's own edits go to the memory store, which the client shares with the workers
(same `memory:` settings). With memory.git_remote the client is thin: it needs the Temporal
address, the PostgreSQL database, the shared archive and the git remote, and its data dir
holds only disposable clones; reads fetch from the remote, and its writes (a hand edit, a
restore, a profile) are pushed with compare-and-set, so they serialise with the turns'
commits (docs/integration.md, "A thin client").

    async with await MemoryClient.connect() as client:
        reply = await client.send_message("alice", "I love building robots")
        await client.approve(reply.diffs[0].id, approver="ms-rivera")

Turns and decisions address the workflow by its type and handler names, as a caller in
another language does: the workflow validates every payload itself (workflows/turn.py).

One module though over 300 lines: it is the one face a backend holds, each method a short
mapping of a call onto Temporal or the memory stack; how a decision's Update is delivered
and its refusals read is a job of its own, in decision_delivery.py.
"""

import asyncio
import contextlib
import functools
import gc
import logging
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from types import TracebackType
from typing import Any, ParamSpec, Self, TypeVar

from pydantic import ValidationError
from temporalio.api.enums.v1 import TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
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
    WorkflowFailureError,
    WorkflowUpdateFailedError,
    WorkflowUpdateRPCTimeoutOrCancelledError,
)
from temporalio.common import SearchAttributePair, TypedSearchAttributes, WorkflowIDConflictPolicy
from temporalio.exceptions import TerminatedError
from temporalio.service import RPCError, RPCStatusCode, TLSConfig

from durable_memory.bootstrap import MemoryStack, stack_from_settings
from durable_memory.codec import data_converter_for
from durable_memory.config import Settings, load_settings
from durable_memory.decision_delivery import (
    BUSY_ATTEMPTS,
    BUSY_FIRST_DELAY_S,
    DecisionBusy,
    DecisionLost,
    DecisionNotApplied,
    DecisionUnconfirmed,
    decision_error,
    execute_decision,
    failure_message,
    resend_dropped,
    signal_payload,
)
from durable_memory.memory.core.errors import (
    DecisionRefused,
    DurableMemoryError,
    validation_message,
)
from durable_memory.memory.core.formats import from_markdown
from durable_memory.memory.core.ids import validate_diff_id, validate_user_id
from durable_memory.memory.core.limits import cut_at_word
from durable_memory.memory.core.policies import StandingApproval
from durable_memory.memory.service.access import block_spec
from durable_memory.memory.service.redaction import Redactions, redaction_id
from durable_memory.memory.store.git import validate_author_name
from durable_memory.models.archive import ArchiveSearch, PassageHit
from durable_memory.models.blocks import AgentProfile
from durable_memory.models.context import ContextWindowOverview
from durable_memory.models.diffs import DiffStatus, PendingDiff
from durable_memory.models.history import (
    Author,
    AuthorKind,
    CommitInfo,
    RedactInput,
    RedactionRecord,
    redact_workflow_id,
)
from durable_memory.models.turn import (
    DecisionOutcome,
    DiffDecision,
    ErasureRecord,
    ForgetInput,
    RotationInput,
    RotationOutcome,
    SweepInput,
    TurnInput,
    TurnOutcome,
    TurnReply,
    forget_workflow_id,
    legacy_turn_workflow_id,
    rotation_workflow_id,
    turn_workflow_id,
)
from durable_memory.workflows.common import USER_ID, starting_attributes
from durable_memory.workflows.forget import ForgetWorkflow
from durable_memory.workflows.redact import RedactWorkflow
from durable_memory.workflows.rotation import RotationSweepWorkflow, RotationWorkflow
from durable_memory.workflows.turn import TurnWorkflow
from durable_memory.workflows.turn_boundary import (
    TURN_WORKFLOW,
    already_decided,
)

log = logging.getLogger(__name__)

__all__ = [
    "DecisionBusy",
    "DecisionLost",
    "DecisionNotApplied",
    "DecisionUnconfirmed",
    "ForgetFailed",
    "MemoryClient",
    "NoWorkerPolling",
    "TemporalUnavailable",
    "TurnFailed",
    "connect_temporal",
]
"""What a backend imports from here; the decision errors are defined in decision_delivery."""


P = ParamSpec("P")
R = TypeVar("R")


class TemporalUnavailable(DurableMemoryError):
    """Temporal cannot be reached, or refused the request."""


class ForgetFailed(DurableMemoryError):
    """A forget that failed before it completed (a store down for too long): the user's
    turns stay refused until a forget is run again and completes."""


class NoWorkerPolling(TemporalUnavailable):
    """No worker has polled the task queue for `temporal.no_worker_grace_s`: the request
    stays with Temporal and runs when a worker starts (a turn starts then; a decision may
    still apply then). Send it again, with the same turn id, for its answer."""


class TurnFailed(DurableMemoryError):
    """The turn ended with a failure: its input was refused, or a step failed for good (the
    message names the step)."""


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
            data_converter=data_converter_for(settings),  # the codec, when encrypting
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

    async def _while_a_worker_polls(self, call: Awaitable[R], waiting_for: str) -> R:
        """`call`, given up with NoWorkerPolling once no worker has polled the task queue for
        `temporal.no_worker_grace_s` (a whole fleet down must not hold a caller forever; a
        slow model call with workers up never trips it)."""
        grace = self.settings.temporal.no_worker_grace_s
        task = asyncio.ensure_future(call)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=min(max(grace / 4, 0.5), 15.0))
                if done:
                    return task.result()
                if not await self._a_worker_polled_within(grace):
                    queue = self.settings.temporal.task_queue
                    raise NoWorkerPolling(
                        f"no worker has polled task queue '{queue}' for {grace:g} s, so "
                        f"{waiting_for} did not arrive; the request stays with Temporal and "
                        "runs when a worker starts: send it again then for the answer"
                    )
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    async def _a_worker_polled_within(self, seconds: float) -> bool:
        """Whether a worker polled the task queue for workflow tasks in the last `seconds`
        (Temporal's pollers list, by the server's clock); unknown counts as yes."""
        request = DescribeTaskQueueRequest(
            namespace=self.client.namespace,
            task_queue=TaskQueue(name=self.settings.temporal.task_queue),
            task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW,
        )
        try:
            found = await self.client.workflow_service.describe_task_queue(request)
        except RPCError:
            return True
        since = datetime.now(UTC) - timedelta(seconds=seconds)
        return any(poller.last_access_time.ToDatetime(UTC) >= since for poller in found.pollers)

    async def _memory(self, call: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """`call` on the memory stack, off the event loop (it may ask the git remote), its
        reads in one state of memory: each user's remote is asked once (`git.pinned`)."""

        def pinned() -> R:
            with self.stack.git.pinned():
                return call(*args, **kwargs)

        return await asyncio.to_thread(pinned)

    # -- turns -----------------------------------------------------------------------------

    async def send_message(
        self,
        user_id: str,
        message: str,
        *,
        turn_id: str | None = None,
        profile: str | None = None,
        fresh_user: bool = False,
    ) -> TurnReply:
        """Run a turn and return its reply in the same call (update-with-start). Sending again
        with the same turn id returns the same turn's reply instead of starting another.
        `profile` chooses a new user's profile; for a user who has another, the turn fails.
        A user who was forgotten gets UserForgotten, unless `fresh_user` starts them afresh
        with an empty memory."""
        validate_user_id(user_id)
        turn: TurnInput = _checked(
            TurnInput,
            user_id=user_id,
            turn_id=turn_id or uuid.uuid4().hex,
            message=message,
            profile=profile,
            fresh_user=fresh_user or None,
        )
        if fresh_user:  # before anything of the turn is encoded with the user's key
            await self._memory(self.stack.blocks.ensure_user, user_id, profile, fresh=True)

        async def send() -> TurnReply:  # each send needs its own start operation
            start: WithStartWorkflowOperation[Any, TurnOutcome] = WithStartWorkflowOperation(
                TURN_WORKFLOW,
                turn.model_dump(mode="json", exclude_none=True),  # the worker's settings apply
                result_type=TurnOutcome,
                id=turn_workflow_id(user_id, turn.turn_id),
                task_queue=self.settings.temporal.task_queue,
                id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                # What the turn sets first, set here so that it need not (its patch
                # `turn-starter-attributes`): one upsert fewer on the reply's path.
                search_attributes=TypedSearchAttributes(starting_attributes(user_id)),
                static_summary=f"Turn of {user_id}: {cut_at_word(message, 100)}",
            )
            return await self.client.execute_update_with_start_workflow(
                TurnWorkflow.reply, start_workflow_operation=start
            )

        try:
            # A resend with the same turn id attaches to its turn.
            result = await self._while_a_worker_polls(resend_dropped(send), "the turn's reply")
        except WorkflowUpdateFailedError as error:
            raise TurnFailed(f"the turn failed: {failure_message(error)}") from None
        except RPCError as error:
            raise TemporalUnavailable(f"the turn could not start: {error.message}") from None
        except WorkflowUpdateRPCTimeoutOrCancelledError as error:
            if isinstance(error.__cause__, asyncio.CancelledError):
                raise  # the caller cancelled: not ours to explain
            raise TemporalUnavailable(
                f"the turn's reply did not arrive ({error.__cause__ or error}): send the "
                "message again with the same turn id to get it"
            ) from None
        return result

    # -- decisions -------------------------------------------------------------------------

    async def pending_diffs(self, user_id: str) -> list[PendingDiff]:
        return await self._memory(self.stack.review.pending, validate_user_id(user_id))

    async def preview(self, diff_id: str, user_id: str | None = None) -> str:
        return await self._memory(self.stack.review.preview, diff_id, user_id)

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
        diff = await self._memory(self.stack.review.get, diff_id, user_id)
        decision: DiffDecision = _checked(
            DiffDecision,
            diff_id=diff_id,
            decision=kind,
            approver=approver,
            reason=reason,
            edited_markdown=edited_markdown,
        )
        turn_id = diff.proposer.turn_id
        if turn_id is None:
            raise DurableMemoryError(f"diff {diff_id} was not proposed by a turn")
        if edited_markdown is not None:  # refused here, with line and reason, not in history
            spec = await self._memory(self.stack.blocks.spec, diff.user_id, diff.label)
            from_markdown(spec, edited_markdown)
        # A turn started before the unambiguous ids keeps its old id: tried second.
        for workflow_id in (
            turn_workflow_id(diff.user_id, turn_id),
            legacy_turn_workflow_id(diff.user_id, turn_id),
        ):
            handle = self.client.get_workflow_handle(workflow_id)
            try:
                if workflow_id != turn_workflow_id(diff.user_id, turn_id):
                    # An old id may be another user's turn ('a-b' + 'c' = 'a' + 'b-c').
                    found = await resend_dropped(handle.describe)
                    if found.typed_search_attributes.get(USER_ID) != diff.user_id:
                        continue
                if not wait:
                    signal = functools.partial(handle.signal, kind, signal_payload(decision))
                    await resend_dropped(signal)
                    return None
                return await self._while_a_worker_polls(
                    execute_decision(
                        self.client,
                        handle,
                        decision,
                        attempts=self.busy_attempts,
                        first_delay_s=self.busy_first_delay_s,
                    ),
                    "the decision's answer",
                )
            except WorkflowUpdateFailedError as error:
                raise decision_error(error) from None
            except RPCError as error:
                if error.status is not RPCStatusCode.NOT_FOUND:
                    raise TemporalUnavailable(
                        f"the decision was not sent: {error.message}"
                    ) from None
                gone = error  # this id names no turn that takes decisions
        # Neither id names a running turn: it has ended, and the store has the diff's
        # final state.
        current = await self._memory(self.stack.review.get, diff_id, diff.user_id)
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

    # -- users and their profiles ----------------------------------------------------------

    async def create_user(self, user_id: str, profile: str | None = None) -> str:
        """Create the user's memory with `profile` (default: the deployment's), recorded in
        their repository; idempotent for the same profile, refused for another. Returns HEAD."""
        return await self._memory(self.stack.blocks.ensure_user, validate_user_id(user_id), profile)

    async def set_profile(self, user_id: str, profile: str, author: str) -> str:
        """Change the user's profile, committed as `author`, if their blocks fit it (else
        ProfileError says which do not). Returns HEAD after."""
        person = Author(name=validate_author_name(author), kind=AuthorKind.USER)
        return await self._memory(
            self.stack.edits.set_profile, validate_user_id(user_id), profile, person
        )

    async def profile_of(self, user_id: str) -> AgentProfile:
        return await self._memory(self.stack.blocks.profile, validate_user_id(user_id))

    # -- standing approvals ----------------------------------------------------------------

    async def standing_approvals(self, user_id: str) -> list[StandingApproval]:
        """The user's standing approvals, oldest first (live, expired and revoked)."""
        return await self._memory(self.stack.policies.approvals, user_id)

    async def set_standing_approval(
        self,
        user_id: str,
        label: str,
        operations: list[str],
        set_by: str,
        expires_at: datetime,
        reason: str = "",
    ) -> StandingApproval:
        """Approve ahead of time the agent's edits of `operations` kinds to block `label`,
        until `expires_at`; committed in the user's repository as `set_by`."""
        return await self._memory(
            self.stack.policies.set, user_id, label, operations, set_by, expires_at, reason
        )

    async def revoke_standing_approval(
        self, user_id: str, policy_id: str, revoked_by: str
    ) -> StandingApproval:
        """Revoke a standing approval (committed as `revoked_by`): the next proposal waits."""
        return await self._memory(self.stack.policies.revoke, user_id, policy_id, revoked_by)

    # -- a person's own memory -------------------------------------------------------------

    async def block_for_editing(self, user_id: str, label: str) -> tuple[str, str | None]:
        """The block's Markdown form to show a person, and the commit it was read at (pass it
        to `edit_block` as `based_on`)."""
        return await self._memory(self.stack.blocks.for_editing, validate_user_id(user_id), label)

    async def edit_block(
        self, user_id: str, label: str, markdown: str, author: str, based_on: str | None = None
    ) -> str:
        """A user's own edit of a block (its Markdown form), committed directly as them. With
        `based_on` (from `block_for_editing`), BlockChanged instead if the block changed since
        the person was shown it: their edit would otherwise undo a change they never saw."""
        person = Author(name=validate_author_name(author), kind=AuthorKind.USER)
        return await self._memory(
            self.stack.edits.edit_markdown,
            validate_user_id(user_id),
            label,
            markdown,
            person,
            based_on,
        )

    async def history(self, user_id: str, label: str, limit: int = 20) -> list[CommitInfo]:
        return await self._memory(self.stack.history.history, user_id, label, limit)

    async def restore(self, user_id: str, label: str, sha: str, author: str) -> str:
        person = Author(name=validate_author_name(author), kind=AuthorKind.USER)
        return await self._memory(self.stack.history.restore, user_id, label, sha, person)

    async def search_archive(self, user_id: str, query: str, **options: Any) -> list[PassageHit]:
        request: ArchiveSearch = _checked(ArchiveSearch, query=query, **options)
        return await self._memory(self.stack.archive.search, validate_user_id(user_id), request)

    async def context_overview(self, user_id: str) -> ContextWindowOverview:
        context = await self._memory(self.stack.compile, validate_user_id(user_id))
        return context.overview

    # -- governance ------------------------------------------------------------------------

    async def _run_to_its_deletion(
        self,
        run: Callable[[Any, Any], Awaitable[Any]],
        request: Any,
        workflow_id: str,
        user_id: str,
        summary: str,
        what: str,
    ) -> str:
        """Start a governance workflow whose last step deletes its own execution (its input
        names the user or holds what is removed), or join the one running, and wait for its
        end: '' once it ended that way, else why it failed. What it did is read after from
        the stores, as its result is deleted with it."""
        try:
            handle = await self.client.start_workflow(
                run,
                request,
                id=workflow_id,
                task_queue=self.settings.temporal.task_queue,
                id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                search_attributes=TypedSearchAttributes([SearchAttributePair(USER_ID, user_id)]),
                static_summary=summary,
            )
        except RPCError as error:
            raise TemporalUnavailable(f"the {what} could not start: {error.message}") from None
        try:
            await self._while_a_worker_polls(handle.result(), f"the {what}'s end")
        except WorkflowFailureError as error:
            if not isinstance(error.cause, TerminatedError):  # deleted: terminated first
                return failure_message(error)
        except RPCError as error:  # its history was deleted while we read it
            if error.status != RPCStatusCode.NOT_FOUND:
                raise TemporalUnavailable(f"the {what}'s result: {error.message}") from None
        return ""

    async def forget_user(self, user_id: str, requested_by: str, reason: str) -> ErasureRecord:
        """Forget the user everywhere (docs/governance.md) and return the erasure record. Runs
        the forget workflow and waits for it; a forget of the user already running is joined,
        and one that failed or was killed is finished by calling this again."""
        request: ForgetInput = _checked(
            ForgetInput, user_id=user_id, requested_by=requested_by, reason=reason
        )
        failure = await self._run_to_its_deletion(
            ForgetWorkflow.run,
            request,
            forget_workflow_id(request.user_id),
            user_id,
            f"Forget user {user_id}",
            "forget",
        )
        records = await asyncio.to_thread(self.stack.erasures.records, request.user_id)
        if not records or records[0].completed_at is None:
            raise ForgetFailed(
                f"the forget of user '{user_id}' did not complete ({failure or 'no record'}); "
                "run it again to finish it"
            )
        return records[0]

    async def redact(
        self,
        user_id: str,
        label: str,
        text: str,
        requested_by: str,
        reason: str,
        *,
        delete_executions: bool = False,
    ) -> RedactionRecord:
        """Remove `text` from every version of block `label` of the user, and from the user's
        rows and archival passages (docs/governance.md "Redact a version"); return the
        redaction record. A request that cannot be made is refused here, before anything
        starts; otherwise the redaction workflow runs, and deletes its own execution (its input
        holds the text). With `delete_executions`, the user's ended workflow executions whose
        histories hold the text are deleted too (Temporal cannot edit a history). A redaction
        that failed or was killed is finished by calling this again with the same text."""
        request: RedactInput = _checked(
            RedactInput,
            user_id=user_id,
            label=label,
            text=text,
            requested_by=requested_by,
            reason=reason,
            delete_executions=delete_executions,
            redaction_id=redaction_id(user_id, label, text),
        )
        redactions = Redactions(self.stack.blocks, self.stack.git, self.stack.engine)
        await self._memory(redactions.preflight, request)
        failure = await self._run_to_its_deletion(
            RedactWorkflow.run,
            request,
            redact_workflow_id(request.user_id),
            user_id,
            f"Redact a text from block {label} of user {user_id}",
            "redaction",
        )
        record = await self._memory(redactions.recorded, request.user_id, request.redaction_id)
        if failure or record is None:
            raise DurableMemoryError(
                f"the redaction in block '{label}' of user '{user_id}' did not complete "
                f"({failure or 'another redaction of the user was under way'}); run it again "
                "to finish it"
            )
        return record

    # -- rotation --------------------------------------------------------------------------

    async def rotate_now(
        self, user_id: str, label: str | None = None, *, force: bool = False
    ) -> list[RotationOutcome]:
        """Run the rotation workflow for one block or every block, and wait for the results."""
        validate_user_id(user_id)
        profile = await self._memory(self.stack.blocks.profile, user_id)
        labels = [block_spec(profile, label).label] if label else [b.label for b in profile.blocks]
        handles = [
            await self.client.start_workflow(
                RotationWorkflow.run,
                RotationInput(user_id=user_id, label=name, force=force),
                id=rotation_workflow_id(user_id, name),
                task_queue=self.settings.temporal.task_queue,
                id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                static_summary=f"Rotate {name} of {user_id}",
            )
            for name in labels
        ]
        return [
            await self._while_a_worker_polls(handle.result(), "the rotation's result")
            for handle in handles
        ]

    async def ensure_rotation_schedule(self) -> str:
        """Create the Temporal Schedule that sweeps for blocks over threshold, once.

        Idempotent and safe when workers start together: a schedule that exists with the
        configured interval, workflow and task queue is left as it is (not rewritten: its
        update time stays); one that differs (the interval was changed in
        temporal.yaml) is updated to the configuration, and that is logged. Of two workers
        creating it at once, one creates it and the other finds it.
        """
        rotation = self.settings.rotation
        action = ScheduleActionStartWorkflow(
            RotationSweepWorkflow.run,
            SweepInput(),
            id=f"{rotation.schedule_id}-run",
            task_queue=self.settings.temporal.task_queue,
        )
        spec = ScheduleSpec(
            intervals=[ScheduleIntervalSpec(every=timedelta(seconds=rotation.interval_s))]
        )
        schedule = Schedule(action=action, spec=spec)
        try:
            await self.client.create_schedule(rotation.schedule_id, schedule)
            log.info("created the rotation schedule %s", rotation.schedule_id)
            return rotation.schedule_id
        except ScheduleAlreadyRunningError:
            pass

        def update(current: ScheduleUpdateInput) -> ScheduleUpdate | None:
            # Decided on the description the update itself reads, just before writing.
            if _same_schedule(current.description.schedule, schedule):
                return None
            log.warning(
                "rotation schedule %s differs from the configuration (every %ss on %s); "
                "updating it",
                rotation.schedule_id,
                rotation.interval_s,
                self.settings.temporal.task_queue,
            )
            return ScheduleUpdate(schedule=schedule)

        await self.client.get_schedule_handle(rotation.schedule_id).update(update)
        return rotation.schedule_id


def _same_schedule(existing: Schedule, wanted: Schedule) -> bool:
    """Whether the schedule already runs the wanted sweep at the wanted interval (what the
    configuration decides; the sweep's input carries nothing the worker does not decide)."""
    have, want = existing.action, wanted.action
    return (
        isinstance(have, ScheduleActionStartWorkflow)
        and isinstance(want, ScheduleActionStartWorkflow)
        and have.workflow == want.workflow
        and have.task_queue == want.task_queue
        and have.id == want.id
        and [i.every for i in existing.spec.intervals] == [i.every for i in wanted.spec.intervals]
    )
