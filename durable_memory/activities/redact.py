"""Activities of a redaction (workflows/redact.py): the open record opened and the writers
that began before it waited for, the repository's history rewritten, the user's SQL rows and
archival passages redacted, the record closed, on request the user's ended executions whose
histories hold the text deleted, and last the redaction's own execution deleted (its input
holds the text). Each is idempotent (memory/service/redaction.py)."""

import asyncio
import logging
from collections.abc import Iterator

from google.protobuf.message import Message
from temporalio import activity
from temporalio.api.common.v1 import Payload
from temporalio.api.history.v1 import History
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from durable_memory.activities.errors import classified_errors
from durable_memory.activities.forget import (
    delete_execution,
    delete_own_execution,
    user_executions,
)
from durable_memory.bootstrap import MemoryStack
from durable_memory.memory.agent.steps import TurnPositions
from durable_memory.memory.archive.redaction import redact_passages
from durable_memory.memory.core.errors import UserBeingRedacted, WritersStillRunning
from durable_memory.memory.service.redaction import Redactions
from durable_memory.memory.store.redaction.gate import RedactionGate, TurnProgress
from durable_memory.memory.store.redaction.rows import spellings
from durable_memory.models.history import RedactInput, RedactionRecord
from durable_memory.models.turn import rotation_workflow_id, turn_workflow_id

log = logging.getLogger(__name__)


def _payloads(message: Message) -> Iterator[Payload]:
    """Every payload inside a history (inputs, results, details, headers, memos...)."""
    for field, value in message.ListFields():
        if field.message_type is None:
            continue
        if field.message_type.GetOptions().map_entry:
            items = [item for item in value.values() if isinstance(item, Message)]
        else:  # a message, or a repeated field of them
            items = [value] if isinstance(value, Message) else list(value)
        for item in items:
            if isinstance(item, Payload):
                yield item
            else:
                yield from _payloads(item)


def loop_finished(turn: TurnProgress) -> bool:
    """Whether the database shows the turn done with its agent loop, the steps that write
    what the model said: its last reply (no tool calls) stored and put in recall, or the
    step-limit note written. A turn not shown done is asked of Temporal."""
    if turn.last_seq >= TurnPositions.STEP_LIMIT_NOTE:
        return True
    reply = turn.newest_reply
    if reply is None or reply.tool_uses:
        return False
    return not reply.text or turn.last_seq >= TurnPositions.reply_seq(turn.newest_step)


GATE_REFUSAL = UserBeingRedacted.__name__
"""The failure type of a step waiting at the gate (memory/store/redaction/gate.py)."""


class RedactActivities:
    def __init__(self, stack: MemoryStack, client: Client) -> None:
        self.stack = stack
        self.client = client
        self.redactions = Redactions(stack.blocks, stack.git, stack.engine)
        self.gate = RedactionGate(stack.engine)

    @activity.defn(name="dmem.begin_redaction")
    async def begin_redaction(self, request: RedactInput) -> None:
        """Open the user's record, so new turns, decisions and rotations wait; then
        WritersStillRunning (retried) while a turn or rotation that began before it may
        still write what it read before the rewrite."""
        with classified_errors():
            user = request.user_id
            await asyncio.to_thread(
                self.gate.open, user, request.redaction_id, request.requested_by
            )
            # Approvals recorded and not committed (a decision that gave up, a process that
            # died) are committed now, before the rewrite that will redact them: else a
            # turn's first step admitted just before the record could commit one after it.
            await asyncio.to_thread(self.stack.review.finish_approvals, user)
            running = await self._writers(user)
            if running:
                raise WritersStillRunning(
                    f"the redaction of user '{user}' waits for what began before it to end: "
                    f"{'; '.join(running)}. Nothing was changed yet; if it never ends, "
                    "end it (`temporal workflow terminate`) and run the redaction again"
                )

    async def _writers(self, user_id: str) -> list[str]:
        """What of the user may still write from a state read before the redaction: turns in
        their agent loop or committing a decision, and rotations past their plan. A step
        waiting at the gate (memory/store/redaction/gate.py) writes nothing: not waited for."""
        turns = await asyncio.to_thread(self.gate.turn_progress, user_id)
        looping = {turn.turn_id for turn in turns if not loop_finished(turn)}
        deciding = await asyncio.to_thread(self.gate.deciding_turns, user_id)
        found = []
        for turn_id in sorted(looping | deciding):
            workflow_id = turn_workflow_id(user_id, turn_id)
            at_gate = await self._pending_at_gate(workflow_id)
            if at_gate is None:
                continue
            if turn_id in looping:
                found.append(f"turn {turn_id} is replying (workflow {workflow_id})")
            elif not all(at_gate):
                found.append(f"turn {turn_id} is committing a decision (workflow {workflow_id})")
        profile = await asyncio.to_thread(self.stack.blocks.profile, user_id)
        for spec in profile.blocks:
            workflow_id = rotation_workflow_id(user_id, spec.label)
            at_gate = await self._pending_at_gate(workflow_id)
            if at_gate is not None and not (at_gate and all(at_gate)):  # past its plan
                found.append(f"block {spec.label} is being rotated (workflow {workflow_id})")
        return found

    async def _pending_at_gate(self, workflow_id: str) -> list[bool] | None:
        """For each activity the execution runs or retries, whether it waits at the gate;
        None if the execution does not run (ended, deleted, never started: a turn killed for
        good blocks nothing)."""
        try:
            described = await self.client.get_workflow_handle(workflow_id).describe()
        except RPCError as error:
            if error.status == RPCStatusCode.NOT_FOUND:
                return None
            raise
        if described.status != WorkflowExecutionStatus.RUNNING:
            return None
        return [
            pending.last_failure.application_failure_info.type == GATE_REFUSAL
            for pending in described.raw_description.pending_activities
        ]

    @activity.defn(name="dmem.end_redaction")
    def end_redaction(self, user_id: str) -> None:
        """Close the user's record (idempotent): their turns, decisions and rotations go on."""
        with classified_errors():
            self.gate.close(user_id)

    @activity.defn(name="dmem.redact_repository")
    def redact_repository(self, request: RedactInput) -> RedactionRecord:
        with classified_errors():
            return self.redactions.redact_repository(request)

    @activity.defn(name="dmem.redact_rows")
    def redact_rows(self, request: RedactInput, record: RedactionRecord) -> int:
        with classified_errors():
            return self.redactions.redact_rows(request, record.commits)

    @activity.defn(name="dmem.redact_passages")
    def redact_passages(self, request: RedactInput, record: RedactionRecord) -> int:
        with classified_errors():
            return redact_passages(
                self.stack.archive, request.user_id, request.text, record.commits
            )

    @activity.defn(name="dmem.delete_executions_holding")
    async def delete_executions_holding(self, request: RedactInput) -> int:
        """Delete every ended execution of the user whose history holds the text (Temporal
        cannot edit a history); a running one cannot be deleted without ending it, so it is
        left, and logged. How many were deleted."""
        with classified_errors():
            forms = [form.encode() for form in spellings(request.text)]
            deleted = 0
            for workflow_id, run_id, running in await user_executions(self.client, request.user_id):
                handle = self.client.get_workflow_handle(workflow_id, run_id=run_id)
                try:
                    events = (await handle.fetch_history()).events
                except RPCError as error:
                    if error.status == RPCStatusCode.NOT_FOUND:  # deleted meanwhile
                        continue
                    raise
                if not await self._holds(list(_payloads(History(events=events))), forms):
                    continue
                if running:
                    log.warning(
                        "user '%s': execution %s still runs and holds the redacted text: "
                        "delete it once it has ended",
                        request.user_id,
                        workflow_id,
                    )
                    continue
                await delete_execution(self.client, workflow_id, run_id)
                deleted += 1
                activity.heartbeat(deleted)
            return deleted

    async def _holds(self, payloads: list[Payload], forms: list[bytes]) -> bool:
        """Whether any payload holds the text, read through the deployment's codec (with
        per-user encryption a history holds only ciphertext)."""
        codec = self.client.data_converter.payload_codec
        if codec is not None and payloads:
            payloads = await codec.decode(payloads)
        return any(form in payload.data for payload in payloads for form in forms)

    @activity.defn(name="dmem.delete_redact_execution")
    async def delete_redact_execution(self) -> None:
        with classified_errors():
            await delete_own_execution(self.client)
