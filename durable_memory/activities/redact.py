"""Activities of a redaction (workflows/redact.py): the repository's history rewritten, the
user's SQL rows and archival passages redacted, on request the user's ended executions
whose histories hold the text deleted, and last the redaction's own execution deleted (its
input holds the text). Each is idempotent (memory/service/redaction.py)."""

import logging
from collections.abc import Iterator

from google.protobuf.message import Message
from temporalio import activity
from temporalio.api.common.v1 import Payload
from temporalio.api.history.v1 import History
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from durable_memory.activities.errors import classified_errors
from durable_memory.activities.forget import (
    delete_execution,
    delete_own_execution,
    user_executions,
)
from durable_memory.bootstrap import MemoryStack
from durable_memory.memory.archive.redaction import redact_passages
from durable_memory.memory.service.redaction import Redactions
from durable_memory.memory.store.redaction.rows import spellings
from durable_memory.models.history import RedactInput, RedactionRecord

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


class RedactActivities:
    def __init__(self, stack: MemoryStack, client: Client) -> None:
        self.stack = stack
        self.client = client
        self.redactions = Redactions(stack.blocks, stack.git, stack.engine)

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
