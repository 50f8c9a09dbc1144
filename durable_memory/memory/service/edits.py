"""DirectEdits: changes committed at once, by the person whose memory it is or by a backend
service calling a domain operation of the seed 000_d8598551964ab573.txt, and a change of the
user's profile. The model never comes here: its edits are proposals (review.py)."""

from collections.abc import Mapping

from durable_memory.memory.core.errors import DurableMemoryError, ProfileError
from durable_memory.memory.core.formats import from_markdown, from_toml
from durable_memory.memory.core.operations import describe
from durable_memory.memory.core.profiles import profile_record
from durable_memory.memory.service.access import BlockAccess, missing_blocks
from durable_memory.memory.store.block_repository import compare_and_set
from durable_memory.memory.store.git import format_message, validate_author_name
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
        self,
        user_id: str,
        label: str,
        fields: Mapping[str, object],
        author: Author,
        based_on: str | None = None,
    ) -> str:
        """A person's own edit of the whole block: validated, then committed directly; with
        `based_on` (the commit they opened the block at), refused with BlockChanged if the
        block changed since."""
        return self._access.commit_fields(
            user_id, label, fields, author, f"Edit {label}", based_on=based_on
        )

    def edit_markdown(
        self,
        user_id: str,
        label: str,
        markdown: str,
        author: Author,
        based_on: str | None = None,
    ) -> str:
        """The `dmem edit` path: the Markdown form, parsed and validated, committed directly."""
        fields = from_markdown(self._access.spec(user_id, label), markdown)
        return self.edit_block(user_id, label, fields, author, based_on)

    def apply_direct(
        self, user_id: str, label: str, op: EditOperation, author: Author, reason: str = ""
    ) -> str:
        """A backend service's domain operation: applied to HEAD and committed at once."""
        seen = self._access.users.refuse_if_forgotten(user_id)
        spec = self._access.spec(user_id, label)
        if isinstance(op, ClearTask) and op.archive:
            self._access.archive_task(user_id, spec, since=seen)
        trailers = {"Reason": reason} if reason else None
        return self._access.commit_fields(
            user_id, label, op, author, describe(op, label), trailers, since=seen
        )

    @compare_and_set
    def set_profile(self, user_id: str, name: str, author: Author) -> str:
        """Change the user's profile to `name`, committed with `author`: only if every block
        the user has fits it (a block of that profile, valid under its schema and limit);
        otherwise one ProfileError says which do not, and nothing changes. Blocks the new
        profile has and the user lacks start at their defaults. A record that names no known
        profile, or is not a record at all, is replaced: this is how it is repaired. Returns
        HEAD after."""
        profile = self._access.profiles.get(name)
        validate_author_name(author.name)
        with self._access.git.transaction(user_id) as tx:
            try:
                recorded = self._access.recorded_profile(tx)
            except ProfileError:  # a record that is not one: this change replaces it
                recorded = None
            if recorded == name:
                return tx.head or ""
            unfit = []
            for label in tx.labels():
                spec = profile.block(label)
                if spec is None:
                    unfit.append(f"block '{label}' is not in it")
                    continue
                try:
                    from_toml(spec, tx.read(label) or "", f"block '{label}'")
                except DurableMemoryError as error:
                    unfit.append(str(error))
            if unfit:
                raise ProfileError(
                    f"user '{user_id}' cannot change to profile '{name}' (its blocks are "
                    f"{', '.join(b.label for b in profile.blocks)}): {'; '.join(unfit)}; "
                    "nothing was changed"
                )
            missing = missing_blocks(tx, profile)
            message = format_message(f"Set profile {name}", trailers={"Profile": name})
            return tx.commit(missing, message, author, profile=profile_record(name))

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
