"""What crosses the Temporal boundary for turns and rotations: ids and small values only."""

from datetime import datetime, timedelta
from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from durable_memory.config import ActivitiesSettings
from durable_memory.models.blocks import RotationStrategyName
from durable_memory.models.diffs import DiffStatus

MAX_MESSAGE_CHARS = 100_000
MAX_EDITED_MARKDOWN_CHARS = 200_000


class TurnStatus(StrEnum):
    """The DmemTurnStatus search attribute."""

    REPLYING = "replying"
    AWAITING_APPROVAL = "awaiting_approval"
    COMMITTING = "committing"
    DONE = "done"
    EXPIRED = "expired"


class TurnInput(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    user_id: str
    turn_id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    message: str = Field(min_length=1, max_length=MAX_MESSAGE_CHARS)
    max_steps: int = Field(default=8, ge=1, le=50)
    approval_ttl_s: float = Field(default=7 * 24 * 3600, gt=0)
    activities: ActivitiesSettings = ActivitiesSettings()

    @property
    def approval_ttl(self) -> timedelta:
        return timedelta(seconds=self.approval_ttl_s)


def turn_workflow_id(user_id: str, turn_id: str) -> str:
    return f"turn-{user_id}-{turn_id}"


def rotation_workflow_id(user_id: str, label: str) -> str:
    return f"rotation-{user_id}-{label}"


class PreparedTurn(BaseModel):
    model_config = ConfigDict(frozen=True)

    total_tokens: int
    share_used: float


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
    details_markdown: str
    """The proposed diffs as Markdown for the Temporal UI's current details (bounded)."""


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
    model_config = ConfigDict(frozen=True, extra="forbid")

    diff_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    user_id: str
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
    decided_at: datetime | None = None


class TurnOutcome(BaseModel):
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
    """A planned rotation, by reference: each step re-derives the plan from `base_sha`."""

    model_config = ConfigDict(frozen=True)

    user_id: str
    label: str
    base_sha: str
    strategy: RotationStrategyName
    chars_before: int
    chars_after: int


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
