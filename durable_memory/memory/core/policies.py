"""Standing approvals: a human's decision, made once, that the agent's edits of named kinds
to one block are approved without asking each time (issue 20, section 3).

The rules only: what a standing approval is, which proposals it covers, and its text form,
the user's `policies.toml`, committed in the user's repository beside the profile record and
read from HEAD. That file can be pushed or edited by hand, so it is untrusted input: a file
that does not parse, or names a block that may not be pre-approved, is refused as a whole
with one clear error and approves nothing.
"""

import tomllib
import typing
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Annotated

import tomli_w
from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, ValidationError

from durable_memory.memory.core.errors import DurableMemoryError, validation_message
from durable_memory.models.blocks import BlockSpec
from durable_memory.models.diffs import STANDING_PREFIX
from durable_memory.models.operations import EditOperation

MAX_STANDING = timedelta(days=366)
"""The longest a standing approval may run: it is renewed on purpose, never kept by default."""
MAX_APPROVALS = 100
"""Standing approvals one user's record holds, revoked ones included."""

OPERATION_KINDS: tuple[str, ...] = tuple(
    member.model_fields["op"].default
    for member in typing.get_args(typing.get_args(EditOperation)[0])
)
"""Every edit operation's name (`append`, `add_context`, ...): what a scope may name."""

PolicyId = Annotated[str, Field(pattern=r"^[0-9a-f]{12}$")]
Name = Annotated[str, Field(pattern=r"^[^\x00-\x1f\x7f<>]{1,100}$")]
"""A person's name as a commit identity takes it (the rule of `validate_author_name`)."""


class PolicyError(DurableMemoryError):
    """A standing approval that cannot be set, revoked or trusted (a record that does not
    parse, a block that may never be pre-approved, an unknown id)."""


class PolicyState(StrEnum):
    LIVE = "live"
    EXPIRED = "expired"
    REVOKED = "revoked"


class StandingApproval(BaseModel):
    """One decision: `set_by` approves, until `expires_at`, the agent's proposals of the
    `operations` kinds to block `label`. Revoked ones stay in the record (who, when)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: PolicyId
    label: Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]{0,47}$")]
    operations: tuple[str, ...] = Field(min_length=1, max_length=len(OPERATION_KINDS))
    set_by: Name
    set_at: AwareDatetime
    expires_at: AwareDatetime
    reason: str = Field(default="", max_length=500)
    revoked_by: Name | None = None
    revoked_at: AwareDatetime | None = None

    @property
    def name(self) -> str:
        """`standing:<id>`: the approver a diff approved by it records."""
        return STANDING_PREFIX + self.id

    @property
    def scope(self) -> str:
        return f"{', '.join(self.operations)} on '{self.label}'"

    def state(self, now: datetime) -> PolicyState:
        if self.revoked_at is not None:
            return PolicyState.REVOKED
        return PolicyState.LIVE if now < self.expires_at else PolicyState.EXPIRED

    def covers(self, label: str, operation: str, now: datetime) -> bool:
        return (
            self.state(now) is PolicyState.LIVE
            and label == self.label
            and operation in self.operations
        )


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")

    approval: list[StandingApproval] = Field(default_factory=list, max_length=MAX_APPROVALS)


def require_pre_approvable(spec: BlockSpec) -> None:
    """Refuse a block the profile marks as never pre-approved (or that the agent cannot edit
    at all): every edit of it waits for a person."""
    if spec.read_only or spec.never_pre_approved:
        raise PolicyError(
            f"block '{spec.label}' may never be pre-approved (its profile marks it "
            f"{'read-only' if spec.read_only else 'never_pre_approved'}): every edit of it "
            "waits for a human decision"
        )


def check_operations(operations: tuple[str, ...]) -> None:
    unknown = [op for op in operations if op not in OPERATION_KINDS]
    if unknown or not operations:
        raise PolicyError(
            f"unknown operation(s) {', '.join(unknown) or '(none given)'}; a standing "
            f"approval names one or more of {', '.join(OPERATION_KINDS)}"
        )


def parse_policies(
    text: str, where: str, spec_of: typing.Callable[[str], BlockSpec]
) -> list[StandingApproval]:
    """The standing approvals of a record (`where` names it in errors), each checked against
    the user's profile (`spec_of(label)` raises for a block it lacks). Anything wrong refuses
    the whole record: a record that is partly trusted could approve what nobody meant to."""
    refused = f"{where} is refused, so no standing approval applies (every edit waits)"
    fix = "restore a valid record from the history (git), then set approvals with `dmem policy`"
    try:
        record = _Record.model_validate(tomllib.loads(text))
    except tomllib.TOMLDecodeError as error:
        raise PolicyError(f"{refused}: it is not valid TOML ({error}); {fix}") from None
    except ValidationError as error:
        raise PolicyError(f"{validation_message(error, refused)}; {fix}") from None
    seen: set[str] = set()
    for approval in record.approval:
        try:
            if approval.id in seen:
                raise PolicyError(f"id {approval.id} appears twice")
            seen.add(approval.id)
            check_operations(approval.operations)
            require_pre_approvable(spec_of(approval.label))
        except DurableMemoryError as error:
            raise PolicyError(f"{refused}: approval {approval.id}: {error}; {fix}") from None
    return record.approval


def format_policies(approvals: list[StandingApproval]) -> str:
    """The record's text: one `[[approval]]` table per standing approval, oldest first."""
    tables = [a.model_dump(mode="python", exclude_none=True) for a in approvals]
    for table in tables:
        table["operations"] = list(table["operations"])
    return (
        "# Standing approvals (docs/governance.md). Change them with `dmem policy set|revoke`:\n"
        "# a record edited by hand that does not parse approves nothing.\n\n"
        + tomli_w.dumps({"approval": tables})
    )


def parse_expiry(text: str, now: datetime) -> datetime:
    """`30d`, `12h` (from `now`) or an ISO 8601 time with its time zone."""
    units = {"d": timedelta(days=1), "h": timedelta(hours=1)}
    count, unit = text[:-1], text[-1:]
    if unit in units and count.isdigit():
        return now + int(count) * units[unit]
    try:
        at = datetime.fromisoformat(text)
    except ValueError:
        at = None
    if at is None or at.tzinfo is None:
        raise PolicyError(
            f"expiry {text!r:.40}: give a duration (30d, 12h) or an ISO 8601 time with its "
            "time zone (2027-01-31T00:00Z)"
        )
    return at


def approving(
    approvals: list[StandingApproval], label: str, operation: EditOperation, now: datetime
) -> StandingApproval | None:
    """The live standing approval (the oldest, if several) covering an edit, None if none."""
    return next((a for a in approvals if a.covers(label, operation.op, now)), None)
