"""Every error a caller can cause. One clear message each; the CLI maps them to exit status 2."""

from typing import ClassVar

from pydantic import ValidationError

from durable_memory.models.diffs import PendingDiff


class DurableMemoryError(Exception):
    """Base of every user-facing error raised by the memory core.

    `retryable` says whether trying the same thing again may succeed without anyone changing
    anything (a lock held by a live writer, say). Most domain errors are about the input and
    stay False: a retry would only fail the same way. It is the one source of truth: the
    activities' failures and the workflows' retry policies are derived from it
    (activities/errors.py).
    """

    retryable: bool = False
    retryable_per_instance: ClassVar[bool] = False
    """True for a class whose instances each set `retryable` (a failed model call: a 429 is
    retryable, a 400 is not), so that the class as a whole is neither."""


class InvalidIdentifier(DurableMemoryError):
    """A user id, label or diff id that does not match the strict pattern."""


class ProfileError(DurableMemoryError):
    """An agent profile file that cannot be loaded."""


class BlockValidationError(DurableMemoryError):
    """A block value that violates its schema; `field` names the field at fault, if one is."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class CharLimitExceeded(BlockValidationError):
    """A block value whose rendering is larger than the block's char limit."""

    def __init__(self, label: str, size: int, limit: int) -> None:
        super().__init__(f"block '{label}' would be {size} characters, over its limit of {limit}")
        self.label = label
        self.size = size
        self.limit = limit


class FormatError(DurableMemoryError):
    """A TOML or Markdown document that does not parse into a block."""


class UnknownUser(DurableMemoryError):
    """A user who has no memory repository yet."""


class UnknownBlock(DurableMemoryError):
    """A label that is not declared by the agent profile."""


class ReadOnlyBlock(DurableMemoryError):
    """An edit aimed at a block the profile marks read-only."""


class OperationNotApplicable(DurableMemoryError):
    """An edit operation that cannot be applied to the block as it is."""


class UnknownDiff(DurableMemoryError):
    """A diff id that does not exist (or belongs to another user)."""


class DiffAlreadyDecided(DurableMemoryError):
    """A decision on a diff that is no longer pending. `diff` is the diff as it really is
    (who decided it, when, and its commit), so a loser of a race is told the truth."""

    def __init__(self, message: str, diff: PendingDiff | None = None) -> None:
        super().__init__(message)
        self.diff = diff

    @classmethod
    def about(cls, diff: PendingDiff) -> "DiffAlreadyDecided":
        who = f" by {diff.decided_by}" if diff.decided_by else ""
        return cls(f"diff {diff.id} is already {diff.status.value}{who}; decisions are final", diff)


class DecisionRefused(DurableMemoryError):
    """A decision that reached its turn but could not be applied (the diff stays pending)."""


class UnknownCommit(DurableMemoryError):
    """A sha that does not name a commit of the user's repository touching the block."""


class BlockChanged(DurableMemoryError):
    """A person's whole-block edit made on a version of the block that is no longer the
    current one (an approval or another edit landed while they edited): applying it would
    silently undo that change, so nothing is committed."""


class HandEditPending(DurableMemoryError):
    """A block file changed by hand in the working tree that a write would overwrite."""


class UnsafeFile(DurableMemoryError):
    """A file under a data or import dir that is not a plain regular file of valid UTF-8 (a
    symlink, a FIFO, a device, a submodule...) or that is not a block file: never read."""


class DamagedRepository(DurableMemoryError):
    """A user's repository whose history cannot be read, even after the automatic repair."""


class GitRemoteUnavailable(DurableMemoryError):
    """The git remote (memory.git_remote) cannot be reached or refused us for a reason a
    later attempt may not meet (connection refused, a time-out, a 5xx): retried with backoff;
    a turn shows "waiting for git remote" meanwhile. Nothing was pushed."""

    retryable = True


class GitRemoteContended(DurableMemoryError):
    """Every push of a bounded number of attempts was refused as a non-fast-forward: other
    writers kept moving the user's branch. Nothing of ours is on the remote; retried."""

    retryable = True


class GitRemoteRefused(DurableMemoryError):
    """The git remote refused us for good: a wrong token (401/403), a repository that is not
    one, a push its pre-receive hook refuses. Not retried: a person must fix it."""


class UserBeingForgotten(DurableMemoryError):
    """The user's erasure has begun and not completed: no turn or change is accepted for them
    until it does (`dmem forget` finishes it)."""


class UserForgotten(DurableMemoryError):
    """The user was forgotten: nothing is written for them again (a late step of a turn
    begun before the forget, a retried request) unless a caller starts them afresh on
    purpose (`send_message(..., fresh_user=True)`, `dmem chat --fresh-user`).

    `started_afresh`: the user was started afresh since the turn that asks began, so they
    have a new memory, which that turn must neither write into nor empty."""

    def __init__(self, message: str, *, started_afresh: bool = False) -> None:
        super().__init__(message)
        self.started_afresh = started_afresh


class UserBeingRedacted(DurableMemoryError):
    """A redaction of the user is under way: their new turns, decisions and rotations wait
    for it (retried), so none stores the redacted text again (docs/governance.md)."""

    retryable = True


class WritersStillRunning(DurableMemoryError):
    """A redaction waits for the user's turns and rotations that began before it to finish
    writing (retried); once its retries run out the redaction gives up, changing nothing."""

    retryable = True


class StoreBusy(DurableMemoryError):
    """A store could not finish a step yet because another party held it (a SQLite reader
    kept the WAL from being emptied; Temporal's visibility still lists what was deleted):
    retried."""

    retryable = True


def validation_message(error: ValidationError, what: str) -> str:
    """One line for a pydantic ValidationError: `<what>: field: problem; field: problem`."""
    problems = []
    for item in error.errors()[:5]:
        where = ".".join(str(p) for p in item["loc"]) or "value"
        problems.append(f"{where}: {item['msg']}")
    return f"{what}: " + "; ".join(problems)


FAILURE_MESSAGE_BYTES = 1000
"""Failure messages stay under 1 KiB, so an operator never sees only "exceeds size limit"."""


def short_message(text: str, limit: int = FAILURE_MESSAGE_BYTES) -> str:
    """`text` cut to at most `limit` UTF-8 bytes, on a character boundary, marked if cut."""
    data = text.encode("utf-8")
    if len(data) <= limit:
        return text
    marker = " [truncated]"
    return data[: limit - len(marker)].decode("utf-8", errors="ignore") + marker
