"""What crosses the Temporal boundary for turns, rotations and forgets: ids and small values only.

One module though over 300 lines: these payloads are one contract, the one a caller in any
language codes against (its JSON Schemas are generated from here), and read together: a
turn's input and the worker's settings it runs with, the decisions sent to it, and what it
answers.
"""

from datetime import datetime, timedelta
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, WithJsonSchema

from durable_memory.models.activity_settings import ActivitiesSettings
from durable_memory.models.blocks import RotationStrategyName
from durable_memory.models.diffs import DiffStatus, PendingDiff
from durable_memory.models.ids import USER_ID
from durable_memory.models.llm import CostFactors, TokenUsage

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


UserId = Annotated[
    str,
    AfterValidator(USER_ID.check),
    WithJsonSchema(
        {"type": "string", "pattern": f"^{USER_ID.pattern.pattern}$", "description": USER_ID.rule}
    ),
]
"""A user id, refused with `validate_user_id`'s message wherever a model carries one (pydantic
reports the rule's ValueError as the field's problem); the published JSON Schemas carry the
rule as a pattern (the schema only: validation stays the rule's own check and message)."""


MAX_STEPS_LIMIT = 50
"""No deployment lets a turn take more model steps than this (`memory.max_steps`)."""
LEGACY_MAX_STEPS = 8
LEGACY_APPROVAL_TTL_S = 7 * 24 * 3600
"""What a turn started before the worker's settings applied (patch `worker-turn-settings`)
used when its input omitted `max_steps` / `approval_ttl_s`: replaying it must use the same."""
DEFAULT_GIT_REMOTE_WAIT_S = 24 * 3600
"""How long a decision waits out a git remote outage by default (`turn.git_remote_wait_s`)."""


class WorkerTurnSettings(BaseModel):
    """The deployment's settings for a turn, read by the worker from its configuration
    (temporal.yaml / environment: `memory.max_steps`, `turn.approval_ttl_s`, `activities`).
    A turn takes them from the worker in its first step (the `dmem.turn_settings` local
    activity, recorded in its history), so a caller never has to know or send them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_steps: int = Field(ge=1, le=MAX_STEPS_LIMIT, description="Model calls per turn at most.")
    approval_ttl_s: float = Field(gt=0, description="Undecided diffs expire after this long.")
    activities: ActivitiesSettings = Field(
        description="Timeouts and retry policies of the turn's activities."
    )
    git_remote_wait_s: float = Field(
        default=DEFAULT_GIT_REMOTE_WAIT_S,
        gt=0,
        description="A decision whose commit cannot reach the git remote (unavailable, "
        "contended) is tried again with backoff for this long, then answered as not applied. "
        "Optional: settings recorded before it existed get the default.",
    )
    cost_factors: CostFactors = Field(
        default=CostFactors(),
        description="Input tokens priced relative to an uncached one, for the turn's cost.",
    )

    @property
    def approval_ttl(self) -> timedelta:
        return timedelta(seconds=self.approval_ttl_s)

    @property
    def git_remote_wait(self) -> timedelta:
        return timedelta(seconds=self.git_remote_wait_s)


class TurnInput(BaseModel):
    """A turn's input: only what the caller decides. The step limit, the approval TTL and the
    activities' timeouts and retries are the deployment's (`WorkerTurnSettings`); a caller may
    ask for fewer steps or a shorter approval wait, never for more than the deployment allows.

    Validated strictly by the workflow itself (see workflows/turn.py), so a caller in any
    language gets a refusal naming the field, not a workflow task retried."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    user_id: UserId = Field(description="Whose memory the turn reads and proposes edits to.")
    turn_id: str = Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$",
        description="The caller's id for the turn; the workflow id is `turn:<user_id>:<turn_id>`.",
    )
    message: str = Field(
        min_length=1, max_length=MAX_MESSAGE_CHARS, description="The user's message."
    )
    max_steps: int | None = Field(
        default=None,
        ge=1,
        le=MAX_STEPS_LIMIT,
        description="Optional: at most this many model calls for this turn. The worker's "
        "`memory.max_steps` caps it; omitted, the worker's applies.",
    )
    approval_ttl_s: float | None = Field(
        default=None,
        gt=0,
        description="Optional: expire this turn's undecided diffs sooner (seconds). The "
        "worker's `turn.approval_ttl_s` caps it; omitted, the worker's applies.",
    )
    activities: ActivitiesSettings | None = Field(
        default=None,
        description="Deprecated and ignored: the worker's `activities` settings apply. "
        "Accepted so that the input of turns started before (and of older clients) decodes.",
        json_schema_extra={"deprecated": True},
    )
    fresh_user: bool | None = Field(
        default=None,
        description="Optional: true starts a user who was forgotten (`dmem forget`) afresh, "
        "with an empty memory; without it, a turn of a forgotten user is refused "
        "(UserForgotten). Ignored for a user who was never forgotten.",
    )
    profile: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$",
        description="Optional: the user's profile, for their first turn (omitted: the "
        "deployment's default). A later turn naming another is refused: changing it is an "
        "explicit operation (`dmem profile set`).",
    )

    def settings_under(self, worker: WorkerTurnSettings) -> WorkerTurnSettings:
        """The settings this turn runs with: the worker's, lowered where the caller asked."""
        return worker.model_copy(
            update={
                "max_steps": min(worker.max_steps, self.max_steps or worker.max_steps),
                "approval_ttl_s": min(
                    worker.approval_ttl_s, self.approval_ttl_s or worker.approval_ttl_s
                ),
            }
        )

    def legacy_settings(self) -> WorkerTurnSettings:
        """The settings of a turn started before the worker's applied: its input's own, or the
        defaults the input had then (replaying such a turn must issue the same commands)."""
        return WorkerTurnSettings(
            max_steps=self.max_steps or LEGACY_MAX_STEPS,
            approval_ttl_s=self.approval_ttl_s or LEGACY_APPROVAL_TTL_S,
            activities=self.activities or ActivitiesSettings(),
        )


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
    erasures_seen: int | None = None
    """The newest erasure record of the user when the turn was admitted (its first check):
    a later step is refused if a forget began after it, even once the user was started
    afresh (store/erasure.py). None in a result or input recorded before turns carried it:
    each step then compares from its own first check."""


class StartedTurn(BaseModel):
    """What a turn's first activity (`dmem.start_turn`: prepare and the first model call)
    returns: the deployment's settings the turn then runs with, as `dmem.turn_settings`
    gives them, the prepared turn, and the first model step."""

    model_config = ConfigDict(frozen=True)

    settings: WorkerTurnSettings
    prepared: PreparedTurn
    first: "ModelStepResult"


class StepInput(BaseModel):
    model_config = ConfigDict(frozen=True)

    user_id: str
    turn_id: str
    step: int = Field(ge=1)
    erasures_seen: int | None = None
    """The newest erasure record of the user when the turn was admitted (its first check):
    a later step is refused if a forget began after it, even once the user was started
    afresh (store/erasure.py). None in a result or input recorded before turns carried it:
    each step then compares from its own first check."""


class ModelStepResult(BaseModel):
    model_config = ConfigDict(frozen=True)

    text: str
    tool_calls: int
    stop_reason: str | None
    usage: TokenUsage = TokenUsage()
    """The model call's tokens, cache writes and reads included (zero in a result recorded
    before steps reported them)."""


class SupersededDiff(BaseModel):
    model_config = ConfigDict(frozen=True)

    diff_id: str
    turn_id: str | None
    """The turn that proposed it (None if it was not proposed by a turn)."""


class ToolStepResult(BaseModel):
    model_config = ConfigDict(frozen=True)

    diff_ids: list[str]
    superseded: list[SupersededDiff]


class ToolsThenModel(BaseModel):
    """What `dmem.tools_then_model` returns: a step's tool calls run, then the next model
    step (patch `tools-in-model-step`)."""

    model_config = ConfigDict(frozen=True)

    tools: ToolStepResult
    next: ModelStepResult


class ProposedDiff(BaseModel):
    model_config = ConfigDict(frozen=True)

    id: str
    label: str
    summary: str
    status: DiffStatus
    outcome: "DecisionOutcome | None" = None
    """What settled it as it was proposed (a standing approval's commit), None otherwise."""


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
    erasures_seen: int | None = None
    """The newest erasure record of the user when the turn was admitted (its first check):
    a later step is refused if a forget began after it, even once the user was started
    afresh (store/erasure.py). None in a result or input recorded before turns carried it:
    each step then compares from its own first check."""


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
    usage: TokenUsage = TokenUsage()
    """The turn's model calls: input, cache writes and reads, output (summed)."""
    input_equivalents: float = 0.0
    """What the turn's input cost, in uncached input tokens (the deployment's cost factors)."""


class DecisionPayload(BaseModel):
    """What every decision carries, however it is sent. Validated strictly by the workflow
    like TurnInput."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    diff_id: str = Field(
        pattern=r"^[0-9a-f]{32}$", description="The diff decided: an id from the reply's `diffs`."
    )
    approver: str = Field(
        min_length=1, max_length=100, description="Who decides; the commit records them."
    )
    reason: str | None = Field(
        default=None, max_length=2000, description="Why: a rejection's reason, an approval's note."
    )
    edited_markdown: str | None = Field(
        default=None,
        max_length=MAX_EDITED_MARKDOWN_CHARS,
        description="An approval only: the block as the reviewer edited it (its Markdown form).",
    )
    user_id: UserId | None = Field(
        default=None,
        description="Optional: the turn knows its user. If given it must be the turn's user; "
        "a decision for another user's diff is refused (UnknownDiff).",
    )


class DiffDecision(DecisionPayload):
    """The `decide` Update's payload; also a decision as the turn applies it (the
    `dmem.decide` activity's input, `user_id` filled in by the turn)."""

    decision: Literal["approve", "reject"] = Field(description="Approve or reject the diff.")


class SignalledDecision(DecisionPayload):
    """The payload of the `approve` and `reject` signals: the signal's name is the decision."""

    decision: Literal["approve", "reject"] | None = Field(
        default=None,
        description="Redundant, accepted for older callers: the signal's name decides. If "
        "given it must agree with the name; a contradiction is refused (logged and ignored).",
    )

    def as_decision(self, kind: Literal["approve", "reject"]) -> DiffDecision:
        """This payload as the decision its signal `kind` makes; ValueError if it names the
        other decision."""
        if self.decision not in (None, kind):
            raise ValueError(
                f"the {kind} signal carries decision '{self.decision}'; send it as the "
                f"'{self.decision}' signal, or without `decision`"
            )
        return DiffDecision(**self.model_dump(exclude={"decision"}), decision=kind)


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
    standing_approval: str | None = None
    """The id of the standing approval that approved it (`decided_by` is then
    `standing:<id>`, and `message` names the person who set it), None if a person decided."""

    @classmethod
    def of_diff(cls, diff: PendingDiff, message: str = "") -> "DecisionOutcome":
        """The diff's outcome as it stands (`message`, if given, instead of its reason)."""
        return cls(
            diff_id=diff.id,
            status=diff.status,
            commit_sha=diff.commit_sha,
            message=message or (diff.decision_reason or ""),
            label=diff.label,
            decided_by=diff.decided_by,
            decided_at=diff.decided_at,
            decision=DECISION_OF_STATUS.get(diff.status),
            standing_approval=diff.standing_approval,
        )


DECISION_OF_STATUS: dict[DiffStatus, Literal["approve", "reject"]] = {
    DiffStatus.APPROVED: "approve",
    DiffStatus.CONFLICTED: "approve",
    DiffStatus.REJECTED: "reject",
}
"""The decision each decided status records (`DecisionOutcome.decision`)."""

# The models that hold a ProposedDiff, whose DecisionOutcome is defined after them: built now,
# not left incomplete. An incomplete model works, but every TypeAdapter of it (what the
# pydantic converter builds for each payload it decodes, with a cache per converter, and the
# SDK makes a converter per workflow activation and per client call) generates its schema
# again: ~0.45 ms for each TurnReply a caller received and each FinishedTurn a turn decoded.
# tests/test_models_built.py keeps every model of ours complete at import.
ProposedDiff.model_rebuild()
StartedTurn.model_rebuild()
FinishedTurn.model_rebuild()
TurnReply.model_rebuild()


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
    activities: ActivitiesSettings | None = Field(
        default=None,
        description="Deprecated and ignored: the worker's `activities` settings apply. "
        "Read only by rotations started before that (patch `worker-rotation-settings`).",
    )


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

    activities: ActivitiesSettings | None = Field(
        default=None,
        description="Deprecated and ignored: the worker's `activities` settings apply. "
        "Read only by sweeps started before that (patch `worker-rotation-settings`).",
    )


class RotationCandidate(BaseModel):
    model_config = ConfigDict(frozen=True)

    user_id: str
    label: str


# -- forgetting a user (workflows/forget.py) ---------------------------------------------


def forget_workflow_id(user_id: str) -> str:
    """One forget per user at a time: a second request while one runs joins it."""
    return f"forget{ID_SEPARATOR}{user_id}"


class ErasureRecord(BaseModel):
    """Who asked to forget a user, why and when; the user only as a SHA-256 of their id."""

    model_config = ConfigDict(frozen=True)

    user_hash: str
    requested_by: str
    reason: str
    started_at: datetime
    completed_at: datetime | None = None
    """None while the erasure is under way."""
    readmitted_at: datetime | None = None
    """When a caller started the user afresh after it (None: nothing is written for them)."""


class ForgetInput(BaseModel):
    model_config = ConfigDict(frozen=True)

    user_id: UserId
    requested_by: str = Field(max_length=200, pattern=r"\S")
    """Who asks for the erasure (not blank)."""
    reason: str = Field(max_length=2000, pattern=r"\S")
    """Why (not blank): kept in the erasure record."""


class ForgetStore(StrEnum):
    """The stores a forget empties of a user, in the order it does (bootstrap.forget_in)."""

    ARCHIVE = "archive"
    """Passages: the embedded store, PostgreSQL, or the user's Weaviate tenant."""
    REPOSITORY = "repository"
    """The git repository: local, or the remote's and this host's clone."""
    ROWS = "rows"
    """Pending diffs, recall and its index, turn bookkeeping, summaries, rotation state, and
    last the user's row in the list of users."""


class ForgetStep(BaseModel):
    model_config = ConfigDict(frozen=True)

    user_id: UserId
    store: ForgetStore


class ForgetOutcome(BaseModel):
    model_config = ConfigDict(frozen=True)

    record: ErasureRecord
    deleted: dict[str, int]
    """Per step, how many things it deleted (rows, passages, repositories, executions)."""
