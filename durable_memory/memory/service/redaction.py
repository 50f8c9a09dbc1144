"""Redacting a text from a user's memory (`dmem redact`, docs/governance.md): every version of
one block in the user's repository (store/redaction/history.py: the one history rewrite the system
makes), then every SQL row of the user (store/redaction/rows.py); the archive's passages are
the caller's (memory/archive/redaction.py, a part this one does not see).

Each step is idempotent. The repository step recognises a redaction it already made by its
`Redaction-Id` trailer on main and only finishes the purge; a distributed one that lost its
lease to another writer is run again on the new history (`compare_and_set`), so an approval
committed meanwhile is redacted too, never resurrects the text.
"""

import hashlib
from collections.abc import Callable
from datetime import UTC

from sqlalchemy import Engine

from durable_memory.memory.core.errors import FormatError, OperationNotApplicable, UnknownUser
from durable_memory.memory.core.formats import from_toml
from durable_memory.memory.service.blocks import Blocks
from durable_memory.memory.store.block_repository import compare_and_set
from durable_memory.memory.store.git import GitBlockStore, block_path, validate_author_name
from durable_memory.memory.store.git.messages import message_text
from durable_memory.memory.store.git.transaction import RepoTransaction
from durable_memory.memory.store.redaction.history import (
    REDACTED,
    REDACTION_ID,
    plan_rewrite,
    record_message,
    recorded_mapping,
    recorded_trailers,
    rewrite_history,
    versions_holding,
)
from durable_memory.memory.store.redaction.rows import redact_user_rows
from durable_memory.models.history import Author, AuthorKind, RedactInput, RedactionRecord


def redaction_id(user_id: str, label: str, text: str) -> str:
    """The id of redacting `text` from a block: the same for a request made again (a retry
    after a kill finds its record and finishes), derived from the text by a one-way hash."""
    key = "\0".join(("dmem-redaction", user_id, label, text)).encode("utf-8")
    return hashlib.sha256(key).hexdigest()[:32]


class Redactions:
    def __init__(self, blocks: Blocks, git: GitBlockStore, engine: Engine) -> None:
        self.blocks = blocks
        self.git = git
        self.engine = engine

    def _check(self, request: RedactInput) -> Callable[[str, str], None]:
        """Refuse a request that can never be made; else, the check of a redacted version
        (it must still be a valid block)."""
        validate_author_name(request.requested_by)
        if request.text in REDACTED:
            raise OperationNotApplicable(
                f"the text {request.text!r} is part of the marker {REDACTED!r} that replaces a "
                "redacted text: it cannot be redacted"
            )
        spec = self.blocks.spec(request.user_id, request.label)  # UnknownBlock, UnknownUser
        where = f"users/{request.user_id}/{block_path(request.label)}"

        def check(sha: str, text: str) -> None:
            try:
                from_toml(spec, text, f"{where} at {sha[:12]}", enforce_limit=False)
            except FormatError as error:
                raise OperationNotApplicable(
                    f"removing the text would leave a version of block '{request.label}' "
                    f"invalid ({error}): nothing was changed; redact a whole value instead"
                ) from None

        return check

    @staticmethod
    def _done(tx: RepoTransaction, request: RedactInput) -> str | None:
        """The record of this redaction on main, if it is made and no version has held the
        text since (a turn that committed it again after: then it is to be made again)."""
        done = tx.find_trailer(REDACTION_ID, request.redaction_id)
        if done is None:
            return None
        holding = versions_holding(tx.repo, tx.lock, label=request.label, text=request.text)
        return done if holding == 0 else None

    def preflight(self, request: RedactInput) -> None:
        """What `redact_repository` would refuse, found without writing anything: before a
        redaction is started, so a refused text never reaches a workflow's history."""
        check = self._check(request)
        with self.git.transaction(request.user_id) as tx:
            if tx.head is None:
                raise UnknownUser(f"user '{request.user_id}' has no memory yet")
            if not self._done(tx, request):
                plan_rewrite(
                    tx.repo, tx.lock, tx.head, label=request.label, text=request.text, check=check
                )

    @compare_and_set
    def redact_repository(self, request: RedactInput) -> RedactionRecord:
        """Rewrite the block's history without the text and move main over it (or find that
        done already); OperationNotApplicable, with nothing changed, when it cannot be done."""
        check = self._check(request)

        def record(commits: dict[str, str], versions: int) -> tuple[str, Author]:
            reason = f"{request.reason}\n\n{versions} version(s) of the block held the text."
            message = record_message(
                request.redaction_id,
                request.label,
                request.text,
                request.requested_by,
                reason,
                commits,
            )
            return message, Author(name=request.requested_by, kind=AuthorKind.APPROVER)

        with self.git.transaction(request.user_id) as tx:
            if tx.head is None:
                raise UnknownUser(f"user '{request.user_id}' has no memory yet")
            done = self._done(tx, request)
            if done is None:
                rewritten = rewrite_history(
                    tx.repo,
                    tx.lock,
                    tx.head,
                    label=request.label,
                    text=request.text,
                    check=check,
                    record=record,
                )
                self.git.replace_history(tx, rewritten.old_head, rewritten.record)
                done = rewritten.record
            else:
                self.git.purge_history(tx)  # what a kill after the move left to do
            return _record(tx, done)

    def recorded(self, user_id: str, redaction_id: str) -> RedactionRecord | None:
        """The record of a redaction made, found on main by its id."""
        with self.git.transaction(user_id) as tx:
            sha = tx.find_trailer(REDACTION_ID, redaction_id)
            return None if sha is None else _record(tx, sha)

    def redact_rows(self, request: RedactInput, commits: dict[str, str]) -> int:
        """Replace the text and the rewritten commit ids in every SQL row of the user."""
        return redact_user_rows(self.engine, request.user_id, request.text, commits)


def _record(tx: RepoTransaction, sha: str) -> RedactionRecord:
    trailers = recorded_trailers(tx.repo, sha)
    commit = tx.repo.commit(sha)
    commits = recorded_mapping(tx.repo, sha)
    return RedactionRecord(
        redaction_id=trailers[REDACTION_ID],
        label=trailers["Redacted-Block"],
        text_sha256=trailers["Redacted-Text-Hash"].removeprefix("sha256:"),
        requested_by=trailers["Redacted-By"],
        reason=message_text(commit).partition("\n\n")[2].split("\n\n")[0],
        record_commit=sha,
        old_head=next(reversed(commits)) if commits else sha,
        commits=commits,
        redacted_at=commit.authored_datetime.astimezone(UTC),
    )
