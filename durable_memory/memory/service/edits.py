"""DirectEdits: changes committed at once, by the person whose memory it is or by a backend
service calling a domain operation of the seed 000_d8598551964ab573.txt. The model never
comes here: its edits are proposals (review.py)."""

from collections.abc import Mapping

from durable_memory.memory.core.formats import from_markdown
from durable_memory.memory.core.operations import describe
from durable_memory.memory.service.access import BlockAccess
from durable_memory.models.history import Author
from durable_memory.models.operations import (
    AddContext,
    ClearTask,
    EditOperation,
    LearnFact,
    LearnPreference,
    SetTask,
)


class DirectEdits:
    def __init__(self, access: BlockAccess) -> None:
        self._access = access

    def edit_block(
        self, user_id: str, label: str, fields: Mapping[str, object], author: Author
    ) -> str:
        """A person's own edit of the whole block: validated, then committed directly."""
        return self._access.commit_fields(user_id, label, fields, author, f"Edit {label}")

    def edit_markdown(self, user_id: str, label: str, markdown: str, author: Author) -> str:
        """The `dmem edit` path: the Markdown form, parsed and validated, committed directly."""
        fields = from_markdown(self._access.spec(label), markdown)
        return self.edit_block(user_id, label, fields, author)

    def apply_direct(
        self, user_id: str, label: str, op: EditOperation, author: Author, reason: str = ""
    ) -> str:
        """A backend service's domain operation: applied to HEAD and committed at once."""
        spec = self._access.spec(label)
        if isinstance(op, ClearTask) and op.archive:
            self._access.archive_task(user_id, spec)
        trailers = {"Reason": reason} if reason else None
        return self._access.commit_fields(user_id, label, op, author, describe(op, label), trailers)

    # The high-level operations of the seed 000_d8598551964ab573.txt, called by a backend service
    # (committed directly).

    def set_task(
        self,
        user_id: str,
        task: str,
        author: Author,
        context: str | None = None,
        label: str = "human",
    ) -> str:
        return self.apply_direct(user_id, label, SetTask(task=task, context=context), author)

    def clear_task(
        self, user_id: str, author: Author, archive: bool = False, label: str = "human"
    ) -> str:
        return self.apply_direct(user_id, label, ClearTask(archive=archive), author)

    def learn_preference(
        self, user_id: str, preference: str, author: Author, label: str = "human"
    ) -> str:
        return self.apply_direct(user_id, label, LearnPreference(preference=preference), author)

    def learn_fact(self, user_id: str, fact: str, author: Author, label: str = "human") -> str:
        return self.apply_direct(user_id, label, LearnFact(fact=fact), author)

    def add_context(self, user_id: str, note: str, author: Author, label: str = "human") -> str:
        return self.apply_direct(user_id, label, AddContext(note=note), author)
