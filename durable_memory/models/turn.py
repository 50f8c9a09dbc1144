"""What crosses the Temporal boundary for turns and rotations: ids and small values only."""

from datetime import datetime, timedelta
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from durable_memory.models.activity_settings import ActivitiesSettings
from durable_memory.models.blocks import RotationStrategyName
from durable_memory.models.diffs import DiffStatus
from durable_memory.models.ids import USER_ID

MAX_MESSAGE_CHARS = 100_000
MAX_EDITED_MARKDOWN_CHARS = 200_000


class TurnStatus(StrEnum):
    """The DmemTurnStatus search attribute."""

    REPLYING = "replying"
    AWAITING_APPROVAL = "awaiting_approval"
    COMMITTING = "committing"
    DONE = "done"
    EXPIRED = "expired"
    FAILED = "failed"
    """A step failed for good (or the input was invalid): the workflow failed, naming it."""


UserId = Annotated[str, AfterValidator(USER_ID.check)]
"""A user id, refused with `validate_user_id`'s message wherever a model carries one (pydantic
reports the rule's ValueError as the field's problem)."""


class TurnInput(BaseModel):
    """A turn's input. Validated strictly by the workflow itself (see workflows/turn.py), so a
    caller in any language gets a refusal naming the field, not a workflow task retried."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    user_id: UserId
    turn_id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    message: str = Field(min_length=1, max_length=MAX_MESSAGE_CHARS)
    max_steps: int = Field(default=8, ge=1, le=50)
    approval_ttl_s: float = Field(default=7 * 24 * 3600, gt=0)
    activities: ActivitiesSettings = ActivitiesSettings()
    profile: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
    """The user's profile, for their first turn (None: the deployment's default); a later turn
    naming another is refused, as changing it is an explicit operation (`dmem profile set`)."""

    @property
    def approval_ttl(self) -> timedelta:
        return timedelta(seconds=self.approval_ttl_s)


ID_SEPARATOR = ":"
"""Joins a user id and a caller-chosen id in a workflow id. Neither a user id
(`[A-Za-z0-9_-]`) nor a turn id (`[A-Za-z0-9_.-]`) may contain it, so each workflow id names
exactly one (user, turn): with '-', user `a-b` turn `c` and user `a` turn `b-c` shared one."""


def turn_workflow_id(user_id: str, turn_id: str) -> str:
    return f"turn{ID_SEPARATOR}{user_id}{ID_SEPARATOR}{turn_id}"


def legacy_turn_workflow_id(user_id: str, turn_id: str) -> str:
    """The id turns had before ids were made unambiguous (`turn-<user>-<turn>`): turns started
    then and still awaiting decisions keep it. Only the client's fallback uses it; the turn's
    workflow checks the user of every decision, so reaching another user's turn this way
    decides nothing."""
    return f"turn-{user_id}-{turn_id}"


def rotation_workflow_id(user_id: str, label: str) -> str:
    """Unambiguous with '-': a label (`[a-z][a-z0-9_]`) has no '-', so the last '-' ends the
    user id. Kept as it is because running rotations and recorded histories carry it."""
    return f"rotation-{user_id}-{label}"


class PreparedTurn(BaseModel):
    model_config = ConfigDict(frozen=True)

    total_tokens: int
    share_used: float
    profile: str | None = None
    """The agent profile the turn runs with (the DmemProfile search attribute); None in a
    result recorded before turns reported it."""


class StepInput(BaseModel):
    model_config = ConfigDict(frozen=True)

    user_id: str
    turn_id: str
    step: int = Field(ge=1)


class ModelStepResult(BaseModel):
    model_config = ConfigDict(frozen=True)

    text: str
    tool_calls: int
    stop_reason: str | None


class SupersededDiff(BaseModel):
    model_config = ConfigDict(frozen=True)

    diff_id: str
    turn_id: str | None
    """The turn that proposed it (None if it was not proposed by a turn)."""


class ToolStepResult(BaseModel):
    model_config = ConfigDict(frozen=True)

    diff_ids: list[str]
    superseded: list[SupersededDiff]


class ProposedDiff(BaseModel):
    model_config = ConfigDict(frozen=True)

    id: str
    label: str
    summary: str
    status: DiffStatus


class DiffPreview(BaseModel):
    """What a person reviewing a proposed diff reads besides its summary: the agent's
    reasoning and the unified diff against the block as it was when the turn finished (both
    bounded by the activity that makes them)."""

    model_config = ConfigDict(frozen=True)

    diff_id: str
    reasoning: str
    unified_diff: str


class FinishInput(BaseModel):
    model_config = ConfigDict(frozen=True)

    user_id: str
    turn_id: str
    diff_ids: list[str]
    stopped_at_step_limit: bool
    max_steps: int


class FinishedTurn(BaseModel):
    model_config = ConfigDict(frozen=True)

    diffs: list[ProposedDiff]
    previews: list[DiffPreview] = []
    """One per pending diff: the turn's current details and its `diff` query are rendered
    from these and the diffs' live outcomes (empty in a result recorded before)."""


class TurnReply(BaseModel):
    """What `send_message` returns: the reply, at once, and the diffs awaiting a decision."""

    model_config = ConfigDict(frozen=True)

    user_id: str
    turn_id: str
    workflow_id: str
    reply: str
    diffs: list[ProposedDiff]
    stopped_at_step_limit: bool


class DiffDecision(BaseModel):
    """A human decision, validated strictly by the workflow like TurnInput."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    diff_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    user_id: UserId
    decision: Literal["approve", "reject"]
    approver: str = Field(min_length=1, max_length=100)
    reason: str | None = Field(default=None, max_length=2000)
    edited_markdown: str | None = Field(default=None, max_length=MAX_EDITED_MARKDOWN_CHARS)


class DecisionOutcome(BaseModel):
    """What became of a diff: its status, the commit (if approved) and who decided it when.
    A caller whose decision lost a race is told this outcome, never its own as if it won."""

    model_config = ConfigDict(frozen=True)

    diff_id: str
    status: DiffStatus
    commit_sha: str | None = None
    message: str = ""
    label: str | None = None
    decided_by: str | None = None
    """Who decided it: the approver of an approval or a rejection (also of one that
    conflicted); None for an expired or superseded diff."""
    decided_at: datetime | None = None
    decision: Literal["approve", "reject"] | None = None
    """The human decision that settled it (an approval that conflicted: "approve"); None
    while pending, and for an expired or superseded diff, which no person decided."""


DECISION_OF_STATUS: dict[DiffStatus, Literal["approve", "reject"]] = {
    DiffStatus.APPROVED: "approve",
    DiffStatus.CONFLICTED: "approve",
    DiffStatus.REJECTED: "reject",
}
"""The decision each decided status records (`DecisionOutcome.decision`)."""


class DiffView(BaseModel):
    """What the turn's `diff` query answers for one of its diffs: where it belongs, what
    became of it, and its preview as the Temporal UI shows it."""

    model_config = ConfigDict(frozen=True)

    diff_id: str
    user_id: str
    turn_id: str
    workflow_id: str
    label: str
    summary: str
    status: DiffStatus
    outcome: DecisionOutcome | None
    """Set once the diff is no longer pending."""
    preview_markdown: str


class RejectedSignals(BaseModel):
    """Decision signals a turn refused (bad payload, unknown or already-decided diff): a
    signal has no caller to answer, so the count and the latest reasons are kept here."""

    model_config = ConfigDict(frozen=True)

    count: int = 0
    recent: list[str] = []


class TurnOutcome(BaseModel):
    """A turn's result. Each of `decisions` names the diff's status, the decision and who
    made it (`decision`, `decided_by`, `decided_at`) and, for an approval, its commit."""

    model_config = ConfigDict(frozen=True)

    turn_id: str
    reply: str
    decisions: list[DecisionOutcome]
    status: TurnStatus


class RotationInput(BaseModel):
    model_config = ConfigDict(frozen=True)

    user_id: str
    label: str
    force: bool = False
    activities: ActivitiesSettings = ActivitiesSettings()


class RotationTicket(BaseModel):
    """A planned rotation, by reference: each step re-derives the plan from `base_sha` and
    `planned_at`, so a retry, whenever it runs, archives and commits what the first attempt
    did and finds the commit that attempt made."""

    model_config = ConfigDict(frozen=True)

    user_id: str
    label: str
    base_sha: str
    strategy: RotationStrategyName
    chars_before: int
    chars_after: int
    planned_at: datetime | None = None
    """When the plan was made: its archive header, and the bound of the walk that finds its
    commit. None only in a ticket recorded before tickets carried it: its steps take their
    own clock's time, as they did then."""


class RotationCommit(BaseModel):
    model_config = ConfigDict(frozen=True)

    ticket: RotationTicket
    passage_ids: list[str]


class RotationOutcome(BaseModel):
    model_config = ConfigDict(frozen=True)

    user_id: str
    label: str
    rotated: bool
    passage_ids: list[str] = []
    commit_sha: str | None = None


class SweepInput(BaseModel):
    model_config = ConfigDict(frozen=True)

    activities: ActivitiesSettings = ActivitiesSettings()


class RotationCandidate(BaseModel):
    model_config = ConfigDict(frozen=True)

    user_id: str
    label: str
