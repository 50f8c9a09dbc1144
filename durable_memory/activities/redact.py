"""Activities of a redaction (workflows/redact.py): the repository's history rewritten, the
user's SQL rows and archival passages redacted, and last the redaction's own execution
deleted (its input holds the text). Each is idempotent (memory/service/redaction.py)."""

from temporalio import activity
from temporalio.client import Client

from durable_memory.activities.errors import classified_errors
from durable_memory.activities.forget import delete_own_execution
from durable_memory.bootstrap import MemoryStack
from durable_memory.memory.archive.redaction import redact_passages
from durable_memory.memory.service.redaction import Redactions
from durable_memory.models.history import RedactInput, RedactionRecord


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

    @activity.defn(name="dmem.delete_redact_execution")
    async def delete_redact_execution(self) -> None:
        with classified_errors():
            await delete_own_execution(self.client)
