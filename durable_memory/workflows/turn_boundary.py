"""What crosses the turn workflow's boundary: raw payloads decoded strictly, and the failures
a caller is answered with (their `type` names are the contract a client in any language
reads).

Every function here is deterministic; the workflow imports this module passed through its
sandbox, as it does its other non-workflow modules.
"""

from collections.abc import Callable
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from temporalio import activity
from temporalio.common import RawValue
from temporalio.exceptions import ActivityError, ApplicationError, FailureError

from durable_memory.memory.core.errors import short_message, validation_message
from durable_memory.models.diffs import DiffStatus
from durable_memory.models.turn import DecisionOutcome, DiffDecision

TURN_WORKFLOW = "TurnWorkflow"
"""The workflow type name a caller in another language starts."""

INVALID_INPUT = "InvalidInput"
TURN_FAILED = "TurnFailed"
UNKNOWN_DIFF = "UnknownDiff"
DIFF_ALREADY_DECIDED = "DiffAlreadyDecided"
DECISION_REFUSED = "DecisionRefused"
"""The decision reached its turn but was not applied (the activity failed, the approval
conflicted or could not commit); the failure's details carry the outcome, if there is one."""

M = TypeVar("M", bound=BaseModel)


def decode_input(raw: RawValue, model: type[M]) -> M:
    """Validate a raw JSON payload strictly as `model` (unknown, missing and mistyped fields
    all refused); ApplicationError(InvalidInput) naming the fields if it does not fit."""
    what = f"invalid {model.__name__}"
    if raw.payload.metadata.get("encoding") != b"json/plain":
        raise ApplicationError(
            f"{what}: expected a JSON object", type=INVALID_INPUT, non_retryable=True
        )
    try:
        return model.model_validate_json(raw.payload.data, strict=True)
    except ValidationError as error:
        message = short_message(validation_message(error, what))
        raise ApplicationError(message, type=INVALID_INPUT, non_retryable=True) from None


def step_failure(error: ActivityError) -> ApplicationError:
    """A short failure naming the step. Our activities' own failures already read
    `<activity> failed: <error type>: <message>`; a timeout or cancellation gets that form."""
    cause = error.cause
    reason = cause.message if isinstance(cause, FailureError) else error.message
    return _named(reason, error.activity_type)


def local_step_failure(error: FailureError, activity_type: str) -> ApplicationError:
    """`step_failure` for a local activity, whose failure the SDK raises bare."""
    return _named(error.message, activity_type)


def _named(reason: str, activity_type: str) -> ApplicationError:
    if not reason.startswith(activity_type):
        reason = f"{activity_type} failed: {reason}"
    return ApplicationError(short_message(reason), type=TURN_FAILED, non_retryable=True)


class LocalStepFailed(Exception):
    """A local step's final failure, as the turn reports it (`failure`) and the step's name."""

    def __init__(self, failure: ApplicationError, step: str) -> None:
        super().__init__(failure.message)
        self.failure = failure
        self.step = step


def activity_name(method: Callable[..., object]) -> str:
    """The registered name of an activity method (its `@activity.defn(name=...)`), as the
    SDK itself reads it."""
    return activity._Definition.must_from_callable(method).name or method.__name__


def already_decided(outcome: DecisionOutcome) -> ApplicationError:
    """What the loser of a decision race is told: the outcome that did apply, and by whom."""
    text = f"diff {outcome.diff_id} is already {outcome.status.value}"
    if outcome.decided_by:
        text += f" by {outcome.decided_by}"
    if outcome.commit_sha:
        text += f" (commit {outcome.commit_sha[:12]})"
    if outcome.message:
        text += f": {outcome.message}"
    return ApplicationError(
        short_message(text), outcome, type=DIFF_ALREADY_DECIDED, non_retryable=True
    )


def decision_refused(message: str, outcome: DecisionOutcome | None = None) -> ApplicationError:
    """A decision that reached its turn and was not applied; the outcome, if any, as details."""
    details = () if outcome is None else (outcome,)
    return ApplicationError(
        short_message(message), *details, type=DECISION_REFUSED, non_retryable=True
    )


def is_own_outcome(decision: DiffDecision, outcome: DecisionOutcome) -> bool:
    """Whether the activity's outcome is this decision's (applied or refused), rather than
    a decision made before it reached the store."""
    if outcome.status is DiffStatus.PENDING:
        return True
    if outcome.decided_by not in (None, decision.approver):
        return False
    if decision.decision == "approve":
        return outcome.status in (DiffStatus.APPROVED, DiffStatus.CONFLICTED)
    return outcome.status is DiffStatus.REJECTED
